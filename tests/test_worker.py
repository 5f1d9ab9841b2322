"""A real Worker on the tiny model, driven in this process message by message: nothing a request
or a message does may end it, and its handoff records follow the protocol."""

import os
import time

import msgpack
import pytest
import zmq

from minipd.workers import messages as m
from minipd.workers.launch import WorkerSpec
from minipd.workers.worker import Worker

TINY = {"model": "tiny-random", "dtype": "float32", "block_size": 16, "kv_cache_tokens": 1024, "threads": 1}
PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class Harness:
    """A worker plus the socket its messages come back to."""

    def __init__(self, tmp_path, worker_id=0, transport="tcp", **spec):
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        main = f"ipc://{tmp_path}/main{worker_id}"
        self.inbox.bind(main)
        self.worker = Worker(WorkerSpec(worker_id, dict(TINY), f"ipc://{tmp_path}/w{worker_id}", main,
                                        kv_transport=transport, tag=f"test{id(self)}", **spec))  # fmt: skip
        self.ready = self.recv()
        assert isinstance(self.ready, m.Ready)

    def recv(self, timeout=5.0):
        if not self.inbox.poll(int(timeout * 1000)):
            raise TimeoutError("no message from the worker")
        return m.decode(self.inbox.recv())

    def drain(self) -> list:
        out = []
        while self.inbox.poll(0):
            out.append(m.decode(self.inbox.recv()))
        return out

    def send(self, msg) -> None:
        self.worker.handle(msg)

    def run_until(self, pred, timeout=5.0) -> list:
        """Run the worker's loop, collecting what it sends, until pred(messages)."""
        got, deadline = [], time.monotonic() + timeout
        w = self.worker
        while not pred(got):
            assert time.monotonic() < deadline, got
            w.turn(poll_ms=1)
            got += self.drain()
        return got

    def close(self):
        self.worker.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        kw.setdefault("worker_id", len(made))
        h = Harness(tmp_path, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def of(kind, msgs):
    return [x for x in msgs if isinstance(x, kind)]


def test_bad_and_unexpected_messages_are_ignored(harness):
    h = harness()
    w = h.worker
    push = h.ctx.socket(zmq.PUSH)
    push.connect(w.spec.control_address)
    push.send(b"\x00not msgpack")
    push.send(msgpack.packb(["NoSuchMessage", 1, 2]))
    push.send(m.encode(m.Tokens("k", 0, [1], 0.0)))  # a worker -> main message sent the wrong way
    push.send(m.encode(m.AddRequest("ok", [5, 6, 7], PARAMS)))
    got = h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)))
    assert [x.key for x in of(m.Tokens, got)] == ["ok"] * 4
    push.close(linger=0)


def test_errors_that_belong_to_a_request_end_only_that_request(harness):
    h = harness()
    h.send(m.AddRequest("bad-ids", [5, 10**9], PARAMS))
    h.send(m.AddRequest("bad-params", [5], {"max_tokens": 0}))
    h.send(m.AddRequest("fine", [5, 6], PARAMS))
    h.send(m.AddRequest("fine", [5, 6], PARAMS))  # the same key twice
    # a seat asked again while the first is still here is "no room now", not an error: a move
    # refused by its source is asked again before the source's cancel lands (see test_handoffs)
    h.send(m.ReserveSeats(1, [["seat", 10, 0, 1], ["seat", 10, 0, 1]]))
    got = h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)))
    errors = {e.key: e.message for e in of(m.RequestError, got)}
    assert set(errors) == {"bad-ids", "bad-params", "fine"}
    assert "already" in errors["fine"]
    reply = of(m.SeatsReserved, got)[0]
    assert reply.results[0][1] is not None and reply.results[1][1] is None


def test_a_failing_step_ends_its_requests_and_the_worker_goes_on(harness):
    h = harness()
    run = h.worker.engine.runner.run

    def failing(batch):
        if any(4242 in s.token_ids for s in batch.seqs):
            raise RuntimeError("out of memory (pretend)")
        return run(batch)

    h.worker.engine.runner.run = failing
    h.send(m.AddRequest("poison", [4242, 7], PARAMS))
    got = h.run_until(lambda msgs: of(m.RequestError, msgs))
    assert "out of memory" in of(m.RequestError, got)[0].message
    assert h.worker.engine.blocks.num_used == 0
    h.send(m.AddRequest("after", [8, 9], PARAMS))
    got = h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)))
    assert of(m.Tokens, got)[-1].key == "after"


def test_set_mode_waits_for_a_handoff_in_flight_instead_of_dying(harness):
    """Defect: SetMode while the prefill worker was still sending a request's KV made
    Engine.set_role raise in the worker loop, which killed the worker."""
    prefill = harness(worker_id=0)
    decode = harness(worker_id=1)
    peers = {1: {"kv_address": decode.worker.kv_address}}
    prefill.send(m.SetMode("prefill", "prefill_first", 512, peers))
    decode.send(m.SetMode("decode", "prefill_first", 512, {}))
    prefill.run_until(lambda msgs: of(m.ModeSet, msgs))
    decode.run_until(lambda msgs: of(m.ModeSet, msgs))
    prefill.worker.sender.link.latency_ms = 300  # a slow link: the KV is still on its way for a while
    seat = decode.worker.seats.reserve("r.1", 3, 0, writer=0)
    prefill.send(m.AddRequest("r.1", [5, 6, 7], PARAMS, reader=1, seat=seat))
    prefill.run_until(lambda msgs: of(m.Tokens, msgs))  # first token made: the handoff starts
    prefill.send(m.Abort("r.1", reader=1))  # the request ends while its KV is in flight
    prefill.send(m.SetMode("both", "prefill_first", 512, peers))
    got = prefill.run_until(lambda msgs: of(m.ModeSet, msgs), timeout=10)
    assert of(m.ModeSet, got)[0].error is None and prefill.worker.engine.scheduler.config.role == "both"
    assert prefill.worker.engine.blocks.num_used == 0


def test_a_new_role_applies_at_once_and_running_requests_keep_their_own_way(harness):
    """A live switch: the role is the default for requests that come next. One running as `both`
    when the worker becomes a prefill worker is not handed off to nobody: it finishes here."""
    h = harness()
    h.send(m.AddRequest("long", [5], {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}))
    first = h.run_until(lambda msgs: of(m.Tokens, msgs))  # one or more Tokens messages, as they came
    h.send(m.SetMode("prefill", "prefill_first", 512, {}))
    got = h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)), timeout=20)
    assert of(m.ModeSet, got)[0].error is None and h.worker.engine.scheduler.config.role == "prefill"
    assert sum(len(x.token_ids) for x in of(m.Tokens, first + got)) == 40 and not of(m.RequestError, got)
    assert h.worker.engine.blocks.num_used == 0


def test_an_abort_the_writer_cannot_place_still_tells_the_reader(harness):
    """The writer never got the request (a lost message): its reader must still hear that
    nothing will be written, or the seat would never come back."""
    prefill = harness(worker_id=0, transport="shm")
    decode = harness(worker_id=1, transport="shm")
    r = decode.ready
    peer = {"kv_address": r.kv_address, "cache_name": r.kv_cache_name, "cache_shape": r.kv_cache_shape,
            "cache_dtype": r.kv_cache_dtype}  # fmt: skip
    prefill.send(m.SetMode("prefill", "prefill_first", 512, {1: peer}))
    decode.worker.seats.reserve("lost.1", 20, 0, writer=0)
    decode.send(m.Abort("lost.1"))
    assert decode.worker.engine.blocks.num_used > 0  # in place: it waits for the writer's word
    prefill.send(m.Abort("lost.1", reader=1))
    prefill.run_until(lambda msgs: True)
    decode.run_until(lambda msgs: of(m.Event, msgs))
    assert decode.worker.engine.blocks.num_used == 0


def test_a_worker_that_can_run_nothing_does_not_spin(harness):
    """Defect: with requests waiting and no free block, every loop sent an empty Step and stats."""
    h = harness()
    e = h.worker.engine
    e.blocks.add_seat("hog", e.blocks.num_available)  # every block taken by a seat
    h.send(m.AddRequest("waits", [5, 6, 7], PARAMS))
    h.drain()
    for _ in range(50):
        h.worker._step()
    assert h.worker.stuck and not [x for x in h.drain() if isinstance(x, (m.Step, m.WorkerStats))]
    e.blocks.release_seat("hog")
    got = h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)))
    assert of(m.Tokens, got)[-1].key == "waits"


def test_closing_a_worker_removes_its_shared_memory_cache(tmp_path):
    h = Harness(tmp_path, transport="shm")
    path = f"/dev/shm/{h.worker.cache_segment.name}"
    assert os.path.exists(path)
    h.close()
    assert not os.path.exists(path)


def test_a_worker_gives_free_heap_back_once_idle_after_serving(harness):
    h = harness()
    w = h.worker
    w.idle_trim.after_s = 0.05
    asked = []
    w.idle_trim.trim = asked.append
    h.send(m.AddRequest("r", [5, 6, 7], PARAMS))
    h.run_until(lambda msgs: any(x.finished for x in of(m.Tokens, msgs)))
    assert asked == []  # not while it served
    deadline = time.monotonic() + 5
    while not asked and time.monotonic() < deadline:
        w.turn(poll_ms=10)
    assert asked == [0]
    for _ in range(20):
        w.turn(poll_ms=1)
    assert asked == [0]  # once per idle spell
