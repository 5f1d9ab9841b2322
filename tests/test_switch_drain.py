"""How long a run-time mode switch waits for the running requests: `serve --switch-drain-timeout`."""

import pytest

from minipd.__main__ import build_parser
from minipd.sampling_params import SamplingParams
from minipd.server import cli
from minipd.server.errors import Unavailable
from minipd.server.metrics import Metrics
from minipd.server.modes import Mode
from minipd.workers import messages as m
from tests.test_router_units import FakePool, placed, serving_router


def test_the_switch_drain_timeout_is_a_serve_flag_that_reaches_the_switcher():
    """Defect: a switch waited up to a fixed 600 s for the running requests, new requests waiting
    at the door all along, whatever the server was started with."""
    args = build_parser().parse_args(["serve", "--switch-drain-timeout", "5"])
    router = cli.build_router(args, FakePool(["both"]), None, Metrics("m"), Mode())
    assert router.switcher.drain_timeout == 5.0
    args = build_parser().parse_args(["serve"])
    assert cli.build_router(args, FakePool(["both"]), None, Metrics("m"), Mode()).switcher.drain_timeout == 600.0


@pytest.mark.asyncio
async def test_a_draining_switch_that_cannot_drain_in_time_is_given_up_and_the_requests_go_on():
    pool = FakePool(["both", "both"])
    router = serving_router(pool)
    router.switcher.drain_timeout = 0.05
    state = router.submit("r", [1, 2], SamplingParams(max_tokens=3))
    await placed(router)
    [(worker, _)] = pool.taken(m.AddRequest)
    with pytest.raises(Unavailable, match=r"within 0.05 s \(--switch-drain-timeout\)"):
        await router.set_mode(Mode("chunked"), drain=True)
    assert router.mode == Mode() and router.serving.is_set() and router.target is None
    assert not pool.taken(m.SetMode) and not pool.taken(m.Abort)  # nobody was re-roled or stopped
    router.on_message(m.Tokens("r.1", worker, [10, 11, 12], 1.0, finished=True, finish_reason="length"))
    assert state.finish_reason == "length" and state.output_token_ids == [10, 11, 12]
