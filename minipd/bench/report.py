"""Benchmark results on disk: results.json (everything, so every figure can be recomputed), report.md, plots.

A run is a plain dict: its parameters (`workload`, `mode`, `rate`, `seed`, ..., optionally `label` to
tell apart runs of one mode with other settings), `duration` (seconds), `records` (RequestRecord or
their dicts) and optionally `summary` (else computed with the run's `slo_ttft_ms`/`slo_tpot_ms`).
Plots use matplotlib's Figure directly (the Agg canvas, no pyplot state, no display needed).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

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
    modes on the same requests, its "phase_comparison" (minipd/bench/phases.py)."""
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


def write_report_md(out_dir: str | Path, runs: list[dict], title: str, command: str, extra: str = "") -> Path:
    """report.md: one table per workload (a row per mode and rate), the command, links to the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", "Made with:", "", "```", command, "```", ""]
    workloads = list(dict.fromkeys(str(r.get("workload", "-")) for r in runs))
    head = ("| mode | rate (req/s) | done / failed | req/s | out tok/s | TTFT p50 / p99 (ms) "
            "| TPOT p50 / p99 (ms) | goodput (req/s) | SLO attainment |")  # fmt: skip
    for w in workloads:
        group = sorted((r for r in runs if str(r.get("workload", "-")) == w), key=lambda r: (label_of(r), r["rate"]))
        s0 = summary_of(group[0])
        slo = ", ".join(f"{n} {s0[k]:g} ms" for n, k in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"),
                                                         ("E2E", "slo_e2e_ms")) if s0.get(k))  # fmt: skip
        lines += [f"## Workload `{w}`", "", f"SLOs: {slo or 'none given'}", "", head, "|" + "---|" * 9]
        for run in group:
            s = summary_of(run)
            lines.append(
                f"| {label_of(run)} | {fmt_number(float(run['rate']), 2)} | {s['completed']} / {s['failed']} "
                f"| {fmt_number(s['request_throughput'], 2)} | {fmt_number(s['output_throughput'])} "
                f"| {fmt_number(s['median_ttft_ms'], 0)} / {fmt_number(s['p99_ttft_ms'], 0)} "
                f"| {fmt_number(s['median_tpot_ms'], 0)} / {fmt_number(s['p99_tpot_ms'], 0)} "
                f"| {fmt_number(s['goodput'], 2)} | {fmt_pct(s['slo_attainment'])} |"
            )
        lines.append("")
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


def plot_slo_attainment(path: str | Path, points: dict[str, list[tuple[float, float]]], target: float = 0.9,
                        title: str = "SLO attainment") -> Path:  # fmt: skip
    """SLO attainment (0-1) against request rate, one line per mode: {mode: [(rate, attainment), ...]}."""
    fig, ax = _figure()
    for mode, pts in points.items():
        pts = sorted((r, a) for r, a in pts if math.isfinite(r))
        ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", label=mode)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"{100 * target:.0f}% target")
    ax.set(xlabel="request rate (req/s)", ylabel="requests meeting every SLO (%)", ylim=(0, 102), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
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
    """The standard plots of a set of runs: SLO attainment against rate; TTFT/TPOT CDFs and token timelines
    at each mode's highest rate. File names get a `_<workload>` suffix when there is more than one workload."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    workloads = list(dict.fromkeys(str(r.get("workload", "-")) for r in runs))
    for w in workloads:
        sfx = f"_{w}" if len(workloads) > 1 else ""
        group = [r for r in runs if str(r.get("workload", "-")) == w]
        s0 = summary_of(group[0])
        points: dict[str, list[tuple[float, float]]] = {}
        top: dict[str, dict] = {}
        for run in group:
            s = summary_of(run)
            if s.get("slo_attainment") is not None:
                points.setdefault(label_of(run), []).append((float(run["rate"]), s["slo_attainment"]))
            if label_of(run) not in top or float(run["rate"]) > float(top[label_of(run)]["rate"]):
                top[label_of(run)] = run
        if points:
            made.append(plot_slo_attainment(out / f"slo_attainment{sfx}.png", points))
        by_mode = {m: records_of(run) for m, run in top.items()}
        made.append(plot_ttft_cdf(out / f"ttft_cdf{sfx}.png", by_mode, s0.get("slo_ttft_ms")))
        made.append(plot_tpot_cdf(out / f"tpot_cdf{sfx}.png", by_mode, s0.get("slo_tpot_ms")))
        for m, run in top.items():
            name = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"timeline_{m}{sfx}.png")
            marks = [(sw["sent"], f"-> {sw['label']}") for sw in run.get("switches") or []]
            made.append(plot_timeline(out / name, by_mode[m], f"{m}, {w}, {fmt_number(float(run['rate']), 2)} req/s",
                                      marks=marks))  # fmt: skip
    return made
