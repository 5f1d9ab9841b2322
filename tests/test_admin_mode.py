"""GET /admin/mode and /admin/workers while the server starts and while it switches, without processes."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from minipd.server.app import Api
from minipd.server.errors import Conflict, InvalidRequest, Unavailable
from minipd.server.metrics import Metrics
from minipd.server.modes import Mode, requested_mode
from minipd.server.router import Router
from minipd.workers import messages as m

DISAGG = {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}


class Pool:
    """Two workers; what is sent to them is kept, and they answer when the test says so."""

    def __init__(self):
        up = {"pid": 1, "state": "up", "alive": True, "role": "both", "device": "cpu", "incarnation": 0, "step_s": 0.0,
              "draining": False}
        self.workers = [
            SimpleNamespace(**up, worker_id=i, restarts=[], num_restarts=0, exit_cause=None, info=None, stats=None) for i in range(2)
        ]
        self.sent = []
        self.silent = {}  # worker id -> seconds it has shown no sign of life

    def peers(self) -> dict:
        return {}

    def hung_for(self, w, now: float) -> float:
        return self.silent.get(w.worker_id, 0.0)

    def send(self, worker_id: int, msg) -> None:
        self.sent.append((worker_id, msg))


def serving_router(pool: Pool | None = None) -> Router:
    """A router past its start, over `pool` (two fake workers by default)."""
    router = Router(pool or Pool(), None, Metrics("m"))
    router.ready = True
    return router


async def switch_sent(router: Router, mode: Mode) -> tuple[asyncio.Future, list]:
    """A switch started, once every worker was sent its role: (the switch, what was sent)."""
    pool = router.pool
    switch = asyncio.ensure_future(router.set_mode(mode))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    sent, pool.sent = pool.sent, []
    return switch, sent


async def reported(api: Api) -> dict:
    mode = json.loads((await api.get_mode(None)).text)
    assert json.loads((await api.workers(None)).text)["mode"] == mode
    return mode


async def switch_and_report(router: Router, api: Api, mode: Mode) -> dict:
    """What the server reports while the workers take their roles for `mode`."""
    pool = router.pool
    pool.sent.clear()
    switch = asyncio.ensure_future(router.set_mode(mode))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    during = await reported(api)
    for worker_id, msg in pool.sent:
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    await switch
    return during


@pytest.mark.asyncio
async def test_a_server_starting_into_disagg_reports_disagg_until_it_serves_it():
    mode = Mode("disagg", 1, 1)
    router = Router(Pool(), None, Metrics("m"), target=mode)  # as `minipd serve --mode disagg` makes it
    api = Api(router, "m", 128)
    assert await reported(api) == {**DISAGG, "starting": True}  # the workers are still loading
    assert await switch_and_report(router, api, mode) == {**DISAGG, "starting": True}
    router.ready = True
    assert await reported(api) == DISAGG
    during = await switch_and_report(router, api, Mode("chunked", chunk_tokens=64))
    assert during == {**DISAGG, "switching_to": {"mode": "chunked", "chunk_tokens": 64}}
    after = await reported(api)
    last = after.pop("last_switch")
    assert after == {"mode": "chunked", "chunk_tokens": 64}
    assert last["changed"] and last["from"] == DISAGG and last["to"] == after and last["moved"] == 0
    assert [w.role for w in router.pool.workers] == ["both", "both"]
    same = await router.set_mode(Mode("chunked", chunk_tokens=64))
    assert same["changed"] is False and (await reported(api))["last_switch"] == same


@pytest.mark.asyncio
async def test_a_client_that_gives_up_mid_switch_never_leaves_workers_and_router_disagreeing():
    """Defect: POST /admin/mode set the workers' roles, then awaited their acks; a client that gave
    up then (aiohttp cancels its handler) left the router in the old mode with re-roled workers."""
    router = serving_router()
    pool = router.pool
    handler = asyncio.ensure_future(router.set_mode(Mode("disagg", 1, 1)))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    handler.cancel()  # the client went away while the workers take their roles
    with pytest.raises(asyncio.CancelledError):
        await handler
    for worker_id, msg in pool.sent:
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    while router.target is not None:  # the switch the server owns goes on to its end
        await asyncio.sleep(0)
    assert router.mode == Mode("disagg", 1, 1)
    assert [w.role for w in pool.workers] == ["prefill", "decode"] and router.serving.is_set()


def test_disagg_shows_the_chunk_its_decode_workers_read_prompts_in_when_it_is_not_the_default():
    """Defect: chunked with chunk_tokens 16, then disagg with the field omitted (it keeps its value),
    made the decode workers read their prompts 16 tokens a step while the mode said nothing of it."""
    assert Mode("disagg", 1, 1).as_dict() == DISAGG
    carried = Mode("disagg", 1, 1, chunk_tokens=16)
    assert carried.as_dict() == {**DISAGG, "chunk_tokens": 16} and carried.policy("decode") == "chunked"


@pytest.mark.asyncio
async def test_a_switch_that_would_leave_a_role_only_to_draining_workers_is_refused():
    """Defect: drain worker 1, then switch to 1P1D: worker 1 became the only decode worker, still
    draining, and every new request waited for a resume while /health said ok."""
    router = serving_router()
    pool = router.pool
    pool.workers[1].draining = True
    router.serving.set()
    with pytest.raises(Conflict) as refused:
        await router.set_mode(Mode("disagg", 1, 1))
    assert "worker 1 is draining" in str(refused.value) and refused.value.code == "worker_draining"
    assert router.mode == Mode() and [w.role for w in pool.workers] == ["both", "both"] and not pool.sent
    assert router.serving.is_set()


@pytest.mark.asyncio
async def test_a_draining_worker_takes_the_idle_place_when_the_new_mode_has_one():
    pool = Pool()
    pool.workers.append(SimpleNamespace(**vars(pool.workers[0]) | {"worker_id": 2}))
    router = Router(pool, None, Metrics("m"))
    router.ready = True
    pool.workers[1].draining = True
    switch = asyncio.ensure_future(router.set_mode(Mode("disagg", 1, 1)))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    for worker_id, msg in pool.sent:
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    await switch
    assert [w.role for w in pool.workers] == ["prefill", "idle", "decode"]


@pytest.mark.parametrize("gbps", [1e-300, 1e-9, 9e-6, 0.0, -1.0, float("inf")])
def test_an_emulated_link_too_slow_for_any_kv_is_refused(gbps):
    """Defect: kv_link_gbps 1e-300 was taken; every disaggregated reply then hung 60 s and ended
    in a 500, since no KV could cross the link."""
    with pytest.raises(InvalidRequest) as err:
        Mode("disagg", kv_link_gbps=gbps).check(2)
    assert err.value.param == "kv_link_gbps" and "1e-05" in str(err.value)


def test_the_slowest_link_allowed_is_ten_kilobits():
    Mode("disagg", kv_link_gbps=1e-5).check(2)


@pytest.mark.parametrize("body, param", [
    ({"mode": "disagg", "workers": 1}, "workers"),
    ({"mode": "chunked", "prefill_workers": 2}, "prefill_workers"),
    ({"mode": "colocated", "decode_workers": 2}, "decode_workers"),
    ({"mode": "colocated", "chunk_tokens": 64}, "chunk_tokens"),
    ({"mode": "chunked", "local_prefill_tokens": 128}, "local_prefill_tokens"),
])  # fmt: skip
def test_a_setting_that_does_not_apply_to_the_mode_asked_for_is_refused(body, param):
    """Defect: `workers` sent with disagg was kept out of sight and applied by a later switch (chunked
    then served on 1 of 2 workers); `prefill_workers` sent with chunked was taken without a word."""
    with pytest.raises(InvalidRequest) as refused:
        requested_mode(body, Mode())
    assert refused.value.param == param and body["mode"] in str(refused.value)


def test_a_setting_sent_at_its_default_where_it_does_not_apply_is_harmless():
    assert requested_mode({"mode": "disagg", "workers": None, "chunk_tokens": 512}, Mode()) == Mode("disagg")
    assert requested_mode({"mode": "colocated", "prefill_workers": 1}, Mode()) == Mode()


def test_a_setting_of_another_mode_does_not_come_back_unseen_after_a_switch_through_it():
    """chunked on 1 worker, then disagg (its view shows no `workers`), then chunked again: all workers
    serve, as GET /admin/mode said while in disagg. A setting that applies to both modes is kept, and shown."""
    chunked_one = requested_mode({"mode": "chunked", "chunk_tokens": 64, "workers": 1}, Mode())
    disagg = requested_mode({"mode": "disagg"}, chunked_one)
    assert disagg.workers is None and disagg.as_dict() == {**DISAGG, "chunk_tokens": 64}
    assert requested_mode({"mode": "chunked"}, disagg) == Mode("chunked", chunk_tokens=64)
    local = requested_mode({"mode": "disagg", "local_prefill_tokens": 256}, Mode())
    assert requested_mode({"mode": "disagg"}, requested_mode({"mode": "colocated"}, local)).local_prefill_tokens == 0


def test_a_null_link_latency_is_none_as_a_null_rate_is_unpaced():
    """Defect: kv_link_gbps null was taken (unpaced) but kv_link_latency_ms null was a 400."""
    assert requested_mode({"mode": "disagg", "kv_link_latency_ms": None}, Mode(kv_link_latency_ms=5.0)).kv_link_latency_ms == 0


def test_an_emulated_link_shows_in_every_mode_since_moves_cross_it_in_every_mode():
    slow = requested_mode({"mode": "colocated", "kv_link_gbps": 1.0, "kv_link_latency_ms": 2}, Mode())
    assert slow.as_dict() == {"mode": "colocated", "kv_link_gbps": 1.0, "kv_link_latency_ms": 2}


@pytest.mark.parametrize("field", ["kv_link_gbps", "kv_link_latency_ms"])
def test_a_link_setting_sent_as_a_huge_integer_reaches_the_workers_as_a_number_or_is_refused(field):
    """Defect: kv_link_gbps 2**64 passed every check, then could not be packed for the workers:
    a 500, and a switch event with no end."""
    if field == "kv_link_gbps":
        mode = requested_mode({"mode": "disagg", field: 2**64}, Mode())
        mode.check(2)
        assert isinstance(mode.kv_link_gbps, float)
        m.encode(m.SetMode("prefill", "prefill_first", 512, {}, [mode.kv_link_gbps, mode.kv_link_latency_ms]))
    for huge in (2**64, 10**400):
        with pytest.raises(InvalidRequest) as refused:
            body = {"mode": "disagg", field: huge if field != "kv_link_gbps" else 10**400}
            requested_mode(body, Mode()).check(2)
        assert refused.value.param == field


class JsonRequest:
    content_type, charset, headers = "application/json", None, {}

    def __init__(self, body: dict):
        self.raw = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self.raw


async def switch_during_a_switch(first: dict, second: dict, meanwhile=None) -> Router:
    """POST `second` while the switch `first` asked for waits for the workers (then `meanwhile(api)`,
    while `second` waits its turn); both answer; the router then."""
    router = serving_router()
    pool = router.pool
    api = Api(router, "m", 128)
    one = asyncio.ensure_future(api.post_mode(JsonRequest(first)))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    two = asyncio.ensure_future(api.post_mode(JsonRequest(second)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not two.done()  # it waits for the switch under way
    if meanwhile is not None:
        await meanwhile(api)
    for _ in range(2):  # the first switch's acks, then the second's
        sent, pool.sent = pool.sent, []
        for worker_id, msg in sent:
            router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
        while not pool.sent and not two.done():
            await asyncio.sleep(0)
    await one, await two
    return router


@pytest.mark.asyncio
async def test_a_switch_asked_for_during_another_is_read_against_the_mode_that_one_leaves():
    """Defect: a body was resolved against the mode when it arrived, not when it was applied: during
    a switch to chunked:64, {"mode": "disagg"} (chunk_tokens omitted: kept) was read against
    colocated, and disagg came with chunk_tokens 512, not the 64 the server then had."""
    mode = (await switch_during_a_switch({"mode": "chunked", "chunk_tokens": 64}, {"mode": "disagg"})).mode
    assert mode == Mode("disagg", 1, 1, chunk_tokens=64)


@pytest.mark.asyncio
async def test_a_switch_that_fails_says_so_in_the_event_feed():
    """Defect: a switch that failed (a worker refused its role, or the roles could not be sent)
    left its "switch" event without an end, and the page showed it under way for good."""
    router = serving_router()
    pool = router.pool
    switch, sent = await switch_sent(router, Mode("disagg", 1, 1))
    router.switcher.on_ack(m.ModeSet(0, sent[0][1].role, sent[0][1].policy, "no room for the role"))
    router.switcher.on_ack(m.ModeSet(1, sent[1][1].role, sent[1][1].policy))
    while len(pool.sent) < len(pool.workers):  # the old roles go back
        await asyncio.sleep(0)
    for worker_id, msg in pool.sent:
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    with pytest.raises(Exception, match="no room for the role"):
        await switch
    phases = [(e["phase"], e.get("started", e["time"])) for e in router.events.since(0) if e["type"] == "mode"]
    assert [p for p, _ in phases] == ["switch", "failed"] and phases[0][1] == phases[1][1]
    failed = [e for e in router.events.since(0) if e.get("phase") == "failed"][0]
    assert "no room for the role" in failed["error"] and router.mode == Mode() and router.serving.is_set()


@pytest.mark.asyncio
async def test_a_body_without_a_mode_sent_during_a_switch_is_judged_by_the_mode_that_switch_leaves():
    """Defect: during a switch to disagg, {"prefill_workers": 1, "decode_workers": 1} was refused at
    once, judged against colocated (the mode served when it arrived)."""
    mode = (await switch_during_a_switch(DISAGG, {"prefill_workers": 1, "decode_workers": 1, "chunk_tokens": 64})).mode
    assert mode == Mode("disagg", 1, 1, chunk_tokens=64)


@pytest.mark.asyncio
async def test_every_worker_named_is_the_same_mode_as_all_workers_and_shown_one_way():
    """Defect: {"mode": "colocated", "workers": 2} on two workers re-roled nobody but was a 'change',
    and GET /admin/mode showed "workers": 2 where the same state at start showed no field."""
    router = serving_router()
    api = Api(router, "m", 128)
    same = await asyncio.wait_for(router.set_mode(Mode("colocated", workers=2)), 1)  # no worker is asked
    assert same["changed"] is False and await reported(api) == {"mode": "colocated", "last_switch": same}


@pytest.mark.asyncio
async def test_auto_asked_for_after_a_switch_by_hand_still_waiting_stays_on_when_that_switch_lands():
    """Defect (a hostile-client pass): during a drain to disagg, {"mode": "chunked"} waited its turn
    and {"mode": "auto"} answered 200 with the advisor on; when the chunked switch landed it turned
    auto off, so the last request the server had acknowledged was silently undone."""
    async def auto(api):
        await api.post_mode(JsonRequest({"mode": "auto"}))
        assert api.router.advisor.enabled

    router = await switch_during_a_switch(DISAGG, {"mode": "chunked", "chunk_tokens": 64}, meanwhile=auto)
    pool, api = router.pool, Api(router, "m", 128)
    try:
        assert router.mode == Mode("chunked", chunk_tokens=64) and router.advisor.enabled
        three = asyncio.ensure_future(api.post_mode(JsonRequest({"mode": "colocated"})))  # by hand after it
        while len(pool.sent) < len(pool.workers):
            await asyncio.sleep(0)
        assert not router.advisor.enabled  # auto ends when a mode is asked for by hand
        for worker_id, msg in pool.sent:
            router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
        await three
        assert router.mode == Mode() and not router.advisor.enabled
    finally:
        router.advisor.task.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [{"mode": "bogus"}, {"mode": "chunked", "chunk_tokens": 0}, {"chunk_tokens": "64"},
                                  {"mode": "colocated", "prefill_workers": 2}, {"workers": 9},
                                  {"prefill_workers": 5}, {"local_prefill_tokens": -1}])  # fmt: skip
async def test_a_body_wrong_whatever_mode_it_meets_is_refused_at_once_during_a_switch(body):
    """Defect: during a switch (one that drains can take minutes) every body waited for its turn,
    to be read against the mode that switch leaves, even one that no mode could take: a mode that
    does not exist, a chunk of 0 tokens, a setting of another mode, more workers than the server
    has. Those are refused at once; one that depends on the mode it meets still waits."""
    router = serving_router()
    pool = router.pool
    api = Api(router, "m", 128)
    one = asyncio.ensure_future(api.post_mode(JsonRequest({"mode": "chunked", "chunk_tokens": 64})))
    while len(pool.sent) < len(pool.workers):
        await asyncio.sleep(0)
    with pytest.raises(InvalidRequest):
        await asyncio.wait_for(api.post_mode(JsonRequest(body)), 1.0)  # not after the switch: at once
    depends = asyncio.ensure_future(api.post_mode(JsonRequest({"local_prefill_tokens": 100})))  # fine if it meets disagg
    for _ in range(20):
        await asyncio.sleep(0)
    assert not depends.done()  # it waits for the switch under way, to be read against chunked:64
    for worker_id, msg in pool.sent:
        router.switcher.on_ack(m.ModeSet(worker_id, msg.role, msg.policy))
    await one
    with pytest.raises(InvalidRequest, match="does not apply"):
        await depends
    assert router.mode == Mode("chunked", chunk_tokens=64)


def test_a_body_no_mode_could_take_is_refused_with_the_words_of_a_mode_its_settings_belong_to():
    from minipd.server.modes import check_whatever_it_meets

    with pytest.raises(InvalidRequest, match="5P1D"):  # not "does not apply to colocated"
        check_whatever_it_meets({"prefill_workers": 5}, 2)
    with pytest.raises(InvalidRequest, match="chunk_tokens must be between"):
        check_whatever_it_meets({"chunk_tokens": 0}, 2)
    check_whatever_it_meets({"local_prefill_tokens": 100}, 2)  # disagg takes it


def test_an_unknown_mode_is_refused_naming_every_mode_a_switch_may_ask_for():
    """Defect (new-user probe): the error listed colocated, chunked and disagg, not auto, which POST
    /admin/mode takes."""
    with pytest.raises(InvalidRequest, match="auto"):
        requested_mode({"mode": "bogus"}, Mode())



@pytest.mark.asyncio
async def test_a_switch_is_refused_at_once_while_a_worker_shows_no_sign_of_life():
    """Defect (a hostile-client helper): with a worker stopped by SIGSTOP, POST /admin/mode closed the
    door to new requests and waited for that worker's answer until --worker-timeout replaced it (a
    minute). It is refused at once now, naming the worker, and nothing changes."""
    router = serving_router()
    router.pool.silent[1] = 12.0
    serving = router.serving.is_set()
    with pytest.raises(Unavailable, match=r"worker 1 .*12 s"):
        await asyncio.wait_for(router.set_mode(Mode("disagg", 1, 1)), 1.0)
    assert router.pool.sent == [] and router.mode == Mode() and router.serving.is_set() == serving
    assert "worker 1" in router.switcher.last["error"]


@pytest.mark.asyncio
async def test_a_worker_that_goes_silent_during_a_switch_undoes_it_without_waiting_for_the_ack_timeout():
    router = serving_router()
    pool = router.pool
    switch, sent = await switch_sent(router, Mode("disagg", 1, 1))
    router.switcher.on_ack(m.ModeSet(0, sent[0][1].role, sent[0][1].policy))
    pool.silent[1] = 6.0  # stopped before it answered
    while len(pool.sent) < len(pool.workers):  # the old roles go back, without waiting minutes
        await asyncio.wait_for(asyncio.sleep(0.01), 2.0)
    router.switcher.on_ack(m.ModeSet(0, pool.sent[0][1].role, pool.sent[0][1].policy))
    with pytest.raises(Unavailable, match="worker 1"):
        await asyncio.wait_for(switch, 2.0)
    assert router.mode == Mode() and [w.role for w in pool.workers] == ["both", "both"] and router.serving.is_set()
