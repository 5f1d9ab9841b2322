"""bench --validate-sim end to end: real runs on the tiny model, a profile measured on the same
workers, the same requests in the simulator, and the table. The tiny model's steps are a few
milliseconds, so host noise dominates its latencies; what must hold is the machinery (every mode
and metric compared, a profile with a step model fitted on real steps) and the figures a load this
light decides by itself: throughput and the requests' lengths."""

from __future__ import annotations

import json

import pytest

from minipd.bench import main as bench_main
from minipd.sim.profile import Profile
from tests.helpers import serving


@pytest.mark.slow
def test_validate_sim_compares_every_mode_and_metric(tmp_path):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1") as s:
        code = bench_main.run(["--url", s.url, "--workloads", "chat", "--quick", "--num-prompts", "12", "--rates", "2",
                               "--modes", "colocated,chunked:64,disagg:1p1d", "--slo-ttft-ms", "1000",
                               "--slo-tpot-ms", "100", "--validate-sim", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert code == 0
    v = json.loads((tmp_path / "validation.json").read_text())
    assert [r["label"] for r in v["runs"]] == ["colocated", "chunked:64", "disagg:1p1d"]
    for run in v["runs"]:
        metrics = {row["metric"]: row for row in run["rows"]}
        assert {"TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "ITL p50", "ITL p90"} <= set(metrics)
        assert all(row["measured"] and row["simulated"] for row in metrics.values() if row["metric"] != "SLO attainment")
        assert abs(metrics["throughput (out tok/s)"]["error"]) < 0.25, metrics["throughput (out tok/s)"]
        assert run["ttft_parts"]["measured"]["prefill"] > 0 and run["ttft_parts"]["simulated"]["prefill"] > 0
        measured, simulated = run["steps"]["measured"], run["steps"]["simulated"]  # what the workers ran, both sides
        assert measured["prompt_steps"] >= 1 and simulated["prompt_steps"] >= 1
        assert measured["decode_steps"] >= 1 and simulated["decode_steps"] >= 1
        assert 0 < measured["busy"] <= 1 and 0 < simulated["busy"] <= 1
    disagg = v["runs"][2]["ttft_parts"]
    assert disagg["measured"]["kv_transfer"] > 0 and disagg["simulated"]["kv_transfer"] > 0
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.about["step_fit"]["steps"] > 50 and profile.step.fixed + profile.step.per_decode > 0
    assert "shm" in profile.links and profile.links["shm"].bytes_per_s > 0
    sims = v["simulated_runs"]
    assert all(r["simulated"] for r in sims) and [r["num_prompts"] for r in sims] == [12, 12, 12]
    text = (tmp_path / "report.md").read_text()
    assert "## The simulator against this run (--validate-sim)" in text and "What the workers ran" in text
    assert all("events" not in r for r in sims)  # the simulated steps are summed up, not kept


def test_step_summary_counts_what_the_workers_ran():
    from minipd.sim.validate import step_summary

    steps = [{"worker": 0, "time": 0.0, "end": 0.3, "prefill_tokens": 500, "decodes": 0},  # a prompt alone
             {"worker": 0, "time": 0.3, "end": 0.32, "prefill_tokens": 0, "decodes": 2},
             {"worker": 0, "time": 0.32, "end": 0.35, "prefill_tokens": 0, "decodes": 4},
             {"worker": 0, "time": 0.35, "end": 0.36, "prefill_tokens": 0, "decodes": 6},
             {"worker": 1, "time": 0.0, "end": 0.1, "prefill_tokens": 100, "decodes": 3}]  # a prompt beside 3 decodes  # fmt: skip
    got = step_summary(steps, duration=1.0, workers=2)
    assert got["decode_steps"] == 3 and got["decodes_per_step"] == 4
    assert abs(got["decode_step_ms"] - 20.0) < 1e-9
    assert got["prompt_steps"] == 2 and got["prompt_tokens_per_step"] == 300 and got["decodes_beside_prompts"] == 3
    assert abs(got["prompt_step_ms"] - 200.0) < 1e-9
    assert abs(got["busy"] - 0.46 / 2) < 1e-9 and abs(got["busiest"] - 0.36) < 1e-9
    assert step_summary([], 1.0, 2)["decode_step_ms"] is None


def test_each_latency_says_where_the_simulated_figure_falls_among_the_measured_samples():
    """A p90 of the gaps between tokens that sits where they jump from a decode step to a long
    prompt step misses by far on a small difference in how often the jump happens; the rank says so."""
    from minipd.bench.metrics import RequestRecord, summarize
    from minipd.sim.validate import compare, table, ttft_parts

    records = []
    for i in range(10):  # each reply: 9 gaps of 20 ms and one of 600 ms (a prompt step beside it)
        times = [100.0 + 0.5]
        for g in [0.02] * 9 + [0.6]:
            times.append(times[-1] + g)
        records.append(RequestRecord(i, 100, 11, 100.0, times, 11, None, None, times[-1]))
    real = {"summary": summarize(records, 10.0), "records": records}
    sim = {"summary": dict(real["summary"], p90_itl_ms=500.0, median_itl_ms=21.0)}
    rows = {r["metric"]: r for r in compare(real, sim)}
    assert rows["ITL p90"]["rank"] == pytest.approx(0.9) and not rows["ITL p90"]["ok"]
    assert rows["ITL p50"]["rank"] == pytest.approx(0.9)  # 21 ms: above every 20 ms gap
    assert rows["TTFT p50"]["rank"] == 1.0 and "rank" not in rows["throughput (req/s)"]
    v = {"targets": "t", "runs": [{"workload": "w", "label": "colocated", "rate": 1, "rows": list(rows.values()),
                                   "within_target": 0, "graded": 1,
                                   "ttft_parts": {"measured": ttft_parts(real), "simulated": ttft_parts(real)}}]}  # fmt: skip
    line = next(x for x in table(v).splitlines() if x.startswith("| w | colocated | 1 | ITL p90 |"))
    assert "**no**" in line and line.endswith("| p90 |")
