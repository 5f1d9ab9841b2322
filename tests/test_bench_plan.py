"""The planner's arithmetic, on a made-up profile (the profiling itself runs in test_bench_cli's e2e)."""

import math

import pytest

from minipd.bench.plan import Profile, Traffic, _fit, decode_tpot, nanopd_rule, prefill_ttft, recommend


def _profile(**over) -> Profile:
    values = dict(prefill_fixed_s=0.02, prefill_per_token_s=0.002, decode_fixed_s=0.02, decode_per_seq_s=0.002,
                  decode_per_context_token_s=1e-6, interference_per_token_s=0.0005, kv_bytes_per_token=10_000,
                  kv_bandwidth_bytes_s=1e9, points={})  # fmt: skip
    return Profile(**(values | over))


def test_fit_is_least_squares_on_a_line():
    a, b = _fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)


def test_fit_never_gives_a_negative_fixed_cost():
    # superlinear cost (attention): a free line would cross zero above x = 0
    xs = [128, 512, 1024]
    ys = [0.2, 1.3, 2.8]
    mx, my = sum(xs) / 3, sum(ys) / 3
    free_slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert my - free_slope * mx < 0  # the unconstrained line is below zero at x = 0
    a, b = _fit(xs, ys)
    assert a == 0.0
    assert b == pytest.approx(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))


def test_prefill_ttft_is_service_plus_md1_wait_plus_transfer():
    p = _profile()
    t = Traffic(rate=2.0, prompt_tokens=100, output_tokens=10)
    service = 0.02 + 0.002 * 100
    rho = 2.0 * service
    expected = service + rho * service / (2 * (1 - rho)) + 10_000 * 100 / 1e9
    assert prefill_ttft(p, t, 1) == pytest.approx(expected)
    assert prefill_ttft(p, Traffic(rate=10.0, prompt_tokens=100, output_tokens=10), 1) == math.inf


def test_decode_batch_obeys_littles_law():
    p = _profile()
    t = Traffic(rate=4.0, prompt_tokens=100, output_tokens=50)
    tpot, batch = decode_tpot(p, t, 1)
    assert batch == pytest.approx(4.0 * 50 * tpot)  # requests in flight = arrival rate x time each stays
    per_seq = 0.002 + 1e-6 * (100 + 25)
    assert tpot == pytest.approx(0.02 + per_seq * batch)


def test_decode_batch_past_a_bend_of_the_step_model_obeys_littles_law_on_the_line_past_it():
    """A profile whose decodes cost more each past a bend (sim.profile's decode_bends): the planner read
    only the lower line and put a batch past the bend at a TPOT the worker cannot make."""
    p = _profile(decode_bends=[[8, 0.003]])
    t = Traffic(rate=5.0, prompt_tokens=100, output_tokens=50)
    tpot, batch = decode_tpot(p, t, 1)
    assert batch > 8 and batch == pytest.approx(5.0 * 50 * tpot)
    per_seq = 0.002 + 1e-6 * (100 + 25)
    assert tpot == pytest.approx(0.02 + per_seq * batch + 0.001 * (batch - 8))
    assert tpot > decode_tpot(_profile(), t, 1)[0]
    light = Traffic(rate=0.5, prompt_tokens=100, output_tokens=50)  # below the knee: the lower line
    assert decode_tpot(p, light, 1) == decode_tpot(_profile(), light, 1)
    assert decode_tpot(p, Traffic(rate=20.0, prompt_tokens=100, output_tokens=50), 1)[0] == math.inf


def test_decode_batch_past_a_bend_where_decodes_cost_less_lands_on_the_flatter_line():
    """On a CPU where a step's cost per decode falls past a few rows (oneDNN's product from three), a
    load that one line would call overloaded is served on the flatter line past the bend."""
    p = _profile(decode_bends=[[2, 0.005], [4, 0.0005]])
    t = Traffic(rate=8.0, prompt_tokens=100, output_tokens=50)
    assert decode_tpot(_profile(decode_per_seq_s=0.005), t, 1)[0] == math.inf
    tpot, batch = decode_tpot(p, t, 1)
    assert batch > 4 and batch == pytest.approx(8.0 * 50 * tpot)
    ctx = 1e-6 * (100 + 25)
    assert tpot == pytest.approx(0.02 + 2 * 0.002 + 2 * 0.005 + 0.0005 * (batch - 4) + ctx * batch)


def test_the_compute_bound_batch_follows_the_bends():
    """B* (the batch whose sequences cost as much as the step's fixed part) read only the first
    slope: on a CPU whose decodes cost less each past 2, it came out far too small."""
    assert _profile(decode_fixed_s=0.02, decode_per_seq_s=0.005).compute_bound_batch == pytest.approx(4)
    bent = _profile(decode_fixed_s=0.02, decode_per_seq_s=0.005, decode_bends=[[2, 0.0005]])
    assert bent.compute_bound_batch == pytest.approx(22)  # 2 x 5 ms, then 20 x 0.5 ms
    assert _profile(decode_fixed_s=0.02, decode_per_seq_s=0.005, decode_bends=[[2, 0.0]]).compute_bound_batch == math.inf


def test_recommend_gives_prompt_heavy_traffic_more_prefill_workers():
    p = _profile()
    heavy_prompts = recommend(p, Traffic(rate=3.0, prompt_tokens=300, output_tokens=8), 4, 5.0, 0.03)
    heavy_replies = recommend(p, Traffic(rate=3.0, prompt_tokens=16, output_tokens=400), 4, 5.0, 0.05)
    assert heavy_prompts["best"]["split"] == "3P1D", heavy_prompts["best"]
    assert heavy_prompts["meets_slos"]
    split_options = [r for r in heavy_replies["options"] if r["prefill"]]
    assert max(split_options, key=lambda r: r["margin"])["split"] == "1P3D"
    assert heavy_prompts["best"]["margin"] == max(r["margin"] for r in heavy_prompts["options"])
    assert {r["split"] for r in heavy_prompts["options"]} == {"1P3D", "2P2D", "3P1D", "colocated"}


def test_nanopd_crossover_is_where_both_sides_are_equal():
    p = _profile()
    rule = nanopd_rule(p, decode_batch=4.0)
    at_crossover = _profile(kv_bandwidth_bytes_s=rule["predicted_crossover_gbps"] * 1e9 / 8)
    again = nanopd_rule(at_crossover, decode_batch=4.0)
    assert again["lhs"] == pytest.approx(again["rhs"])
    assert nanopd_rule(_profile(kv_bandwidth_bytes_s=1e12), 4.0)["disagg_pays"]
    assert not nanopd_rule(_profile(kv_bandwidth_bytes_s=1e3), 4.0)["disagg_pays"]


def test_recommend_survives_a_profile_whose_decode_costs_fit_to_zero():
    # a fast machine and a tiny model: the decode fit's fixed cost clamps to 0, so the model's TPOT is 0
    p = _profile(prefill_fixed_s=0.0028, prefill_per_token_s=5.8e-6, decode_fixed_s=0.0, decode_per_seq_s=0.0,
                 decode_per_context_token_s=0.0)  # what the end-to-end test's profile fit to on an AVX-512 machine
    plan = recommend(p, Traffic(rate=4.0, prompt_tokens=1024, output_tokens=23), 2, 3.0, 0.3)
    assert all(r["tpot_s"] == 0.0 and r["margin"] == pytest.approx(3.0 / r["ttft_s"]) for r in plan["options"])
    assert plan["meets_slos"]
