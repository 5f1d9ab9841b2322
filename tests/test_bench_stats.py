"""`bench --repeats N`: the bootstrap intervals (minipd/bench/stats.py) and what report.py makes of
repeated runs (results.json's "repeats" and "repeat_comparisons", report.md's tables, error bars)."""

import json

import numpy as np
import pytest

from minipd.bench.metrics import RequestRecord
from minipd.bench.report import (
    _lines_with_intervals,
    load_results,
    plot_runs,
    repeat_comparisons,
    repeat_summary,
    write_report_md,
    write_results,
)
from minipd.bench.stats import bootstrap_ci, is_rough, ratio_ci

# ---- bootstrap_ci ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0], [10, 12, 11, 30, 9, 13, 12], list(np.linspace(0, 1, 20))])
def test_the_interval_contains_the_median(values):
    point, lo, hi = bootstrap_ci(values)
    assert point == pytest.approx(float(np.median(values)))
    assert lo <= point <= hi
    assert min(values) <= lo and hi <= max(values)  # medians of resamples stay within the data


def test_the_interval_narrows_as_the_spread_shrinks():
    rng = np.random.default_rng(1)
    noise = rng.standard_normal(10)
    widths = []
    for spread in (10.0, 1.0, 0.1):
        _, lo, hi = bootstrap_ci(100 + spread * noise)
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[1] == pytest.approx(widths[0] / 10) and widths[2] == pytest.approx(widths[0] / 100)
    assert bootstrap_ci([5.0] * 6) == (5.0, 5.0, 5.0)  # no spread, no width


def test_the_interval_is_reproducible_from_its_seed():
    values = [3.1, 2.7, 4.4, 3.9, 2.2, 5.0, 3.3]
    assert bootstrap_ci(values, seed=7) == bootstrap_ci(values, seed=7)
    assert bootstrap_ci(values) == bootstrap_ci(values)  # seed 0 by default: the same report every time
    # the seed does drive the resampling (seen with the mean: resampled medians fall on few values)
    others = {bootstrap_ci(values, stat=np.mean, seed=s, n_resamples=200)[1:] for s in range(10)}
    assert len(others) > 1


def test_one_value_has_no_interval_and_none_has_nothing():
    assert bootstrap_ci([42.0]) == (42.0, None, None)
    assert bootstrap_ci([]) == (None, None, None)
    assert ratio_ci([3.0], [1.5]) == (2.0, None, None)
    assert ratio_ci([], []) == (None, None, None)


def test_other_statistics_and_confidence_levels():
    values = list(range(1, 21))
    point, lo, hi = bootstrap_ci(values, stat=np.mean)
    assert point == 10.5 and lo < 10.5 < hi
    _, lo90, hi90 = bootstrap_ci(values, stat=np.mean, confidence=0.9)
    assert lo <= lo90 and hi90 <= hi  # a lower confidence, a narrower interval
    p90 = bootstrap_ci(values, stat=lambda v: float(np.percentile(v, 90)))  # a stat without `axis`
    assert p90[0] == pytest.approx(18.1) and p90[1] <= p90[0] <= p90[2]
    with pytest.raises(ValueError):
        bootstrap_ci(values, confidence=1.0)


def test_rough_below_five_repeats():
    assert [is_rough(n) for n in (1, 2, 4, 5, 10)] == [False, True, True, False, False]


# ---- ratio_ci ----------------------------------------------------------------------------------------


def test_ratio_of_medians_on_a_known_paired_sample():
    a, b = [3.0, 4.0, 9.0, 8.0, 10.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    ratio, lo, hi = ratio_ci(a, b)
    assert ratio == pytest.approx(8.0 / 3.0)  # median(a) / median(b), not the median of the ratios (3.0)
    assert lo <= ratio <= hi and lo < hi
    assert ratio_ci(a, b, seed=3) == ratio_ci(a, b, seed=3)


def test_pairs_are_resampled_together():
    # B varies a lot between repeats, A is always exactly 2x B: paired, every resample says 2x
    b = [1.0, 5.0, 2.0, 9.0, 3.0, 7.0]
    assert ratio_ci([2 * x for x in b], b) == (2.0, 2.0, 2.0)
    # shuffled, the pairing is gone and so is the certainty
    ratio, lo, hi = ratio_ci([2 * x for x in reversed(b)], b)
    assert ratio == 2.0 and hi - lo > 0.5


def test_ratio_edges():
    assert ratio_ci([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])[0] == float("inf")
    assert ratio_ci([0.0, 0.0], [0.0, 0.0]) == (None, None, None)  # 0 / 0: no ratio
    with pytest.raises(ValueError, match="paired"):
        ratio_ci([1.0, 2.0], [1.0])


# ---- repeated runs in results.json, report.md and the plots ------------------------------------------


def rec(i, ttft, gap, tokens=5, send=1000.0):
    times = [send + ttft + gap * k for k in range(tokens)]
    return RequestRecord(i, 50, tokens, send, times, tokens, None, None, times[-1])


def runs_of(n_repeats, modes=(("colocated", 0.3, 0.05), ("disagg:1p1d", 0.1, 0.02)), rates=(1.0,)):
    """Repeat i of each mode: 4 requests whose TTFT grows a little with i (other seeds, other luck)."""
    out = []
    for rate in rates:
        for i in range(n_repeats):
            for label, ttft, gap in modes:
                records = [rec(k, ttft * (1 + 0.1 * i) * rate, gap) for k in range(4)]
                out.append({"workload": "chat", "mode": label.split(":")[0], "label": label, "rate": rate,
                            "seed": 10 + i, "repeat": i, "duration": 2.0 + 0.1 * i, "slo_ttft_ms": 250,
                            "slo_tpot_ms": 100, "records": records})  # fmt: skip
    return out


def test_repeat_summary_and_comparisons_from_runs():
    runs = runs_of(3)
    summary = repeat_summary(runs)
    assert [(g["label"], g["n"], g["seeds"], g["rough"]) for g in summary] == [
        ("colocated", 3, [10, 11, 12], True), ("disagg:1p1d", 3, [10, 11, 12], True)]  # fmt: skip
    ttft = summary[0]["metrics"]["median_ttft_ms"]
    assert ttft["values"] == pytest.approx([300.0, 330.0, 360.0])
    assert ttft["median"] == pytest.approx(330.0) and ttft["lo"] <= 330.0 <= ttft["hi"]
    assert summary[1]["metrics"]["slo_attainment"]["values"] == [1.0, 1.0, 1.0]
    assert summary[0]["metrics"]["goodput"]["median"] == 0.0  # colocated's TTFT misses the 250 ms SLO
    (ab,) = repeat_comparisons(runs)
    assert (ab["label"], ab["baseline"], ab["n"]) == ("disagg:1p1d", "colocated", 3)
    assert ab["metrics"]["p90_ttft_ms"]["ratio"] == pytest.approx(1 / 3)  # the same requests, a third of the TTFT
    assert ab["metrics"]["p90_tpot_ms"]["ratio"] == pytest.approx(0.4)
    assert ab["metrics"]["goodput"]["ratio"] == float("inf")  # against colocated's 0
    # a repeat that one mode lacks (interrupted) is not paired
    fewer = [r for r in runs if not (r["label"] == "colocated" and r["repeat"] == 2)]
    (ab,) = repeat_comparisons(fewer)
    assert ab["n"] == 2 and ab["seeds"] == [10, 11]


def test_results_json_and_report_with_repeats(tmp_path):
    runs = runs_of(3)
    doc = json.loads(write_results(tmp_path, runs).read_text())
    assert len(doc["runs"]) == 6 and [r["params"]["repeat"] for r in doc["runs"]] == [0, 0, 1, 1, 2, 2]
    assert [g["label"] for g in doc["repeats"]] == ["colocated", "disagg:1p1d"]
    assert doc["repeat_comparisons"][0]["metrics"]["goodput"]["ratio"] == "inf"  # JSON-safe
    back = load_results(tmp_path / "results.json")
    assert repeat_summary(back) == json.loads(json.dumps(repeat_summary(runs)))  # recomputable from the runs
    md = write_report_md(tmp_path, back, "t", "cmd").read_text()
    assert "## Repeats: median and 95% interval" in md and "**Rough**" in md
    assert "| metric | colocated (3 runs) | disagg:1p1d (3 runs) |" in md
    assert "| TTFT p50 (ms) | 330 [300, 360] |" in md
    assert "| SLO attainment | 0% [0%, 0%] | 100% [100%, 100%] |" in md
    assert "A/B against `colocated`, paired by seed" in md
    assert "- `disagg:1p1d` (3 paired runs, rough): goodput: colocated's median is 0, disagg:1p1d's is not" in md
    assert "TTFT p90 0.33x colocated, 95% CI 0.33x-0.33x" in md
    assert "| colocated (repeat 2, seed 11) | 1.00 |" in md  # every repeat's row is still there


def test_one_repeat_writes_what_it_wrote_before(tmp_path):
    runs = runs_of(1)
    doc = json.loads(write_results(tmp_path, runs).read_text())
    assert all(g["n"] == 1 for g in doc["repeats"])
    assert all(m["lo"] is None and m["hi"] is None for g in doc["repeats"] for m in g["metrics"].values())
    ab = doc["repeat_comparisons"][0]["metrics"]["p90_ttft_ms"]
    assert ab["lo"] is None and ab["ratio"] == pytest.approx(1 / 3)
    md = write_report_md(tmp_path, runs, "t", "cmd").read_text()
    assert "## Repeats" not in md and "repeat 1" not in md and "| colocated | 1.00 |" in md
    # without "repeat" (runs of other tools) nothing is added
    plain = {k: v for k, v in runs[0].items() if k != "repeat"}
    assert set(json.loads(write_results(tmp_path, [plain]).read_text())) == {"runs"}


def test_a_single_run_in_a_repeated_report_says_it_has_no_interval(tmp_path):
    runs = runs_of(3) + runs_of(1, modes=(("chunked:64", 0.2, 0.03),))
    md = write_report_md(tmp_path, runs, "t", "cmd").read_text()
    assert "chunked:64 (1 run)" in md and "(1 run, no interval)" in md
    assert "(1 paired run, rough)" not in md and "- `chunked:64` (1 paired run): " in md
    assert "1 pair of runs, no interval" in md


def test_error_bars_from_the_intervals():
    from matplotlib.container import ErrorbarContainer
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    _lines_with_intervals(ax, {"a": [(1.0, 0.5, 0.4, 0.7), (2.0, 0.3, None, None)], "b": [(1.0, 0.9)]})
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert bars.get_label() == "a"
    (segments,) = [c.get_segments() for c in bars.lines[2]]
    assert [tuple(s[:, 1]) for s in segments] == [pytest.approx((0.4, 0.7)), pytest.approx((0.3, 0.3))]
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")][-1] == "b"


def test_plots_of_repeated_runs(tmp_path):
    made = {p.name for p in plot_runs(tmp_path, runs_of(3, rates=(1.0, 2.0)))}
    assert {"slo_attainment.png", "latency_p90.png", "ttft_cdf.png", "tpot_cdf.png", "timeline_colocated.png"} <= made
    assert all((tmp_path / n).stat().st_size > 1000 for n in made)
    made = {p.name for p in plot_runs(tmp_path / "one", runs_of(1))}  # one repeat: plain points, as before
    assert {"slo_attainment.png", "latency_p90.png"} <= made
