"""The `--mode auto` advisor: its model on step times and traffic it is given, its hysteresis, and
its record of decisions beside what they led to; then on a real server."""

import asyncio
import time

import pytest

from minipd.server.advisor import AdvisorConfig
from minipd.server.modes import Mode
from tests.helpers import serving, stream_completions
from tests.test_router_units import FakePool, serving_router

# a prompt token costs 0.5 ms to read; a decode step 10 ms + 1 ms per reply in the batch
PREFILL = [(n, 0.002 + 0.0005 * n) for n in (200, 400, 800, 1600)]
DECODE = [(b, 0.010 + 0.001 * b) for b in (1, 4, 8, 16)]


def advisor_with(window: float = 10.0, slo_tpot: float = 0.014):
    router = serving_router(FakePool(["both", "both"]))
    a = router.advisor
    a.config = AdvisorConfig(window_s=window, slo_ttft_s=2.0, slo_tpot_s=slo_tpot, min_gain=0.1)
    for n, s in PREFILL * 3:
        a.on_step(n, 0, s)
    for b, s in DECODE * 3:
        a.on_step(0, b, s)
    return router, a


def feed(a, now: float, rate: float, prompt: int, output: int, window: float) -> None:
    count = int(rate * window)
    for i in range(count):
        t = now - window + i / rate
        a.on_arrival(t, prompt, output)
        a.on_finished({"arrival": t, "events": {"finish": now - 0.01}, "prompt_tokens": prompt,
                       "output_tokens": output, "ttft": 0.5, "tpot": 0.05, "finish_reason": "length"})  # fmt: skip


def test_long_prompts_under_a_tight_tpot_slo_lead_to_disagg_after_two_windows():
    router, a = advisor_with()
    now = time.time()
    feed(a, now, 1.5, 1000, 100, 10.0)
    first = a.decide(now)
    best = max(first["predictions"], key=lambda c: c["goodput"])
    colo = first["predictions"][0]
    assert colo["label"] == "colocated" and best["label"].startswith("disagg")
    assert colo["tpot_s"] > 0.014 and best["tpot_s"] <= 0.014  # prompts read between decodes break the TPOT SLO
    assert first["switch_to"] is None and first["decision"].startswith("wait")  # one window is not enough
    feed(a, now + 10, 1.5, 1000, 100, 10.0)
    second = a.decide(now + 10)
    assert second["switch_to"] is not None and Mode(**second["switch_to"]).name == "disagg"
    assert first["measured_next"] == second["measured"] and second["measured"]["requests"] == 15
    assert second["measured"]["slo_attainment"] == 0.0  # fed with a 50 ms TPOT against a 14 ms SLO


def test_short_prompts_keep_colocated_and_too_little_traffic_decides_nothing():
    router, a = advisor_with()
    now = time.time()
    feed(a, now, 2.0, 50, 100, 10.0)
    entry = a.decide(now)
    assert entry["switch_to"] is None and entry["decision"].startswith("stay"), entry["decision"]
    quiet = a.decide(now + 10)  # nothing arrived or finished in this window
    assert quiet["switch_to"] is None and quiet["decision"].startswith("wait: too little traffic")


def test_every_candidate_is_a_mode_the_server_accepts():
    router, a = advisor_with()
    feed(a, time.time(), 1.5, 1000, 100, 10.0)
    feed(a, time.time(), 2.0, 50, 100, 10.0)  # short prompts beside long ones: a local-prefill threshold splits them
    entry = a.decide(time.time())
    labels = [c["label"] for c in entry["predictions"]]
    assert "disagg:1p1d local<1000" in labels
    assert {"colocated", "chunked:256", "chunked:512", "disagg:1p1d"} <= set(labels)
    for c in entry["predictions"]:
        Mode(**c["mode"]).check(2)


@pytest.mark.slow
def test_auto_on_a_real_server_records_decisions_with_their_measured_outcome():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "auto",
                 "--advisor-window", "1.5") as server:  # fmt: skip
        assert server.get("/admin/mode")[1].get("auto") is True

        async def traffic():
            for _ in range(4):
                await stream_completions(server.url, [[5, 6, 7, 8] * 40] * 6, 40)

        asyncio.run(traffic())
        time.sleep(1.6)
        status, body = server.get("/admin/advisor")
        assert status == 200 and body["enabled"] and body["decisions"]
        decided = [d for d in body["decisions"] if "predictions" in d]
        assert decided, body["decisions"]
        assert all({"ttft_s", "tpot_s", "goodput"} <= set(c) for c in decided[0]["predictions"])
        assert "measured_next" in body["decisions"][0]
        assert server.post("/admin/mode", {"mode": "colocated"})[0] == 200
        assert server.get("/admin/advisor")[1]["enabled"] is False  # a mode chosen by hand ends auto
        assert server.post("/admin/mode", {"mode": "auto", "chunk_tokens": 3})[0] == 400


def test_under_overload_each_mode_is_credited_with_the_rate_it_can_carry_within_the_slos():
    """Defect (measured on the default model): with more offered than any mode can serve, every
    candidate was predicted 0, so the advisor never moved. Goodput is the highest rate that meets
    both SLOs (DistServe's), below the offered one."""
    router, a = advisor_with()
    now = time.time()
    feed(a, now, 4.0, 1000, 100, 10.0)  # 2 s of prompt reading per second: more than 2 workers hold within the SLOs
    entry = a.decide(now)
    goodputs = {c["label"]: c["goodput"] for c in entry["predictions"]}
    assert all(g < 4.0 for g in goodputs.values()), goodputs
    assert max(goodputs.values()) > 0.5, goodputs  # some mode still carries a share within the SLOs
