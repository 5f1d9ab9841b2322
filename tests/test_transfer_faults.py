"""KV handoffs under faults, from failures other serving systems reported: aborts in the middle of
a write, KV lost or cut on the wire, transfers that never complete, writers that never start, and
leases that expire. Two real Workers (prefill and decode) on the tiny model, in this process, or
a real server where the router takes part."""

import asyncio
import dataclasses
import threading
import time

import pytest
import zmq

from minipd.sampling_params import SamplingParams
from minipd.transfer import wire
from minipd.transfer.handoffs import Stage
from minipd.transfer.link import LinkEmulator
from minipd.transfer.sender import KVSender
from minipd.workers import messages as m
from minipd.workers.worker import LEASE_CHECK_S
from tests.conftest import make_engine
from tests.helpers import serving, stream_completions, wait_for_idle_workers
from tests.test_worker import PARAMS, Harness, of

TINY = ("--model", "tiny-random", "--threads-per-worker", "1")
SLOW_GBPS = 0.0004  # 200 tokens of KV take 2 s on this link, 20 tokens 0.2 s
OUTAGE_S = 3


class Pair:
    """A prefill worker (0) and a decode worker (1) that hand KV over `transport`; the test plays
    the router."""

    def __init__(self, prefill: Harness, decode: Harness):
        self.prefill, self.decode = prefill, decode
        self.got: list = []
        peers = {i: _peer(h.ready) for i, h in enumerate((prefill, decode))}
        prefill.send(m.SetMode("prefill", "prefill_first", 512, peers))
        decode.send(m.SetMode("decode", "prefill_first", 512, peers))
        self.pump(lambda got: len(of(m.ModeSet, got)) == 2)

    def request(self, key: str, prompt: list[int], params: dict = PARAMS) -> list[int]:
        seat = self.decode.worker.seats.reserve(key, len(prompt), 0, writer=0)
        assert seat is not None
        self.prefill.send(m.AddRequest(key, prompt, params, reader=1, seat=seat))
        return seat

    def abort(self, key: str) -> None:
        """What the router sends when a request ends while its KV is on its way."""
        self.decode.send(m.Abort(key))
        self.prefill.send(m.Abort(key, reader=1))

    def pump(self, until, timeout: float = 10.0, poll_ms: int | None = 1) -> list:
        """Run both workers' loops in turn until until(everything they sent so far). A seat past its
        lease gets its writer asked for its last word, as the router does for a request it ended."""
        deadline = time.monotonic() + timeout
        while not until(self.got):
            assert time.monotonic() < deadline, [x for x in self.got if not isinstance(x, m.WorkerStats)]
            for h in (self.prefill, self.decode):
                h.worker.turn(poll_ms)
                new = h.drain()
                for x in of(m.SeatOverdue, new):
                    self.prefill.send(m.Abort(x.key, reader=1))
                self.got += new
        return self.got

    def idle(self) -> bool:
        return all(h.worker.engine.blocks.num_used == 0 and not len(h.worker.outgoing) and not len(h.worker.seats)
                   for h in (self.prefill, self.decode))  # fmt: skip


def _peer(ready: m.Ready) -> dict:
    return {"kv_address": ready.kv_address, "cache_name": ready.kv_cache_name, "cache_shape": ready.kv_cache_shape,
            "cache_dtype": ready.kv_cache_dtype}  # fmt: skip


@pytest.fixture
def pair(tmp_path, monkeypatch):
    made = []

    def make(transport="tcp", faults="", **spec):
        monkeypatch.setenv("MINIPD_FAULTS", faults)
        harnesses = [Harness(tmp_path, worker_id=i, transport=transport, **spec) for i in (0, 1)]
        made.extend(harnesses)
        return Pair(*harnesses)

    yield make
    for h in made:
        h.close()


def event(kind, key, worker_id=None):
    return lambda x: isinstance(x, m.Event) and x.kind == kind and x.key == key and worker_id in (None, x.worker_id)


def seen(pred):
    return lambda got: any(pred(x) for x in got)


def finished(key):
    return seen(lambda x: isinstance(x, m.Tokens) and x.key == key and x.finished)


def tokens_of(key, got) -> list[int]:
    """The request's reply in order, whichever worker made each token."""
    replies = sorted((x for x in of(m.Tokens, got) if x.key == key), key=lambda x: x.index)
    return [t for x in replies for t in x.token_ids]


def greedy(model, prompt: list[int], params: dict = PARAMS) -> list[int]:
    """The reply of one engine that runs the request alone (with `params`, sampled too)."""
    engine = make_engine(model)
    engine.add_request("r", prompt, SamplingParams.from_dict(params))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


# ---- an aborted handoff leaves the emulated link at once --------------------------------------------
def test_an_aborted_tcp_handoff_leaves_the_link_at_once(pair):
    """Defect: a request aborted while its KV was paced on the emulated link kept the link (and its
    blocks on the prefill worker) until the last byte nobody would read had gone; the next handoff
    to that decode worker waited behind it."""
    p = pair(kv_link_gbps=SLOW_GBPS)
    p.request("a.1", list(range(100, 300)))  # 2 s on the link
    p.pump(lambda got: p.decode.worker.seats.handoffs.get("a.1").stage is Stage.WRITING)  # its BEGIN is in
    aborted = time.monotonic()
    p.abort("a.1")
    p.request("b.1", list(range(400, 420)))  # 0.2 s on the link
    p.pump(seen(event("kv_sent", "a.1")))
    assert time.monotonic() - aborted < 0.5  # the prefill worker's blocks for it went back at once
    p.pump(seen(event("transfer_end", "b.1")))
    assert time.monotonic() - aborted < 1.2  # b's own 0.2 s, not a's remaining 1.8 s as well
    p.pump(lambda got: finished("b.1")(got) and p.idle())


def test_a_stopped_transfer_leaves_the_link_and_its_reader_hears_why(tiny_model):
    """Defect (the same, as the sender sees it): the KV of a stopped transfer stops at once, whether
    queued or on the link; its reader gets a `cancelled` END, and the next transfer on the link
    takes only its own time."""
    prefill = make_engine(tiny_model, role="prefill", kv_cache_tokens=1024)
    for key, n in (("a", 200), ("c", 200), ("b", 20)):
        prefill.add_request(key, list(range(5, 5 + n)), SamplingParams(max_tokens=4, temperature=0))
    while len(prefill.scheduler.handoffs) < 3:
        prefill.step()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    peer = wire.Peer(f"tcp://127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}")
    sender = KVSender(ctx, "tcp", LinkEmulator(gbps=SLOW_GBPS))
    try:
        for key in ("a", "c"):  # a on the link, c queued behind it
            sender.write(key, prefill.handoff_kv(key), dataclasses.asdict(prefill.handoff_meta(key)), peer, [], {})
        assert inbox.poll(2000)  # a's BEGIN: a is on the link
        stopped = time.monotonic()
        sender.abort("a", "the request was aborted")
        sender.abort("c", "the request was aborted")
        sender.write("b", prefill.handoff_kv("b"), dataclasses.asdict(prefill.handoff_meta("b")), peer, [], {})
        done = {}
        while len(done) < 3:
            assert time.monotonic() - stopped < 5
            for key, outcome, error in sender.finished():
                done[key] = (outcome, error, time.monotonic() - stopped)
            time.sleep(0.01)
        assert [done[k][:2] for k in "acb"] == [(wire.CANCELLED, None), (wire.CANCELLED, None), (wire.WRITTEN, None)]
        assert done["a"][2] < 0.3 and done["c"][2] < 0.3 and done["b"][2] < 0.8  # b alone needs 0.2 s
        begins, ends = [], []
        while inbox.poll(100):
            kind, body = wire.parse(inbox.recv_multipart())
            if kind == wire.BEGIN:
                begins.append(body["key"])
            elif kind == wire.END:
                ends.append((body["key"], body["outcome"]))
        assert ends == [("a", wire.CANCELLED), ("c", wire.CANCELLED), ("b", wire.WRITTEN)]
        assert begins == ["a", "b"]  # nothing of c went on the link
    finally:
        sender.close()
        ctx.destroy(linger=0)


# ---- an abort in the middle of a write: its blocks go to nobody else until the write is done ------
def test_an_abort_during_an_in_place_write_gives_its_blocks_to_nobody_until_the_write_is_done(pair):
    """Regression guard (SGLang issue 35049: blocks freed on abort while the transfer still wrote
    into them, so the next request read another's KV)."""
    p = pair(transport="shm")
    d = p.decode.worker
    seat = p.request("a.1", list(range(100, 180)))
    taken = {}

    def abort_and_grab_every_free_block():  # the copy runs: the abort reaches the reader now
        if taken:
            return
        p.decode.send(m.Abort("a.1"))
        free_tokens = d.engine.blocks.num_available * d.engine.blocks.block_size - 1
        taken["b.1"] = d.seats.reserve("b.1", free_tokens, 0, writer=0)
        _fill(d, taken["b.1"], 7.0)

    p.prefill.worker.sender.copy_hook = abort_and_grab_every_free_block
    p.pump(seen(event("seat_released", "a.1")))
    assert taken["b.1"] and not set(taken["b.1"]) & set(seat)
    assert _blocks_hold(d, taken["b.1"], 7.0)  # the write landed in a's seat only
    p.abort("b.1")
    p.pump(lambda got: p.idle())


def test_kv_parts_landing_after_an_abort_never_reach_blocks_given_to_another_request(pair):
    """Regression guard: over tcp the reader gives an aborted seat back at once; parts of its KV
    still arriving must not be written into the blocks, which another request may hold by then."""
    p = pair(transport="tcp")
    d = p.decode.worker
    seat = p.request("a.1", list(range(100, 180)))
    while not seen(event("kv_sent", "a.1"))(p.got):
        p.prefill.worker.turn(1)  # the decode worker reads nothing yet: every KV message waits in its socket
        p.got += p.prefill.drain()
    for _ in range(2):  # BEGIN and one part land
        d._on_kv(d.kv_in.recv_multipart(copy=False))
    p.decode.send(m.Abort("a.1"))
    reused = d.seats.reserve("b.1", d.engine.blocks.num_available * d.engine.blocks.block_size - 1, 0, writer=0)
    assert set(seat) <= set(reused)
    _fill(d, reused, 7.0)
    p.pump(lambda got: not d.kv_in.poll(0))  # the rest of a's KV and its END arrive
    assert _blocks_hold(d, reused, 7.0)
    p.abort("b.1")
    p.pump(lambda got: p.idle())


def _fill(worker, blocks, value) -> None:
    cache, bs = worker.engine.runner.kv_cache, worker.engine.blocks.block_size
    for b in blocks:
        cache[:, :, b * bs : (b + 1) * bs] = value


def _blocks_hold(worker, blocks, value) -> bool:
    cache, bs = worker.engine.runner.kv_cache, worker.engine.blocks.block_size
    return all(bool((cache[:, :, b * bs : (b + 1) * bs] == value).all()) for b in blocks)


# ---- KV lost or cut on the wire: an error, never a reply from the wrong KV ---------------------------
@pytest.mark.parametrize("fault", ["drop_kv_part_on_token", "cut_kv_part_on_token", "reset_kv_link_on_token"])
def test_kv_lost_or_cut_on_the_wire_ends_the_request_with_an_error_and_no_reply(pair, tiny_model, fault):
    """A vLLM report: days of uptime, then replies with HTTP 200 made from wrong KV. Defect for the
    reset: an END `written` whose BEGIN was lost imported the seat with no KV in it. Regression
    guard for a lost or cut part."""
    p = pair(faults=f"{fault}=777")
    hit, fine = [777, *range(100, 140)], list(range(200, 240))
    p.request("hit.1", hit)
    p.request("fine.1", fine)
    got = p.pump(
        lambda got: finished("fine.1")(got) and (of(m.RequestError, got) or finished("hit.1")(got)) and p.idle()
    )
    errors = of(m.RequestError, got)
    assert [(e.key, e.worker_id) for e in errors] == [("hit.1", 1)] and "KV" in errors[0].message
    assert [x for x in of(m.Tokens, got) if x.key == "hit.1" and x.worker_id == 1] == []  # nothing decoded from it
    assert tokens_of("fine.1", got) == greedy(tiny_model, fine)


# ---- a transfer that never completes ends by its lease, idle or busy ----------------------------
def test_a_transfer_slower_than_its_lease_ends_by_the_lease(tiny_model):
    """Defect: the emulated link paced a transfer for as long as its bytes needed, past the
    sender's lease (TensorRT-LLM issue 17124: a transfer that never completes must time out)."""
    prefill = make_engine(tiny_model, role="prefill", kv_cache_tokens=1024)
    prefill.add_request("a", list(range(5, 205)), SamplingParams(max_tokens=4, temperature=0))
    while not prefill.scheduler.handoffs:
        prefill.step()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    peer = wire.Peer(f"tcp://127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}")
    sender = KVSender(ctx, "tcp", LinkEmulator(gbps=SLOW_GBPS), timeout=0.5)  # the KV needs 2 s
    try:
        started = time.monotonic()
        sender.write("a", prefill.handoff_kv("a"), dataclasses.asdict(prefill.handoff_meta("a")), peer, [], {})
        while not (done := sender.finished()):
            assert time.monotonic() - started < 1.5, "the transfer went on past its lease"
            time.sleep(0.01)
        # a lease that ran out is a timeout, not a failure (defect: the client got kv_handoff_failed)
        assert done[0][:2] == ("a", wire.TIMED_OUT) and "within 0.5 s" in done[0][2]
    finally:
        sender.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("busy", [False, True])
def test_a_transfer_that_never_completes_ends_by_its_lease_idle_or_busy(pair, transport, busy):
    """Regression guard (TensorRT-LLM issue 17124): the writer's lease (--kv-transfer-timeout) and
    the reader's (--seat-timeout) both end a transfer whose link goes silent halfway, whether the
    workers are idle or busy with other requests; every block comes back once the link does."""
    lease = 0.6
    faults = f"kv_outage_on_token=777,kv_outage_s={OUTAGE_S}" + (",slow_step_s=0.05" if busy else "")
    p = pair(transport=transport, faults=faults, kv_transfer_timeout=lease, seat_timeout=lease)
    if busy:
        p.request("long.1", [5, 6, 7], {**PARAMS, "max_tokens": 2000})
        p.pump(seen(lambda x: isinstance(x, m.Tokens) and x.key == "long.1" and x.worker_id == 1))
    started = time.monotonic()
    p.request("hit.1", [777, *range(100, 140)])
    writer_failed = seen(lambda x: isinstance(x, m.RequestError) and x.key == "hit.1" and x.worker_id == 0)
    reader_overdue = seen(lambda x: isinstance(x, m.SeatOverdue) and x.key == "hit.1")
    p.pump(lambda got: writer_failed(got) and reader_overdue(got), poll_ms=None)
    assert time.monotonic() - started < lease + LEASE_CHECK_S + 1.0
    p.abort("hit.1")  # the router ends the request and asks the writer for its last word
    p.pump(seen(event("seat_released", "hit.1")), poll_ms=None)
    assert all(h.worker.engine.scheduler.find("hit.1") is None for h in (p.prefill, p.decode))
    if busy:
        assert p.decode.worker.engine.scheduler.find("long.1") is not None  # it went on meanwhile
        p.abort("long.1")
    p.pump(lambda got: p.idle())


# ---- a writer that never starts writing: its reader hears at once ------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_writer_that_fails_to_start_tells_its_reader_at_once(pair, tiny_model, transport):
    """Defect (vLLM issue 50754): the prefill worker failed before it wrote anything; the
    exception left the step's other outputs unsent, and the reader kept the seat for its whole
    lease (then, in place, for ever: its writer's record never ended)."""
    p = pair(transport=transport, faults="fail_kv_write_on_token=777", seat_timeout=60)
    fine = list(range(200, 240))
    p.request("hit.1", [777, *range(100, 140)])
    p.request("fine.1", fine)  # prefilled in the same step
    started = time.monotonic()
    got = p.pump(lambda got: seen(event("seat_released", "hit.1"))(got) and finished("fine.1")(got) and p.idle())
    assert time.monotonic() - started < 5
    assert {e.key for e in of(m.RequestError, got)} == {"hit.1"} and of(m.RequestError, got)[0].worker_id == 0
    assert tokens_of("fine.1", got) == greedy(tiny_model, fine)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_writer_that_refuses_fails_or_dies_before_writing_frees_the_seat_at_once(pair, transport):
    """Regression guard (vLLM issue 50754): a prefill worker that refuses the request, whose step
    fails, or that dies, never makes its reader wait out the lease."""
    p = pair(transport=transport, faults="fail_step_on_token=4242", seat_timeout=60)
    started = time.monotonic()
    p.request("refused.1", [5, 10**9])  # a token the model does not have
    p.request("failed.1", [4242, 7, 8])
    p.pump(lambda got: seen(event("seat_released", "refused.1"))(got) and seen(event("seat_released", "failed.1"))(got))
    assert time.monotonic() - started < 5
    p.request("orphan.1", [5, 6, 7])
    p.decode.send(m.Peers({}, gone=[0]))  # the prefill worker died
    assert p.decode.worker.engine.blocks.num_used == 0 and not len(p.decode.worker.seats)


# ---- end to end: the router, real worker processes, HTTP ------------------------------------------
def completion(server, prompt, **kw):
    return server.post("/v1/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True, **kw})


@pytest.mark.slow
def test_a_kv_link_that_drops_mid_run_never_answers_200_with_wrong_tokens():
    """A vLLM report: after days of uptime, HTTP 200 with garbage. KV parts lost, cut short, or a
    connection reset in the middle of a run: those requests end with an error; every request
    answered 200 has exactly the greedy reply of a run without the fault. Defect: the request
    whose BEGIN the reset lost was answered 200 with a reply made from whatever was in its seat."""
    faults = "drop_kv_part_on_token=777,cut_kv_part_on_token=778,reset_kv_link_on_token=779"
    prompts = [[20 + i, 31, 400 + i] * 8 for i in range(9)]
    for i, token in ((2, 777), (4, 778), (6, 779)):
        prompts[i][0] = token
    with serving(
        *TINY, "--workers", "2", "--mode", "disagg", "--kv-transport", "tcp", env={"MINIPD_FAULTS": faults}
    ) as s:
        faulty = asyncio.run(stream_completions(s.url, prompts, 12))
        assert s.post("/admin/mode", {"mode": "colocated"})[0] == 200  # the KV link is not used any more
        reference = [completion(s, p, max_tokens=12)[1]["choices"][0]["text"] for p in prompts]
        for i, (got, want) in enumerate(zip(faulty, reference)):
            if i in (2, 4, 6):
                assert got["error"] and "KV" in got["error"], got
            else:
                assert got["error"] is None and got["text"] == want, (i, got, want)
        wait_for_idle_workers(s, timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("first", ["writer", "reader"])
def test_a_lease_that_expires_on_either_side_strands_no_block(transport, first):
    """vLLM issue 58222: blocks stranded after a lease expired. A transfer stalls halfway; the
    writer's lease (--kv-transfer-timeout) or the reader's (--seat-timeout) expires first, with the
    workers idle and then busy with another reply: the request ends with an error by the lease, and
    every worker's KV blocks in use return to zero."""
    leases = {"writer": ("--kv-transfer-timeout", "1", "--seat-timeout", "30"),
              "reader": ("--kv-transfer-timeout", "30", "--seat-timeout", "1")}[first]  # fmt: skip
    faults = f"kv_outage_on_token=777,kv_outage_s={OUTAGE_S},slow_step_s=0.01"
    with serving(*TINY, "--workers", "2", "--mode", "disagg", "--kv-transport", transport, *leases,
                 env={"MINIPD_FAULTS": faults}) as s:  # fmt: skip
        started = time.monotonic()
        status, body = completion(s, [777, 1, 2, 3], max_tokens=3)
        assert status == 503 and time.monotonic() - started < 5, body
        wait_for_idle_workers(s, timeout=10)
        time.sleep(max(0.0, started + OUTAGE_S + 0.5 - time.monotonic()))  # the link is back

        decoding, long = threading.Event(), []
        reply = stream_completions(s.url, [[5, 6, 7]], 300, on_token=lambda i: decoding.set())
        busy = threading.Thread(target=lambda: long.extend(asyncio.run(reply)))
        busy.start()  # the workers are busy with it while the next transfer stalls
        assert decoding.wait(10)
        started = time.monotonic()
        status, body = completion(s, [777, 4, 5, 6], max_tokens=3)
        assert status == 503 and time.monotonic() - started < 5, body
        busy.join()
        assert long[0]["error"] is None, long
        wait_for_idle_workers(s, timeout=10)
        time.sleep(max(0.0, started + OUTAGE_S + 0.5 - time.monotonic()))
        status, body = completion(s, [1, 2, 3], max_tokens=3)
        assert status == 200, body
