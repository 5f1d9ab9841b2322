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
