"""Pieces of the main process, without processes: token order, who holds a request, lost tokens."""

import asyncio
import time
from unittest import mock

import pytest

from minipd.sampling_params import SamplingParams
from minipd.server.choices import Reply
from minipd.server.metrics import Metrics
from minipd.server.modes import Mode
from minipd.server.moves import MoveRecord, summary
from minipd.server.relay import Relay
from minipd.server.request_state import Placement, RequestState
from minipd.server.router import Router
from minipd.server.worker_pool import WorkerHandle
from minipd.workers import messages as m


class FakePool:
    """Workers that are up and take every message; what was sent to them is kept in `sent`."""

    def __init__(self, roles: list[str], num_blocks: int = 64, block_size: int = 16):
        self.workers = [WorkerHandle(i, {}, "cpu", role=role, state="up",
                                     info=m.Ready(i, 0, 0, "cpu", "", num_blocks, block_size, 1))
                        for i, role in enumerate(roles)]  # fmt: skip
        self.sent: list[tuple[int, object]] = []
        self.spec_defaults = {"seat_timeout": 300.0}
        self.silent: dict[int, float] = {}  # worker id -> seconds it has shown no sign of life

    def send(self, worker_id: int, msg) -> bool:
        self.sent.append((worker_id, msg))
        return True

    def with_role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive and w.role == role]

    def peers(self) -> dict:
        return {}

    def hung_for(self, w: WorkerHandle, now: float) -> float:
        return self.silent.get(w.worker_id, 0.0)

    def taken(self, kind: type) -> list[tuple[int, object]]:
        """The messages of a kind sent since the last call."""
        out = [(w, msg) for w, msg in self.sent if isinstance(msg, kind)]
        self.sent = [x for x in self.sent if not isinstance(x[1], kind)]
        return out


def serving_router(pool: FakePool) -> Router:
    router = Router(pool, None, Metrics("m"))
    router.serving.set()
    router.ready = True
    return router


async def placed(router: Router) -> None:
    await asyncio.wait_for(asyncio.gather(*router.tasks), timeout=5)


async def sent(pool: FakePool, kind: type) -> list[tuple[int, object]]:
    """The messages of a kind sent once the tasks under way have gone as far as they can."""
    for _ in range(100):
        await asyncio.sleep(0)
    return pool.taken(kind)


async def a_reply_on_a_draining_worker() -> tuple[FakePool, Router, object]:
    """One reply placed on worker 0 of two, which is then drained: any move of it asks worker 1 for a seat."""
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    state = router.submit("r", [1, 2], SamplingParams(max_tokens=30))
    await placed(router)
    pool.workers[0].draining = True
    return pool, router, state


def seats_answered(router: Router, reader: int, ask, blocks: list[int] | None) -> None:
    router.on_message(m.SeatsReserved(ask.batch, reader, [[key, blocks] for key, *_ in ask.seats]))


def test_tokens_from_two_workers_are_relayed_in_order():
    """Defect: the prefill worker's first token and the decode worker's next ones come through
    different sockets; read out of order, the reply was garbled (or lost its first token)."""
    relay = Relay(Metrics("m"))
    state = RequestState("r", [1, 2], SamplingParams(max_tokens=3), None)
    second = m.Tokens("r.1", 1, [20], 2.0, index=1)
    third = m.Tokens("r.1", 1, [30], 3.0, finished=True, finish_reason="length", index=2)
    first = m.Tokens("r.1", 0, [10], 1.0, index=0)
    assert relay.in_order(state, second) == [] and relay.in_order(state, third) == []
    ready = relay.in_order(state, first)
    assert [t.token_ids for t in ready] == [[10], [20], [30]]
    reasons = [relay.tokens(state, t)[0] for t in ready]
    assert reasons == [None, None, "length"] and state.output_token_ids == [10, 20, 30]
    assert relay.in_order(state, first) == []  # a duplicate of something already relayed


@pytest.mark.asyncio
async def test_a_prefill_worker_stops_holding_a_request_once_its_kv_arrived():
    router = serving_router(FakePool(["prefill", "decode"]))
    router.mode = Mode("disagg")
    state = router.requests["r"] = RequestState("r", [1, 2], SamplingParams(max_tokens=3), None)
    router.assign(state, Placement("r.1", worker=0, reader=1, dispatched=True))
    p = state.placement
    assert p.holders == {0, 1}
    router.on_message(m.Event("r.1", 1, "transfer_end", 1.0, {"bytes": 10, "seconds": 0.1}))
    assert p.holders == {1} and p.worker == 1  # its death no longer redoes a request that decodes happily elsewhere
    assert Placement("r.1", worker=0, reader=1).holders == {1}  # not dispatched: only the seat is held


@pytest.mark.asyncio
async def test_a_lost_token_message_redoes_the_request_instead_of_stalling_it():
    """Defect: a Tokens message lost on its way from a worker left the later ones waiting in the relay,
    and the client's stream silent, until the request timeout (10 minutes)."""
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    state = router.submit("r", [1, 2], SamplingParams(max_tokens=3))
    await placed(router)
    [(first, _)] = pool.taken(m.AddRequest)
    router.on_message(m.Tokens("r.1", first, [10], 1.0, index=0))
    router.on_message(m.Tokens("r.1", first, [30], 3.0, index=2))  # index 1 never comes
    with mock.patch("time.monotonic", return_value=time.monotonic() + 0.5):
        router.check_deadlines()
    assert not state.redos and not pool.taken(m.Abort)  # a gap as short as this is reordering, not loss
    with mock.patch("time.monotonic", return_value=time.monotonic() + 30):
        router.check_deadlines()
    assert len(state.redos) == 1 and "lost" in state.redos[0]["cause"]
    assert [(w, a.key) for w, a in pool.taken(m.Abort)] == [(first, "r.1")]
    await placed(router)
    [(again, add)] = pool.taken(m.AddRequest)
    assert add.key == "r.2" and add.output_token_ids == [10]  # only what the client has
    router.on_message(m.Tokens("r.1", first, [20], 2.0, index=1))  # the old attempt's late word: ignored
    router.on_message(m.Tokens("r.2", again, [21], 4.0, index=1))
    router.on_message(m.Tokens("r.2", again, [31], 5.0, finished=True, finish_reason="length", index=2))
    assert state.finished and state.finish_reason == "length" and state.output_token_ids == [10, 21, 31]
    deltas = [state.deltas.get_nowait() for _ in range(state.deltas.qsize())]
    assert sum(d.num_tokens for d in deltas) == 3 and deltas[-1].finish_reason == "length"


@pytest.mark.asyncio
async def test_a_seat_refused_by_an_error_does_not_leave_the_decode_worker_out():
    """Defect: a decode worker that could not seat one request (a RequestError, then None for it in
    SeatsReserved) was taken as full, and, idle, was asked for no seat again until the next switch."""
    pool = FakePool(["prefill", "decode"])
    router = serving_router(pool)
    router.mode = Mode("disagg")
    bad = router.submit("bad", [1, 2], SamplingParams(max_tokens=3))
    [(decoder, ask)] = await sent(pool, m.ReserveSeats)
    router.on_message(m.RequestError("bad.1", decoder, "a seat for 'bad.1' already exists"))
    router.on_message(m.SeatsReserved(ask.batch, decoder, [["bad.1", None]]))
    assert bad.finished and bad.finish_reason == "error"
    good = router.submit("good", [1, 2], SamplingParams(max_tokens=3))
    [(w, ask)] = await sent(pool, m.ReserveSeats)  # at once: the worker's room was never in question
    assert w == decoder and [seat[0] for seat in ask.seats] == ["good.1"]
    router.on_message(m.SeatsReserved(ask.batch, decoder, [["good.1", [0]]]))
    [(_, add)] = await sent(pool, m.AddRequest)
    assert add.key == "good.1" and add.reader == decoder and add.seat == [0] and not good.finished


@pytest.mark.asyncio
async def test_a_seat_refused_for_room_waits_for_the_decode_worker_to_have_more():
    pool = FakePool(["prefill", "decode"])
    router = serving_router(pool)
    router.mode = Mode("disagg")
    state = router.submit("r", [1, 2], SamplingParams(max_tokens=3))
    [(decoder, ask)] = await sent(pool, m.ReserveSeats)
    stats = m.WorkerStats(decoder, "decode", 3, 0, 60, 0, 4, 64, 0, {})
    router.on_message(stats)
    router.on_message(m.SeatsReserved(ask.batch, decoder, [["r.1", None]]))
    assert not await sent(pool, m.ReserveSeats) and not state.finished  # full: not asked again ...
    router.on_message(stats)
    assert not await sent(pool, m.ReserveSeats)
    router.on_message(m.WorkerStats(decoder, "decode", 2, 0, 40, 0, 4, 64, 0, {}))
    [(w, ask)] = await sent(pool, m.ReserveSeats)  # ... until it has more room than when it refused
    assert w == decoder and [seat[0] for seat in ask.seats] == ["r.1"]


@pytest.mark.asyncio
async def test_a_move_whose_kv_lands_before_its_source_says_it_started_still_counts_its_tokens():
    """Defect: the reader's transfer_end came in before the source's move_start (two sockets), and
    the move's record said 'tokens': 0, for a move of 507 tokens."""
    from minipd.server.moves import MoveRecord

    router = serving_router(FakePool(["both", "both"]))
    mover = router.mover
    mover.pending["k"] = (MoveRecord("r", "k", 0, "switch", time.time(), target=1), asyncio.get_running_loop().create_future())
    mover.arrived("k", {"bytes": 259072, "seconds": 0.01, "tokens": 507})  # move_start never seen before it
    assert mover.recent[-1]["tokens"] == 507 and mover.recent[-1]["outcome"] == "moved"


@pytest.mark.asyncio
async def test_requests_waiting_to_be_placed_count_as_waiting():
    """Defect: requests held at the door (a draining switch) or waiting for a worker of their role
    were not in minipd:num_requests_waiting, which said 0 while five waited."""
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    router.serving.clear()  # the door is closed, as during a {"drain": true} switch
    for i in range(5):
        router.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=3))
    await asyncio.sleep(0)
    assert 'minipd:num_requests_waiting{model_name="m"} 5.0' in router.metrics.render().decode()
    router.serving.set()
    await placed(router)
    assert 'minipd:num_requests_waiting{model_name="m"} 0.0' in router.metrics.render().decode()


@pytest.mark.asyncio
async def test_a_kv_handoff_past_its_lease_ends_as_a_503_timeout_not_a_500():
    """Defect: a handoff that outlived --kv-transfer-timeout (a link too slow for the prompt) ended the
    request as a 500 server_error, as if the server were broken; it is a limit, and a retry may pass."""
    from minipd.server.app import Api

    router = serving_router(FakePool(["prefill", "decode"]))
    router.mode = Mode("disagg")
    state = router.requests["r"] = RequestState("r", [1, 2], SamplingParams(max_tokens=3), None)
    router.assign(state, Placement("r.1", worker=0, reader=1, dispatched=True, first_token_at=time.monotonic()))
    with mock.patch("time.monotonic", return_value=time.monotonic() + router.limits.kv_transfer_timeout + 1):
        router.check_deadlines()
    assert state.finished
    delta = state.deltas.get_nowait()
    assert (delta.error_status, delta.error_code) == (503, "kv_handoff_timeout") and "handoff" in delta.error
    state.deltas.put_nowait(delta)
    api = Api(router, "m", 64)
    with pytest.raises(Exception) as failed:
        await api._collect(Reply("r", [state], False, [None], api._token_text, len(state.prompt_token_ids)))
    body = failed.value.body()["error"]
    assert failed.value.status == 503 and body["code"] == "kv_handoff_timeout" and body["type"] == "server_error"


@pytest.mark.asyncio
async def test_a_kv_handoff_that_failed_on_a_worker_is_a_503_and_other_worker_errors_stay_500():
    router = serving_router(FakePool(["prefill", "decode"]))
    router.mode = Mode("disagg")
    ends = {}
    for rid, code in (("a", "kv_handoff_failed"), ("b", None)):
        state = router.requests[rid] = RequestState(rid, [1, 2], SamplingParams(max_tokens=3), None)
        router.assign(state, Placement(f"{rid}.1", worker=0, reader=1, dispatched=True))
        router.on_message(m.RequestError(f"{rid}.1", 0, "KV handoff failed: the decode worker did not take it", code))
        delta = state.deltas.get_nowait()
        ends[rid] = (delta.error_status, delta.error_code)
    assert ends == {"a": (503, "kv_handoff_failed"), "b": (500, None)}


@pytest.mark.asyncio
async def test_a_request_is_marked_dispatched_before_its_worker_can_report_on_it():
    """Defect: 'dispatched' was stamped after the send returned, so a fast worker's prefill_start
    could come before it in the timeline."""
    pool = FakePool(["both"])
    seen = []
    send = pool.send
    pool.send = lambda worker_id, msg: seen.append(dict(state.events)) or send(worker_id, msg)
    router = serving_router(pool)
    state = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=2))
    await placed(router)
    assert "dispatched" in seen[0] and seen[0]["dispatched"] == state.events["dispatched"]


@pytest.mark.asyncio
async def test_moves_still_under_way_when_a_switch_stops_waiting_are_counted_not_dropped():
    """Defect: a switch that stopped waiting for its moves reported moved 0, not_moved 0 while two
    were under way (and then failed)."""
    router = serving_router(FakePool(["both", "both"]))
    state = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=2))

    async def forever(state, reason):
        await asyncio.sleep(3600)

    router.mover.move = forever
    records = await router.mover.move_all([state], "switch", 0.01)
    assert [x.outcome for x in records] == ["under_way"] and summary(records)["not_moved"] == 1
    for task in list(router.tasks):
        task.cancel()


@pytest.mark.asyncio
async def test_the_mode_report_names_the_replies_a_switch_is_still_moving():
    """Defect: while a switch's moves ran (10 s on a slow link), GET /admin/mode showed the new mode
    and the previous switch, with nothing to say this one was not over."""
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    state = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=2))
    router.mover.misplaced = lambda: [state]
    moving = asyncio.Event()

    async def slow_move(state, reason):
        moving.set()
        await asyncio.sleep(3600)

    router.mover.move = slow_move
    switch = asyncio.ensure_future(router.set_mode(Mode("disagg", 1, 1)))
    for worker_id, msg in await sent(pool, m.SetMode):
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    await asyncio.wait_for(moving.wait(), 5)
    report = router.mode_report()
    assert report["mode"] == "disagg" and report["moving"] == ["r"] and "switching_to" not in report
    switch.cancel()
    for task in list(router.tasks):
        task.cancel()


@pytest.mark.asyncio
async def test_a_reply_whose_move_failed_is_redone_on_a_decode_worker_not_across_the_link_again():
    """Defect: a move that timed out on a slow link was redone through a prefill worker, whose
    handoff crossed the same link and timed out too: the client got an error after 120 s."""
    pool = FakePool(["prefill", "decode"])
    router = serving_router(pool)
    router.mode = Mode("disagg")
    state = router.requests["r"] = RequestState("r", [1, 2, 3], SamplingParams(max_tokens=8), None)
    state.output_token_ids = [5, 6]
    router.assign(state, Placement("r.1", worker=0, reader=1, dispatched=True))
    router.mover.pending["r.1"] = (MoveRecord("r", "r.1", 0, "switch", time.time()), asyncio.get_running_loop().create_future())
    state.placement.first_token_at = time.monotonic()
    with mock.patch("time.monotonic", return_value=time.monotonic() + 3600):
        router.check_deadlines()
    assert len(state.redos) == 1 and "move" in state.redos[0]["cause"]
    [(worker, add)] = await sent(pool, m.AddRequest)
    assert worker == 1 and add.reader is None and add.output_token_ids == [5, 6] and state.path == "local"


@pytest.mark.asyncio
async def test_a_reply_with_one_token_left_is_not_moved_off_a_worker_that_can_no_longer_decode():
    """It ends at its next token where it is: a seat and a KV transfer elsewhere would make nothing."""
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    long = router.submit("long", [1, 2], SamplingParams(max_tokens=30))
    last = router.submit("last", [1, 2], SamplingParams(max_tokens=3))
    await placed(router)
    last.output_token_ids = [5, 6]
    for w in pool.workers:
        w.role = "prefill"  # a switch (or a drain) left neither able to decode
    assert router.mover.misplaced() == [long]
    pool.workers[1].role = "decode"  # a handoff whose reader's role changed while the KV crossed
    router.mode = Mode("disagg")
    one = router.requests["one"] = RequestState("one", [1, 2], SamplingParams(max_tokens=2), None)
    router.assign(one, Placement("one.1", worker=1, reader=0, dispatched=True))
    pool.taken(m.ReserveSeats)  # its first token, made by the prefill worker, has not come through yet:
    router.on_message(m.Event("one.1", 0, "transfer_end", 1.0, {"bytes": 10, "seconds": 0.1, "tokens": 3}))
    assert await sent(pool, m.ReserveSeats) == [] and one.moves == []


@pytest.mark.asyncio
async def test_a_redo_one_token_short_runs_on_a_prefill_worker_alone_and_says_so():
    pool = FakePool(["prefill", "decode"])
    router = serving_router(pool)
    router.mode = Mode("disagg")
    state = router.requests["r"] = RequestState("r", [1, 2, 3], SamplingParams(max_tokens=3), None)
    router.assign(state, Placement("r.1", worker=0, reader=1, dispatched=True))
    router.on_message(m.Event("r.1", 1, "transfer_end", 1.0, {"bytes": 10, "seconds": 0.1}))
    state.output_token_ids = [5, 6]
    router.on_worker_lost(1, "killed")
    [(worker, add)] = await sent(pool, m.AddRequest)
    assert worker == 0 and add.reader is None and add.seat is None and add.output_token_ids == [5, 6]
    assert state.path == "prefill_only" and state.prefill_worker == state.decode_worker == 0
    assert await sent(pool, m.ReserveSeats) == []


def test_preemptions_are_counted_in_metrics_as_vllm_counts_them():
    """A decode worker preempting 40 times per reply showed it only in /admin/workers: /metrics had no
    num_preemptions (vLLM's vllm:num_preemptions_total). A restarted worker counts from 0 again."""
    router = serving_router(FakePool(["both", "both"]))

    def total() -> float:
        return router.metrics.registry.get_sample_value("minipd:num_preemptions_total", {"model_name": "m"})

    for worker, preempted in [(0, 3), (1, 2), (0, 5), (0, 5), (1, 1), (1, 4)]:  # worker 1 restarted at 1
        router.on_message(m.WorkerStats(worker, "both", 1, 0, 8, 0, 0, 64, preempted, {}))
    assert total() == 5 + 2 + 4


@pytest.mark.asyncio
async def test_a_second_move_of_a_request_whose_move_is_asking_for_a_seat_says_it_is_under_way():
    """Defect (two drains of one worker at once): the second move of the same request asked for a
    second seat under the same key and answered, 5 s later, 'no worker that can decode had room'."""
    pool, router, state = await a_reply_on_a_draining_worker()
    first = asyncio.ensure_future(router.mover.move(state, "drain"))
    await sent(pool, m.ReserveSeats)
    second = await asyncio.wait_for(router.mover.move(state, "drain"), 1)
    assert second.outcome == "under_way" and "under way" in second.detail
    assert not first.done()
    first.cancel()


def test_the_finished_timelines_kept_are_bounded_by_their_token_times_too():
    """Defect (a hostile-client helper): 2,000 finished timelines were kept whatever their length; with
    replies of 4,000 tokens their token times alone were about 250 MB of the main process."""
    router = serving_router(FakePool(["both"]))
    t = time.time()
    for i in range(2000):
        state = RequestState(f"r{i}", [1], SamplingParams(max_tokens=4000), None)
        state.token_times = [t + j * 1e-3 for j in range(4000)]
        router.requests[state.request_id] = state
        router._end(state, "length")
    kept = [router.timeline(f"r{i}") for i in range(2000)]
    assert sum(len(tl["token_times"]) for tl in kept if tl) <= 1_000_000
    assert kept[-1]["token_times"] == [t + j * 1e-3 for j in range(4000)] and kept[0] is None
    for i in range(2500):  # short replies: the newest 2,000 are kept
        short = RequestState(f"s{i}", [1], SamplingParams(), None)
        short.token_times = [t]
        router.requests[short.request_id] = short
        router._end(short, "stop")
    assert router.timeline("s499") is None and router.timeline("s500") is not None and len(router.finished) == 2000


@pytest.mark.asyncio
@pytest.mark.parametrize("mode,roles", [(Mode(), ["both", "both", "both"]),
                                        (Mode("disagg", 1, 2), ["prefill", "decode", "decode"])])  # fmt: skip
async def test_a_new_request_is_not_placed_on_a_worker_that_shows_no_sign_of_life(mode, roles):
    """Defect (a live-traffic pass): a worker stopped by SIGSTOP still got its share of new requests
    (the least loaded, it seemed), each frozen until --worker-timeout replaced the worker a minute later.
    Placements and seats go to the workers that answer; the silent one only if there is no other."""
    pool = FakePool(roles)
    router = serving_router(pool)
    router.mode = mode
    pool.silent[1] = 12.0
    for i in range(4):
        router.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=3))
        if mode.name == "disagg":
            [(w, ask)] = await sent(pool, m.ReserveSeats)
            assert w == 2, w
            router.on_message(m.SeatsReserved(ask.batch, w, [[seat[0], [i]] for seat in ask.seats]))
        [(w, add)] = await sent(pool, m.AddRequest)
        assert w != 1 and add.reader in (None, 2), (w, add)
    if mode.name == "colocated":  # every worker silent: placed all the same (the supervisor decides)
        pool.silent = {0: 9.0, 1: 9.0, 2: 9.0}
        router.submit("last", [1, 2], SamplingParams(max_tokens=3))
        assert len(await sent(pool, m.AddRequest)) == 1


@pytest.mark.asyncio
async def test_a_move_that_ends_after_its_request_finished_is_in_the_finished_timeline():
    """Defect: the timeline of a finished request is kept as it was when the request ended, and a
    move still waiting for its seat then ended after it: GET /v1/requests/{id}/timeline never
    showed that move, though /admin/events and the metrics counted it."""
    pool, router, state = await a_reply_on_a_draining_worker()
    move = asyncio.ensure_future(router.mover.move(state, "drain"))
    [(reader, ask)] = await sent(pool, m.ReserveSeats)
    router._end(state, finish_reason="stop")
    seats_answered(router, reader, ask, [7])
    record = await asyncio.wait_for(move, 1)
    assert (record.outcome, record.target) == ("ended", None), record  # not "no_seat": there was room
    assert [mv["outcome"] for mv in router.timeline("r")["moves"]] == ["ended"]


@pytest.mark.asyncio
async def test_a_switch_does_not_wait_for_a_seat_that_no_worker_has_room_for():
    """Defect (a helper, 8 long replies, chunked -> disagg with one decode worker): a reply's move
    waited for a seat until the reply ended, 6.5-8.3 s, and the switch answered only then. Moves
    still asking for a seat after the switch's patience are reported under way; the switch answers."""
    pool, router, state = await a_reply_on_a_draining_worker()
    started = time.monotonic()
    moving = asyncio.ensure_future(router.mover.move_all([state], "switch", timeout=30.0, seat_patience=0.2))
    [(reader, ask)] = await sent(pool, m.ReserveSeats)
    await asyncio.sleep(0.5)  # a seat slow to come (no answer yet) is waited for
    assert not moving.done()
    seats_answered(router, reader, ask, None)  # no room
    records = await asyncio.wait_for(moving, 2.0)
    assert time.monotonic() - started < 2.5
    assert [x.outcome for x in records] == ["under_way"] and "seat" in records[0].detail
    for task in list(router.tasks):
        task.cancel()


@pytest.mark.asyncio
async def test_a_move_whose_request_was_redone_while_its_seat_was_sought_does_not_say_it_ended():
    """Defect (review): a request placed anew (a redo after its worker was lost) while its move
    sought a seat was recorded 'ended', 'the request ended', though it was still running."""
    from minipd.server.request_state import Placement

    pool, router, state = await a_reply_on_a_draining_worker()
    move = asyncio.ensure_future(router.mover.move(state, "drain"))
    [(reader, ask)] = await sent(pool, m.ReserveSeats)
    state.placement = Placement(state.new_key())  # as a redo places it
    seats_answered(router, reader, ask, [7])
    record = await asyncio.wait_for(move, 1)
    assert record.outcome == "no_seat" and "redone" in record.detail and not state.finished, record
