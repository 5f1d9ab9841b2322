"""Benchmark results on disk: results.json (everything, so every figure can be recomputed), report.md, plots.

A run is a plain dict: its parameters (`workload`, `mode`, `rate`, `seed`, ..., optionally `label` to
tell apart runs of one mode with other settings), `duration` (seconds), `records` (RequestRecord or
their dicts) and optionally `summary` (else computed with the run's `slo_ttft_ms`/`slo_tpot_ms`).
Plots use matplotlib's Figure directly (the Agg canvas, no pyplot state, no display needed).

Repeated runs (`bench --repeats N`): runs that carry `"repeat": i` (and their own `seed`) are
grouped by (workload, rate, label); each group gets the median of every REPEAT_METRICS metric over
its repeats with a bootstrap interval (minipd/bench/stats.py), and every mode is compared with a
baseline (colocated if it ran, else the first mode) as paired ratios over the repeats that ran on
the same seeds. results.json has them as "repeats" and "repeat_comparisons" beside "runs";
report.md as a table per (workload, rate) and the A/B lines; the plots as error bars.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from minipd.bench import stats
from minipd.bench.metrics import RequestRecord, summarize

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


def records_of(run: dict) -> list[RequestRecord]:
    return [r if isinstance(r, RequestRecord) else _record(r) for r in run.get("records", [])]


def _record(d: dict) -> RequestRecord:
    """A record from its results.json dict (without "phase", which the run keeps as request_phases)."""
    return RequestRecord(**{k: v for k, v in d.items() if k != "phase"})


def label_of(run: dict) -> str:
    return str(run.get("label") or run.get("mode", "?"))


def summary_of(run: dict) -> dict:
    if run.get("summary"):
        return run["summary"]
    return summarize(records_of(run), run.get("duration", 0.0), run.get("slo_ttft_ms"), run.get("slo_tpot_ms"))


def _plain(x):
    """JSON-safe: non-finite floats become the strings "inf"/"-inf"/"nan" (float() reads them back)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, RequestRecord):
        return _plain(dataclasses.asdict(x))
    return x


SWITCH_SECTIONS = ("switches", "intervals")  # a run with live mode switches (bench --switch-at) has these too
PHASE_SECTIONS = ("phases", "phase_comparison", "advisor")  # the phases workload; an auto run (bench/phases.py)
SECTIONS = SWITCH_SECTIONS + PHASE_SECTIONS


def write_results(out_dir: str | Path, runs: list[dict]) -> Path:
    """results.json: per run, its parameters, its summary and every request's record (with its
    "phase" where the run has request_phases); a run with live mode switches also its "switches" and
    "intervals" (minipd/bench/switching.py); a run of the phases workload its "phases" (a row per
    phase and overall), an auto run its "advisor" (the decisions made during it) and, beside fixed
    modes on the same requests, its "phase_comparison" (minipd/bench/phases.py). Where runs carry
    "repeat" (bench's points), "repeats" (repeat_summary) and "repeat_comparisons"
    (repeat_comparisons) follow "runs"."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"runs": []}
    for run in runs:
        params = {k: v for k, v in run.items() if k not in ("records", "summary", "request_phases", *SECTIONS)}
        records = _plain(records_of(run))
        phases = run.get("request_phases")
        if phases is not None:
            for d in records:
                d["phase"] = phases[d["index"]] if 0 <= d["index"] < len(phases) else None
        doc["runs"].append({"params": params, "summary": summary_of(run), "records": records,
                            **{k: run[k] for k in SECTIONS if run.get(k) is not None}})  # fmt: skip
    if any("repeat" in run for run in runs):
        doc["repeats"] = repeat_summary(runs)
        doc["repeat_comparisons"] = repeat_comparisons(runs)
    path = out / RESULTS_FILE
    path.write_text(json.dumps(_plain(doc), indent=1))
    return path


def load_results(path: str | Path) -> list[dict]:
    """The runs of a results.json, as run dicts with RequestRecord records (rate "inf" back to a float)."""
    runs = []
    for r in json.loads(Path(path).read_text())["runs"]:
        run = dict(r["params"])
        if isinstance(run.get("rate"), str):
            run["rate"] = float(run["rate"])
        run["summary"] = r.get("summary")
        run["records"] = [_record(d) for d in r["records"]]
        if r["records"] and all("phase" in d for d in r["records"]):
            phases = [None] * (1 + max(d["index"] for d in r["records"]))
            for d in r["records"]:
                phases[d["index"]] = d["phase"]
            run["request_phases"] = phases
        run.update({k: r[k] for k in SECTIONS if k in r})
        runs.append(run)
    return runs


def fmt_number(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def switch_tables(run: dict) -> str:
    """A run with live mode switches: its intervals and switches as markdown tables."""
    from minipd.bench.switching import tables

    return tables(run)


def phase_tables(runs: list[dict]) -> str:
    """Runs of the phases workload: per (workload, rate) a table per phase and mode, and auto against
    the fixed modes (minipd/bench/phases.py); "" when none has phases."""
    from minipd.bench.phases import tables

    return tables(runs)


def phase_tables_by_repeat(runs: list[dict]) -> str:
    """phase_tables, one set per repeat where the runs were repeated (bench --repeats), after auto
    against the fixed modes over all the repeats (phases.repeat_tables)."""
    from minipd.bench.phases import repeat_tables as phase_repeat_tables

    repeats = sorted({int(r["repeat"]) for r in runs if "repeat" in r})
    if len(repeats) < 2:
        return phase_tables(runs)
    out = [text] if (text := phase_repeat_tables(runs)) else []
    for i in repeats:
        text = phase_tables([r for r in runs if r.get("repeat", 0) == i])
        if text:
            seed = next((r.get("seed") for r in runs if r.get("repeat") == i), None)
            out.append(f"Repeat {i + 1} (seed {seed}):\n\n{text}")
    return "\n\n".join(out)


# ---- repeated runs (bench --repeats N) -------------------------------------------------------------

# (summary key, name in the report, digits; None: a percentage)
REPEAT_METRICS = (
    ("median_ttft_ms", "TTFT p50 (ms)", 0),
    ("p90_ttft_ms", "TTFT p90 (ms)", 0),
    ("median_tpot_ms", "TPOT p50 (ms)", 1),
    ("p90_tpot_ms", "TPOT p90 (ms)", 1),
    ("median_itl_ms", "ITL p50 (ms)", 1),
    ("p90_itl_ms", "ITL p90 (ms)", 1),
    ("request_throughput", "requests/s", 2),
    ("output_throughput", "output tok/s", 1),
    ("goodput", "goodput (req/s)", 2),
    ("slo_attainment", "SLO attainment", None),
)
AB_METRICS = (("goodput", "goodput"), ("output_throughput", "output throughput"), ("p90_ttft_ms", "TTFT p90"),
              ("p90_tpot_ms", "TPOT p90"))  # fmt: skip
CONFIDENCE = 0.95


def _value(x) -> float | None:
    """A summary's number as a float; None where missing or nan (results.json writes nan as "nan")."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def repeat_groups(runs: list[dict]) -> dict[tuple[str, float, str], list[dict]]:
    """The runs that carry "repeat" (interrupted ones left out), by (workload, rate, label) in the
    order they first ran; each group's runs by repeat."""
    out: dict[tuple[str, float, str], list[dict]] = {}
    for run in runs:
        if "repeat" in run and not run.get("interrupted"):
            out.setdefault((str(run.get("workload", "-")), float(run["rate"]), label_of(run)), []).append(run)
    return {k: sorted(g, key=lambda r: int(r["repeat"])) for k, g in out.items()}


def repeat_summary(runs: list[dict], confidence: float = CONFIDENCE) -> list[dict]:
    """Per (workload, rate, label): its repeats and seeds, and per REPEAT_METRICS metric the median
    over the repeats with its bootstrap interval (stats.bootstrap_ci; lo and hi are None with one
    value) and the values it came from (in repeat order; repeats where the metric is missing are
    left out, so a metric's n can be below the group's)."""
    out = []
    for (workload, rate, label), group in repeat_groups(runs).items():
        metrics = {}
        for key, _, _ in REPEAT_METRICS:
            values = [v for v in (_value(summary_of(r).get(key)) for r in group) if v is not None]
            if not values:
                continue
            median, lo, hi = stats.bootstrap_ci(values, confidence=confidence)
            metrics[key] = {"median": median, "lo": lo, "hi": hi, "n": len(values), "values": values}
        out.append({"workload": workload, "rate": rate, "label": label, "mode": group[0].get("mode"),
                    "n": len(group), "repeats": [int(r["repeat"]) for r in group],
                    "seeds": [r.get("seed") for r in group], "confidence": confidence,
                    "rough": stats.is_rough(len(group)), "metrics": metrics})  # fmt: skip
    return out


def repeat_comparisons(runs: list[dict], confidence: float = CONFIDENCE) -> list[dict]:
    """Per (workload, rate): every mode against the baseline (the colocated mode if one ran, else
    the first mode), as paired ratios of medians over the repeats both ran (the same seeds: the same
    requests and arrival times), with their bootstrap intervals (stats.ratio_ci), for AB_METRICS."""
    by_point: dict[tuple[str, float], dict[str, list[dict]]] = {}
    for (workload, rate, label), group in repeat_groups(runs).items():
        by_point.setdefault((workload, rate), {})[label] = group
    out = []
    for (workload, rate), modes in by_point.items():
        if len(modes) < 2:
            continue
        base = next((lab for lab, g in modes.items() if g[0].get("mode") == "colocated"), next(iter(modes)))
        base_by_repeat = {int(r["repeat"]): r for r in modes[base]}
        for label, group in modes.items():
            if label == base:
                continue
            pairs = [(r, base_by_repeat[int(r["repeat"])]) for r in group if int(r["repeat"]) in base_by_repeat]
            metrics = {}
            for key, _ in AB_METRICS:
                both = [(_value(summary_of(a).get(key)), _value(summary_of(b).get(key))) for a, b in pairs]
                both = [(a, b) for a, b in both if a is not None and b is not None]
                if not both:
                    continue
                ratio, lo, hi = stats.ratio_ci([a for a, _ in both], [b for _, b in both], confidence=confidence)
                metrics[key] = {"ratio": ratio, "lo": lo, "hi": hi, "n": len(both)}
            out.append({"workload": workload, "rate": rate, "label": label, "baseline": base, "n": len(pairs),
                        "repeats": [int(a["repeat"]) for a, _ in pairs], "seeds": [a.get("seed") for a, _ in pairs],
                        "confidence": confidence, "rough": stats.is_rough(len(pairs)), "metrics": metrics})  # fmt: skip
    return out


def _fmt_metric(x, digits) -> str:
    return fmt_pct(x) if digits is None else fmt_number(x, digits)


def fmt_interval(m: dict | None, digits=1) -> str:
    """`median [lo, hi]`; the single value and "(1 run, no interval)" where there was one; "-" for none."""
    if not m:
        return "-"
    if m.get("lo") is None or m.get("hi") is None:
        return f"{_fmt_metric(m['median'], digits)} (1 run, no interval)"
    return f"{_fmt_metric(m['median'], digits)} [{_fmt_metric(m['lo'], digits)}, {_fmt_metric(m['hi'], digits)}]"


def _fmt_ratio(x) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


def fmt_ratio_interval(label: str, base: str, name: str, m: dict | None, confidence: float = CONFIDENCE) -> str:
    """e.g. "goodput 1.90x colocated, 95% CI 1.60x-2.20x"."""
    if not m or m.get("ratio") is None:
        return f"{name}: no ratio (missing, or 0 in both)"
    if math.isinf(m["ratio"]):
        return f"{name}: {base}'s median is 0, {label}'s is not (no finite ratio)"
    text = f"{name} {_fmt_ratio(m['ratio'])} {base}"
    if m.get("lo") is None:
        return text + " (1 pair of runs, no interval)"
    return text + f", {100 * confidence:.0f}% CI {_fmt_ratio(m['lo'])}-{_fmt_ratio(m['hi'])}"


def repeat_tables(runs: list[dict]) -> str:
    """Markdown: per (workload, rate) a table of `median [lo, hi]` per metric and mode, then each mode
    against the baseline as ratio intervals; "" unless some point ran more than once."""
    summary = repeat_summary(runs)
    if not summary or max(g["n"] for g in summary) < 2:
        return ""
    n_max = max(g["n"] for g in summary)
    conf = f"{100 * CONFIDENCE:.0f}%"
    lines = [f"Each point ran up to {n_max} times with seeds seed, seed+1, ... (other requests and arrival times "
             "each time; every mode on the same seeds). A cell is `median [lo, hi]`: the median over the repeats "
             f"of that run's metric, and the {conf} percentile bootstrap interval of the median "
             "(minipd/bench/stats.py): how far it could move with other seeds on this machine."]  # fmt: skip
    if any(g["rough"] for g in summary):
        lines[0] += (f" **Rough**: with fewer than {stats.ROUGH_BELOW} repeats the interval can be no wider than the "
                     f"range of the values measured and covers the true median less often than {conf}.")  # fmt: skip
    lines.append("")
    comparisons = repeat_comparisons(runs)
    points = list(dict.fromkeys((g["workload"], g["rate"]) for g in summary))
    for workload, rate in points:
        group = [g for g in summary if (g["workload"], g["rate"]) == (workload, rate)]
        lines += [f"### `{workload}` at {fmt_number(rate, 2)} req/s", "",
                  "| metric | " + " | ".join(f"{g['label']} ({g['n']} run{'s' if g['n'] != 1 else ''})" for g in group)
                  + " |", "|---|" + "---|" * len(group)]  # fmt: skip
        for key, name, digits in REPEAT_METRICS:
            if any(key in g["metrics"] for g in group):
                lines.append(f"| {name} | " + " | ".join(fmt_interval(g["metrics"].get(key), digits) for g in group)
                             + " |")  # fmt: skip
        lines.append("")
        ab = [c for c in comparisons if (c["workload"], c["rate"]) == (workload, rate)]
        if ab:
            lines += [f"A/B against `{ab[0]['baseline']}`, paired by seed: ratios of medians with {conf} intervals "
                      "(the repeats resampled jointly). Above 1 is more goodput or throughput, but a slower TTFT or "
                      "TPOT.", ""]  # fmt: skip
            for c in ab:
                parts = [fmt_ratio_interval(c["label"], c["baseline"], name, c["metrics"].get(key))
                         for key, name in AB_METRICS]  # fmt: skip
                rough = ", rough" if c["rough"] else ""
                lines.append(f"- `{c['label']}` ({c['n']} paired run{'s' if c['n'] != 1 else ''}{rough}): "
                             + "; ".join(parts))  # fmt: skip
            lines.append("")
    return "\n".join(lines).rstrip("\n")


def write_report_md(out_dir: str | Path, runs: list[dict], title: str, command: str, extra: str = "") -> Path:
    """report.md: one table per workload (a row per mode and rate, and repeat where runs were
    repeated), the command, the repeats' medians and intervals (repeat_tables), links to the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", "Made with:", "", "```", command, "```", ""]
    workloads = list(dict.fromkeys(str(r.get("workload", "-")) for r in runs))
    head = ("| mode | rate (req/s) | done / failed | req/s | out tok/s | TTFT p50 / p99 (ms) "
            "| TPOT p50 / p99 (ms) | goodput (req/s) | SLO attainment |")  # fmt: skip
    order = {label: i for i, label in enumerate(dict.fromkeys(label_of(r) for r in runs))}  # as --modes gave them
    for w in workloads:
        group = sorted((r for r in runs if str(r.get("workload", "-")) == w),
                       key=lambda r: (order[label_of(r)], r["rate"], r.get("repeat", 0)))  # fmt: skip
        repeated = any(r.get("repeat", 0) > 0 for r in group)
        s0 = summary_of(group[0])
        slo = ", ".join(f"{n} {s0[k]:g} ms" for n, k in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"),
                                                         ("E2E", "slo_e2e_ms")) if s0.get(k))  # fmt: skip
        lines += [f"## Workload `{w}`", "", f"SLOs: {slo or 'none given'}", "", head, "|" + "---|" * 9]
        for run in group:
            s = summary_of(run)
            mode = label_of(run) + (f" (repeat {run['repeat'] + 1}, seed {run.get('seed')})"
                                    if repeated and "repeat" in run else "")  # fmt: skip
            lines.append(
                f"| {mode} | {fmt_number(float(run['rate']), 2)} | {s['completed']} / {s['failed']} "
                f"| {fmt_number(s['request_throughput'], 2)} | {fmt_number(s['output_throughput'])} "
                f"| {fmt_number(s['median_ttft_ms'], 0)} / {fmt_number(s['p99_ttft_ms'], 0)} "
                f"| {fmt_number(s['median_tpot_ms'], 0)} / {fmt_number(s['p99_tpot_ms'], 0)} "
                f"| {fmt_number(s['goodput'], 2)} | {fmt_pct(s['slo_attainment'])} |"
            )
        lines.append("")
    repeats = repeat_tables(runs)
    if repeats:
        lines += [f"## Repeats: median and {100 * CONFIDENCE:.0f}% interval", "", repeats, ""]
    if extra:
        lines += [extra, ""]
    plots = sorted(p.name for p in out.glob("*.png"))
    if plots:
        lines += ["## Plots", ""] + [f"- [{name}]({name})" for name in plots] + [""]
    path = out / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


# ---- plots -------------------------------------------------------------------------------------


def _figure(width: float = 7.0, height: float = 4.5):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _lines_with_intervals(ax, points: dict[str, list[tuple]], scale: float = 1.0) -> None:
    """One line per mode through (x, y) points; points given as (x, y, lo, hi) get error bars from
    lo to hi (none where lo or hi is None: one run). Points at an infinite x are left out."""
    for mode, pts in points.items():
        pts = sorted((tuple(p) + (None, None))[:4] for p in pts if math.isfinite(p[0]) and p[1] is not None)
        xs, ys = [p[0] for p in pts], [scale * p[1] for p in pts]
        if any(p[2] is not None and p[3] is not None for p in pts):
            below = [0.0 if p[2] is None else max(0.0, scale * (p[1] - p[2])) for p in pts]
            above = [0.0 if p[3] is None else max(0.0, scale * (p[3] - p[1])) for p in pts]
            ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=mode)
        else:
            ax.plot(xs, ys, marker="o", label=mode)


def plot_slo_attainment(path: str | Path, points: dict[str, list[tuple]], target: float = 0.9,
                        title: str = "SLO attainment") -> Path:  # fmt: skip
    """SLO attainment (0-1) against request rate, one line per mode: {mode: [(rate, attainment), ...]};
    points (rate, median, lo, hi) from repeated runs get error bars."""
    fig, ax = _figure()
    _lines_with_intervals(ax, points, scale=100.0)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"{100 * target:.0f}% target")
    ax.set(xlabel="request rate (req/s)", ylabel="requests meeting every SLO (%)", ylim=(0, 102), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_latency_vs_rate(path: str | Path, ttft: dict[str, list[tuple]], tpot: dict[str, list[tuple]],
                         slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                         title: str = "90th percentile latency") -> Path:  # fmt: skip
    """TTFT p90 and TPOT p90 (ms) against request rate, side by side, a line per mode: {mode: [(rate,
    value), ...]}; points (rate, median, lo, hi) from repeated runs get error bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.5), layout="constrained")
    for ax, points, name, slo in ((fig.add_subplot(1, 2, 1), ttft, "TTFT p90 (ms)", slo_ttft_ms),
                                  (fig.add_subplot(1, 2, 2), tpot, "TPOT p90 (ms)", slo_tpot_ms)):  # fmt: skip
        _lines_with_intervals(ax, points)
        if slo is not None:
            ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set(xlabel="request rate (req/s)", ylabel=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_cdf(path: str | Path, samples: dict[str, list[float]], xlabel: str, slo: float | None = None,
             title: str = "") -> Path:  # fmt: skip
    """Empirical CDF per mode of plain values (e.g. TTFT in ms): {mode: [value, ...]}."""
    fig, ax = _figure()
    for mode, values in samples.items():
        v = sorted(values)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=mode)
    if slo is not None:
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g}")
    ax.set(xlabel=xlabel, ylabel="fraction of requests", ylim=(0, 1.01), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_ttft_cdf(path: str | Path, records_by_mode: dict[str, list[RequestRecord]], slo_ms: float | None = None
                  ) -> Path:  # fmt: skip
    samples = {m: [1000 * r.ttft for r in rs if r.ok and r.ttft is not None] for m, rs in records_by_mode.items()}
    return plot_cdf(path, samples, "TTFT (ms)", slo_ms, "Time to first token")


def plot_tpot_cdf(path: str | Path, records_by_mode: dict[str, list[RequestRecord]], slo_ms: float | None = None
                  ) -> Path:  # fmt: skip
    samples = {m: [1000 * r.tpot for r in rs if r.ok and r.tpot is not None] for m, rs in records_by_mode.items()}
    return plot_cdf(path, samples, "TPOT (ms)", slo_ms, "Time per output token")


def plot_timeline(path: str | Path, records: list[RequestRecord], title: str = "", max_rows: int = 300,
                  marks: list[tuple[float, str]] = ()) -> Path:  # fmt: skip
    """One row per request (by index): a line from send to end, a tick at each token's arrival; failures red.
    `marks`: (epoch time, label) drawn as labelled vertical lines (mode switches)."""
    recs = sorted(records, key=lambda r: r.index)[:max_rows]
    fig, ax = _figure(9.0, min(2.0 + 0.12 * len(recs), 40.0))
    t0 = min((r.send_time for r in recs), default=0.0)
    for row, r in enumerate(recs):
        color = "tab:blue" if r.ok else "tab:red"
        end = r.end_time if r.end_time is not None else (r.token_times[-1] if r.token_times else r.send_time)
        ax.hlines(row, r.send_time - t0, end - t0, color="lightgrey" if r.ok else "tab:red", linewidth=1)
        if not r.ok:
            ax.plot([end - t0], [row], marker="x", color="tab:red")
        if r.token_times:
            ax.eventplot([[t - t0 for t in r.token_times]], lineoffsets=row, linelengths=0.8, linewidths=0.8,
                         colors=color)  # fmt: skip
    for when, text in marks:
        ax.axvline(when - t0, color="tab:orange", linestyle="--", linewidth=1)
        ax.annotate(text, (when - t0, 0), xycoords=("data", "axes fraction"), xytext=(2, 2), textcoords="offset points",
                    fontsize=7, color="tab:orange", rotation=90, va="bottom")  # fmt: skip
    ax.set(xlabel="seconds since the first request", ylabel="request", title=title or "Token arrivals")
    ax.set_ylim(len(recs) - 0.5 if recs else 1, -0.5)
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_link_study(path: str | Path, disagg: list[tuple[float, float]], baselines: dict[str, float],
                    title: str = "Goodput against KV link bandwidth") -> Path:  # fmt: skip
    """Disagg goodput per emulated link rate [(gbps, goodput)], co-located modes as lines {mode: goodput}."""
    fig, ax = _figure()
    pts = sorted(disagg)
    ax.plot([g for g, _ in pts], [y for _, y in pts], marker="o", label="disagg")
    for i, (mode, y) in enumerate(baselines.items()):
        ax.axhline(y, linestyle="--", color=f"C{i + 1}", label=mode)
    ax.set_xscale("log")
    ax.set(xlabel="emulated KV link (Gb/s)", ylabel="goodput (req/s within both SLOs)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_runs(out_dir: str | Path, runs: list[dict]) -> list[Path]:
    """The standard plots of a set of runs: SLO attainment and TTFT/TPOT p90 against rate; TTFT/TPOT CDFs
    and token timelines at each mode's highest rate. File names get a `_<workload>` suffix when there
    is more than one workload. Repeated runs (bench --repeats): each (mode, rate) is one point, the
    median over the repeats with its bootstrap interval as an error bar; the CDFs pool the repeats at
    the highest rate and the timeline shows the first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    workloads = list(dict.fromkeys(str(r.get("workload", "-")) for r in runs))
    repeated = {(g["workload"], float(g["rate"]), g["label"]): g for g in repeat_summary(runs)}
    for w in workloads:
        sfx = f"_{w}" if len(workloads) > 1 else ""
        group = [r for r in runs if str(r.get("workload", "-")) == w]
        s0 = summary_of(group[0])
        points: dict[str, list[tuple]] = {}
        latency: dict[str, dict[str, list[tuple]]] = {"p90_ttft_ms": {}, "p90_tpot_ms": {}}
        top: dict[str, dict] = {}
        pooled: dict[str, list[dict]] = {}
        seen = set()
        for run in group:
            s, label, rate = summary_of(run), label_of(run), float(run["rate"])
            agg = repeated.get((w, rate, label))
            if agg is not None and agg["n"] > 1:
                if (label, rate) in seen:
                    continue  # a repeated point is drawn once, from its aggregate
                seen.add((label, rate))
                for key, dest in (("slo_attainment", points), *((k, v) for k, v in latency.items())):
                    m = agg["metrics"].get(key)
                    if m is not None:
                        dest.setdefault(label, []).append((rate, m["median"], m["lo"], m["hi"]))
            else:
                if s.get("slo_attainment") is not None:
                    points.setdefault(label, []).append((rate, s["slo_attainment"]))
                for key, dest in latency.items():
                    if _value(s.get(key)) is not None:
                        dest.setdefault(label, []).append((rate, _value(s.get(key))))
            if label not in top or rate > float(top[label]["rate"]):
                top[label] = run
        for label, run in top.items():  # every repeat at the mode's highest rate
            pooled[label] = [r for r in group if label_of(r) == label and float(r["rate"]) == float(run["rate"])
                             and ("repeat" in r) == ("repeat" in run)]  # fmt: skip
        if points:
            made.append(plot_slo_attainment(out / f"slo_attainment{sfx}.png", points))
        if any(latency.values()):
            made.append(plot_latency_vs_rate(out / f"latency_p90{sfx}.png", latency["p90_ttft_ms"],
                                             latency["p90_tpot_ms"], s0.get("slo_ttft_ms"), s0.get("slo_tpot_ms")))  # fmt: skip
        by_mode = {m: records_of(run) for m, run in top.items()}
        cdfs = {(m if len(pooled[m]) < 2 else f"{m} ({len(pooled[m])} runs pooled)"):
                [rec for r in pooled[m] for rec in records_of(r)] for m in top}  # fmt: skip
        made.append(plot_ttft_cdf(out / f"ttft_cdf{sfx}.png", cdfs, s0.get("slo_ttft_ms")))
        made.append(plot_tpot_cdf(out / f"tpot_cdf{sfx}.png", cdfs, s0.get("slo_tpot_ms")))
        for m, run in top.items():
            name = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"timeline_{m}{sfx}.png")
            marks = [(sw["sent"], f"-> {sw['label']}") for sw in run.get("switches") or []]
            made.append(plot_timeline(out / name, by_mode[m], f"{m}, {w}, {fmt_number(float(run['rate']), 2)} req/s",
                                      marks=marks))  # fmt: skip
    return made
