"""vLLM's serving metrics and DistServe's goodput search, against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from minipd.bench.metrics import RequestRecord, describe, distserve_goodput, per_worker, percentile, summarize


def rec(index, ttft, gaps, *, error=None, end_extra=0.0, timeline=None, send=100.0, output_tokens=None):
    """A record sent at `send` whose first token comes after `ttft` s and the next ones after `gaps`."""
    times = []
    if ttft is not None:
        times = [send + ttft]
        for g in gaps:
            times.append(times[-1] + g)
    end = (times[-1] if times else send) + end_extra
    n = len(times) if output_tokens is None else output_tokens
    return RequestRecord(index, 10, 5, send, times, n, error, timeline, end)


def test_one_request_properties():
    r = rec(0, 0.5, [0.1, 0.2])
    assert r.ok
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.8)
    assert r.tpot == pytest.approx(0.15)  # (0.8 - 0.5) / (3 - 1)
    assert r.itls == pytest.approx([0.1, 0.2])


def test_e2e_runs_to_the_end_of_the_stream_and_falls_back_to_the_last_token():
    r = rec(0, 0.5, [0.1], end_extra=0.4)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.5)  # (1.0 - 0.5) / 1
    r.end_time = None
    assert r.e2e == pytest.approx(0.6)


def test_tpot_is_none_for_one_token_and_left_out_of_tpot_stats():
    one = rec(0, 0.2, [])
    assert one.tpot is None and one.itls == []
    two = rec(1, 0.2, [0.05])
    s = summarize([one, two], duration=1.0)
    assert s["mean_tpot_ms"] == pytest.approx(50.0)
    assert s["median_tpot_ms"] == pytest.approx(50.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)


def test_usage_count_above_chunks_sets_tpot():
    r = rec(0, 0.2, [0.3], output_tokens=4)  # 2 chunks seen, usage said 4 tokens
    assert r.tpot == pytest.approx(0.1)


def test_percentiles_interpolate_like_numpy():
    v = [0.010, 0.020, 0.030, 0.040]
    d = describe(v, "x_ms")
    assert d["mean_x_ms"] == pytest.approx(25.0)
    assert d["median_x_ms"] == pytest.approx(25.0)
    assert d["p90_x_ms"] == pytest.approx(37.0)
    assert d["p99_x_ms"] == pytest.approx(39.7)
    rng = np.random.default_rng(0)
    w = rng.exponential(size=101)
    assert percentile(w, 99) == pytest.approx(np.percentile(w, 99))
    assert percentile([], 50) is None
    assert describe([], "y")["p99_y"] is None


def test_goodput_and_attainment_with_several_slos():
    meets = rec(0, 0.1, [0.02, 0.02])  # TTFT 100 ms, TPOT 20 ms
    slow_first = rec(1, 0.5, [0.02, 0.02])  # TTFT 500 ms
    slow_decode = rec(2, 0.1, [0.2, 0.2])  # TPOT 200 ms
    failed = rec(3, 0.1, [0.02], error="HTTP 500: boom")
    one_token = rec(4, 0.1, [])  # no TPOT: meets any TPOT SLO, as in vLLM
    records = [meets, slow_first, slow_decode, failed, one_token]
    s = summarize(records, duration=2.0, slo_ttft_ms=200, slo_tpot_ms=50)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # the failure counts as a miss
    s = summarize(records, duration=2.0, slo_ttft_ms=200)
    assert s["goodput"] == pytest.approx(3 / 2.0)
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    s = summarize(records, duration=2.0, slo_tpot_ms=50, slo_e2e_ms=400)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # slow_first's E2E is 540 ms
    s = summarize(records, duration=2.0)
    assert s["goodput"] is None and s["slo_attainment"] is None
    assert s["errors"] == ["HTTP 500: boom"]


def test_throughputs_count_completed_requests_only():
    a, b = rec(0, 0.1, [0.1, 0.1]), rec(1, 0.1, [0.1], error="cancelled")
    s = summarize([a, b], duration=4.0)
    assert s["request_throughput"] == pytest.approx(0.25)
    assert s["output_throughput"] == pytest.approx(3 / 4)
    assert s["total_token_throughput"] == pytest.approx(13 / 4)
    assert s["mean_itl_ms"] == pytest.approx(100.0)


def test_kv_transfer_stats_come_from_server_timelines_when_present():
    a = rec(0, 0.2, [0.1], timeline={"kv_transfer": {"bytes": 10, "seconds": 0.05}})
    b = rec(1, 0.4, [0.1], timeline={"kv_transfer": {"bytes": 10, "seconds": 0.1}})
    c = rec(2, 0.4, [0.1], timeline={"kv_transfer": {"bytes": 0, "seconds": None}})
    s = summarize([a, b, c], duration=1.0)
    assert s["kv_transfer_count"] == 2
    assert s["mean_kv_transfer_ms"] == pytest.approx(75.0)
    assert s["mean_kv_transfer_share_of_ttft"] == pytest.approx(0.25)
    assert "kv_transfer_count" not in summarize([rec(0, 0.2, [])], duration=1.0)


def cliff(knee: float):
    """Synthetic latency model: every request meets its SLOs below `knee`, attainment falls fast above it."""
    return lambda rate: 1.0 if rate <= knee else max(0.0, 1.0 - 5.0 * (rate - knee))


def test_rate_search_finds_the_knee_with_few_probes():
    rate, runs = distserve_goodput(cliff(3.7), lo=0.5, hi=64, tolerance=0.05, max_runs=12)
    assert 3.65 <= rate <= 3.72  # passing (>= 0.9) ends at 3.72
    assert len(runs) <= 12
    assert all(a >= 0.9 for r, a in runs if r <= rate)
    assert (rate, cliff(3.7)(rate)) in runs


def test_rate_search_from_a_failing_lo_and_bounded_runs():
    rate, runs = distserve_goodput(cliff(3.7), lo=10, hi=64, tolerance=0.05, max_runs=20)
    assert 3.65 <= rate <= 3.72
    rate, runs = distserve_goodput(cliff(3.7), lo=0.5, hi=64, tolerance=0.001, max_runs=5)
    assert len(runs) == 5 and cliff(3.7)(rate) >= 0.9


def test_rate_search_edges():
    rate, runs = distserve_goodput(lambda r: 1.0, lo=1, hi=10)
    assert rate == 10 and [r for r, _ in runs] == [1, 2, 4, 8, 10]
    rate, runs = distserve_goodput(lambda r: 0.0, lo=1, hi=10, max_runs=4)
    assert rate == 0.0 and len(runs) == 4
    with pytest.raises(ValueError):
        distserve_goodput(lambda r: 1.0, lo=0, hi=1)
    assert per_worker(6.0, 3) == 2.0


# ---- results.json, report.md and plots (minipd.bench.report) ------------------------------------


def test_results_round_trip_report_and_plots(tmp_path):
    from minipd.bench.report import load_results, plot_link_study, plot_runs, write_report_md, write_results

    runs = []
    for mode, ttft in (("colocated", 0.4), ("disagg", 0.1)):
        for rate in (1.0, 2.0, float("inf")):
            records = [rec(i, ttft * rate if rate < 9 else ttft * 3, [0.02, 0.03]) for i in range(4)]
            records.append(rec(4, None, [], error="HTTP 500: boom"))
            runs.append({"workload": "chat", "mode": mode, "rate": rate, "seed": 0, "duration": 2.0,
                         "slo_ttft_ms": 500, "slo_tpot_ms": 100, "records": records})  # fmt: skip
    path = write_results(tmp_path, runs)
    back = load_results(path)
    assert len(back) == 6 and back[2]["rate"] == float("inf")
    assert back[0]["records"][0] == runs[0]["records"][0]
    assert back[0]["summary"]["slo_attainment"] == pytest.approx(4 / 5)
    assert back[1]["summary"]["slo_attainment"] == pytest.approx(0.0)  # TTFT 800 ms
    made = plot_runs(tmp_path, back)
    names = {p.name for p in made}
    assert {"slo_attainment.png", "ttft_cdf.png", "tpot_cdf.png", "timeline_disagg.png"} <= names
    plot_link_study(tmp_path / "link_study.png", [(1, 0.5), (10, 1.5), (100, 2.0)], {"colocated": 1.0})
    md = write_report_md(tmp_path, back, "Test run", "python -m minipd bench --quick").read_text()
    assert "python -m minipd bench --quick" in md and "## Workload `chat`" in md
    assert "| disagg | 2.00 | 4 / 1 |" in md and "80%" in md
    assert "[link_study.png](link_study.png)" in md
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_the_report_lists_the_modes_in_the_order_they_were_given(tmp_path):
    """Defect (a new-user pass): `--modes colocated,chunked,disagg` gave tables in alphabetical order
    (chunked first), not the order the user asked for and the runs were made in."""
    from minipd.bench.report import load_results, write_report_md, write_results

    runs = [{"workload": "chat", "mode": mode, "rate": rate, "seed": 0, "duration": 2.0,
             "records": [rec(i, 0.1, [0.02, 0.03]) for i in range(3)]}
            for mode in ("colocated", "chunked:64", "disagg:1p1d") for rate in (2.0, 1.0)]  # fmt: skip
    md = write_report_md(tmp_path, load_results(write_results(tmp_path, runs)), "t", "cmd").read_text()
    rows = [line.split("|")[1:3] for line in md.splitlines() if line.startswith("| ") and "req/s" not in line]
    assert [(m.strip(), r.strip()) for m, r in rows] == [
        ("colocated", "1.00"), ("colocated", "2.00"), ("chunked:64", "1.00"), ("chunked:64", "2.00"),
        ("disagg:1p1d", "1.00"), ("disagg:1p1d", "2.00")]
