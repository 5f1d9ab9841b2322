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
    disagg = v["runs"][2]["ttft_parts"]
    assert disagg["measured"]["kv_transfer"] > 0 and disagg["simulated"]["kv_transfer"] > 0
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.about["step_fit"]["steps"] > 50 and profile.step.fixed + profile.step.per_decode > 0
    assert "shm" in profile.links and profile.links["shm"].bytes_per_s > 0
    sims = v["simulated_runs"]
    assert all(r["simulated"] for r in sims) and [r["num_prompts"] for r in sims] == [12, 12, 12]
    assert "## The simulator against this run (--validate-sim)" in (tmp_path / "report.md").read_text()
