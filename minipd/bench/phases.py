"""Runs of a workload whose traffic changes phase (`bench --workloads phases`): each run's numbers per
phase and overall, and `auto` (the server's advisor switching live) against every fixed mode played
on the same requests.

A request belongs to the phase it was drawn for (workloads.PHASES; results.json records carry it
as "phase"), whenever it is served. A phase's goodput is its requests that completed within both
SLOs per second of the phase's span (its share of the arrivals' time, the same for every mode:
ratios of goodput between modes are ratios of requests served within the SLOs); "overall" is the
whole run the same way, so it can differ from the run's summary goodput, which divides by the time
until the last reply ended. TTFT and TPOT percentiles are metrics.summarize's.

The comparison, per (workload, rate): in each phase auto's goodput against the best fixed mode's in
that phase, and overall against each fixed mode and against the best fixed mode of each phase
combined (what switching perfectly at the phase boundaries between the fixed modes measured would
have served).
"""

from __future__ import annotations

import math

from minipd.bench import stats
from minipd.bench.metrics import RequestRecord, summarize
from minipd.bench.report import CONFIDENCE, fmt_number
from minipd.bench.report import fmt_pct as _pct

ROW_FIELDS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "goodput", "slo_attainment")
AUTO_START = "colocated"  # experiment.run_once sets the server colocated before it turns auto on


def is_auto(run: dict) -> bool:
    return (run.get("mode_body") or {}).get("mode") == "auto" or run.get("mode") == "auto"


def is_fixed(run: dict) -> bool:
    """A run in one mode throughout: not auto, no --switch-at schedule, not the planner's check."""
    return not is_auto(run) and not run.get("switch_schedule") and not run.get("plan")


def label_of(run: dict) -> str:
    return str(run.get("label") or run.get("mode", "?"))


def _records(run: dict) -> list[RequestRecord]:
    from minipd.bench.report import records_of

    return records_of(run)


def phase_rows(run: dict) -> list[dict]:
    """One row per phase of the run (the requests drawn for it), then one "overall": requests, done /
    failed, TTFT and TPOT p50/p90 (ms), requests within both SLOs, goodput and SLO attainment (under
    the run's slo_ttft_ms/slo_tpot_ms), and for an auto run the modes the advisor had in force."""
    spans = run.get("phase_spans") or []
    names = run.get("phase_names") or [f"phase {i + 1}" for i in range(len(spans))]
    phase_of = run.get("request_phases") or []
    records = _records(run)
    slo = run.get("slo_ttft_ms"), run.get("slo_tpot_ms")
    rows = []
    for k, (lo, hi) in enumerate(spans):
        mine = [r for r in records if r.index < len(phase_of) and phase_of[r.index] == k]
        rows.append(_row(run, k, names[k] if k < len(names) else f"phase {k + 1}", lo, hi, mine, slo))
    if spans:
        rows.append(_row(run, "overall", "overall", spans[0][0], spans[-1][1], records, slo))
    return rows


def _row(run: dict, phase, name: str, lo: float, hi: float, records: list[RequestRecord], slo) -> dict:
    s = summarize(records, hi - lo, *slo)
    has_slo = any(x is not None for x in slo)
    row = {"phase": phase, "name": name, "start_s": lo, "end_s": hi, "requests": len(records),
           "completed": s["completed"], "failed": s["failed"],
           "within_slo": sum(r.meets(*slo) for r in records) if has_slo else None,
           **{k: s[k] for k in ROW_FIELDS}}  # fmt: skip
    if is_auto(run):
        row["modes_in_force"] = modes_in_force(run, lo, hi)
    return row


def modes_in_force(run: dict, lo: float, hi: float) -> list[str]:
    """The modes the advisor had the server in between `lo` and `hi` seconds after the load's start,
    in order (from its switches; the run starts colocated)."""
    switches = sorted((run.get("advisor") or {}).get("switch_log") or [], key=lambda s: s["at_s"])
    mode = AUTO_START
    for s in switches:
        if s["at_s"] <= lo:
            mode = s.get("to") or mode
    out = [mode]
    for s in switches:
        if lo < s["at_s"] < hi and s.get("to") and s["to"] != out[-1]:
            out.append(s["to"])
    return out


def phase_of_time(run: dict, at_s: float) -> int | None:
    for k, (lo, hi) in enumerate(run.get("phase_spans") or []):
        if lo <= at_s < hi:
            return k
    return None


# ---- auto against the fixed modes ---------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; inf where only b is 0; None where either is missing or both are 0."""
    if a is None or b is None:
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b


def groups(runs: list[dict]) -> list[list[dict]]:
    """The runs with phase rows, grouped by (workload, rate), in the order they ran."""
    out: dict[tuple, list[dict]] = {}
    for run in runs:
        if run.get("phases"):
            out.setdefault((str(run.get("workload")), float(run["rate"])), []).append(run)
    return list(out.values())


def compare(group: list[dict]) -> list[dict]:
    """For each auto run of one (workload, rate) group: per phase its goodput against the best fixed
    mode's, overall against each fixed mode's and the best fixed mode of each phase combined."""
    fixed = [r for r in group if is_fixed(r)]
    out = []
    for auto in (r for r in group if is_auto(r)):
        rows = [row for row in auto["phases"] if row["phase"] != "overall"]
        per_phase, best_sum, span_sum = [], 0.0, 0.0
        for row in rows:
            k = row["phase"]
            theirs = [(label_of(f), _phase(f, k)) for f in fixed]
            theirs = [(lab, r) for lab, r in theirs if r is not None and r["goodput"] is not None]
            best = max(theirs, key=lambda x: (x[1]["goodput"], x[1]["slo_attainment"] or 0.0), default=None)
            span = row["end_s"] - row["start_s"]
            if best is not None:
                best_sum += best[1]["goodput"] * span
            span_sum += span
            per_phase.append({"phase": k, "name": row["name"], "start_s": row["start_s"], "end_s": row["end_s"],
                              "auto_goodput": row["goodput"], "auto_slo_attainment": row["slo_attainment"],
                              "auto_modes": row.get("modes_in_force"),
                              "best_fixed": best[0] if best else None,
                              "best_fixed_goodput": best[1]["goodput"] if best else None,
                              "best_fixed_slo_attainment": best[1]["slo_attainment"] if best else None,
                              "ratio": ratio(row["goodput"], best[1]["goodput"]) if best else None})  # fmt: skip
        overall = _phase(auto, "overall") or {}
        versus = []
        for f in fixed:
            theirs = _phase(f, "overall") or {}
            versus.append({"mode": label_of(f), "goodput": theirs.get("goodput"),
                           "slo_attainment": theirs.get("slo_attainment"),
                           "ratio": ratio(overall.get("goodput"), theirs.get("goodput"))})  # fmt: skip
        combined = best_sum / span_sum if span_sum > 0 and all(p["best_fixed"] for p in per_phase) else None
        adv = auto.get("advisor") or {}
        out.append({"workload": auto.get("workload"), "rate": auto["rate"], "auto": label_of(auto),
                    "fixed": [label_of(f) for f in fixed], "phases": per_phase,
                    "overall": {"auto_goodput": overall.get("goodput"),
                                "auto_slo_attainment": overall.get("slo_attainment"), "versus": versus,
                                "best_fixed_per_phase_goodput": combined,
                                "ratio_to_best_fixed_per_phase": ratio(overall.get("goodput"), combined)},
                    "advisor": {"decisions": len(adv.get("decisions") or []), "switches": adv.get("switches", 0),
                                "error": adv.get("error"), "cpu_seconds": _predict_cpu(adv),
                                "span_s": span_sum}})  # fmt: skip
    return out


def _predict_cpu(advisor: dict) -> float | None:
    """CPU seconds the advisor's predictions took during the run (None where not recorded)."""
    costs = [d["predict_cpu_seconds"] for d in advisor.get("decisions") or [] if "predict_cpu_seconds" in d]
    return sum(costs) if costs else None


def _phase(run: dict, k) -> dict | None:
    return next((row for row in run.get("phases") or [] if row["phase"] == k), None)


def attach_comparisons(runs: list[dict]) -> list[dict]:
    """Puts each auto run's comparison in it as "phase_comparison"; returns them all."""
    found = []
    for group in groups(runs):
        autos = [r for r in group if is_auto(r)]
        for run, comparison in zip(autos, compare(group)):
            run["phase_comparison"] = comparison
            found.append(comparison)
    return found


# ---- repeated runs (bench --repeats N) ------------------------------------------------------------


def repeat_comparison(runs: list[dict], confidence: float = CONFIDENCE) -> list[dict]:
    """Per (workload, rate) run more than once with an auto run among the modes: per phase and overall,
    each mode's goodput over the repeats (median and bootstrap interval), the best fixed mode by its
    median, and auto against it as a paired ratio of medians over the repeats both ran (the same
    seeds: the same requests), with its interval; overall also against every fixed mode. The best
    fixed mode of each repeat alone is not used: the highest of several noisy runs flatters it."""
    out = []
    for group in groups(runs):
        repeats = sorted({int(r["repeat"]) for r in group if "repeat" in r})
        autos = [r for r in group if is_auto(r)]
        if len(repeats) < 2 or not autos:
            continue
        by_label: dict[str, dict[int, dict]] = {}
        for run in group:
            if (is_fixed(run) or is_auto(run)) and "repeat" in run and not run.get("interrupted"):
                by_label.setdefault(label_of(run), {})[int(run["repeat"])] = run
        auto = label_of(autos[0])
        fixed = [lab for lab in by_label if lab != auto]
        keys = [row["phase"] for row in autos[0]["phases"]]
        rows = [_repeat_row(by_label, auto, fixed, k, confidence) for k in keys]
        out.append({"workload": autos[0].get("workload"), "rate": autos[0]["rate"], "n": len(repeats),
                    "confidence": confidence, "rough": stats.is_rough(len(repeats)), "modes": list(by_label),
                    "auto": auto, "fixed": fixed, "phases": [r for r in rows if r["phase"] != "overall"],
                    "overall": next((r for r in rows if r["phase"] == "overall"), None)})  # fmt: skip
    return out


def _repeat_row(by_label: dict[str, dict[int, dict]], auto: str, fixed: list[str], k, confidence: float) -> dict:
    def goodputs(label: str) -> dict[int, float]:
        found = {i: (_phase(run, k) or {}).get("goodput") for i, run in by_label[label].items()}
        return {i: g for i, g in found.items() if g is not None}

    values = {label: goodputs(label) for label in by_label}
    goodput = {}
    for label, v in values.items():
        median, lo, hi = stats.bootstrap_ci(list(v.values()), confidence=confidence)
        goodput[label] = {"median": median, "lo": lo, "hi": hi, "values": list(v.values())}

    def against(label: str) -> dict:
        both = [i for i in values[auto] if i in values[label]]
        r, lo, hi = stats.ratio_ci([values[auto][i] for i in both], [values[label][i] for i in both],
                                   confidence=confidence)  # fmt: skip
        return {"mode": label, "ratio": r, "lo": lo, "hi": hi, "n": len(both)}

    ranked = [lab for lab in fixed if goodput[lab]["median"] is not None]
    best = max(ranked, key=lambda lab: goodput[lab]["median"], default=None)
    first = next(iter(by_label[auto].values()))
    row = _phase(first, k) or {}
    return {"phase": k, "name": row.get("name", str(k)), "goodput": goodput, "best_fixed": best,
            "ratio": against(best) if best else None, "versus": [against(lab) for lab in fixed]}  # fmt: skip


def repeat_table(c: dict) -> str:
    """Markdown for one repeat_comparison: goodput per phase and mode, `median [lo, hi]`, and auto
    against the best fixed mode of the phase; then overall against every fixed mode."""
    conf = f"{100 * c['confidence']:.0f}%"
    rough = (f" **Rough**: with fewer than {stats.ROUGH_BELOW} repeats an interval can be no wider than the "
             "values measured.") if c["rough"] else ""  # fmt: skip
    lines = [f"### `{c['workload']}` at {float(c['rate']):g} req/s over {c['n']} repeats (seeds paired)", "",
             f"Goodput (req/s) per phase: the median over the repeats and its {conf} bootstrap interval; the "
             f"last column is `{c['auto']}` against the fixed mode with the best median in that phase, a ratio "
             f"of medians paired by seed with its interval.{rough}", "",
             "| phase | " + " | ".join(c["modes"]) + f" | {c['auto']} / best fixed |",
             "|---|" + "---|" * (len(c["modes"]) + 1)]  # fmt: skip
    for p in c["phases"] + ([c["overall"]] if c["overall"] else []):
        where = "overall" if p["phase"] == "overall" else f"{p['phase'] + 1} {p['name']}"
        cells = [_interval(p["goodput"][m]) for m in c["modes"]]
        lines.append(f"| {where} | " + " | ".join(cells) + f" | {_ratio_cell(p['ratio'])} |")
    if c["overall"]:
        versus = ", ".join(_ratio_cell(v) for v in c["overall"]["versus"])
        lines += ["", f"Overall, `{c['auto']}` against each fixed mode: {versus or 'none run'}."]
    return "\n".join(lines)


def _interval(m: dict) -> str:
    if m["median"] is None:
        return "-"
    if m["lo"] is None:
        return f"{m['median']:.2f}"
    return f"{m['median']:.2f} [{m['lo']:.2f}, {m['hi']:.2f}]"


def _ratio_cell(r: dict | None) -> str:
    if not r or r["ratio"] is None:
        return "-"
    text = f"{_x(r['ratio'])} {r['mode']}"
    return text if r["lo"] is None else f"{text} [{_x(r['lo'])}, {_x(r['hi'])}]"


def repeat_tables(runs: list[dict]) -> str:
    return "\n\n".join(repeat_table(c) for c in repeat_comparison(runs))


# ---- text ------------------------------------------------------------------------------------------


def _f(x, digits: int = 0) -> str:  # whole numbers unless told otherwise
    return fmt_number(x, digits)


def _x(r: float | None) -> str:
    if r is None:
        return "-"
    return "inf" if math.isinf(r) else f"{r:.2f}x"


def _where(row: dict) -> str:
    if row["phase"] == "overall":
        return f"overall ({row['start_s']:.0f}-{row['end_s']:.0f} s)"
    return f"{row['phase'] + 1} {row['name']} ({row['start_s']:.0f}-{row['end_s']:.0f} s)"


def table(group: list[dict]) -> str:
    """Markdown: a row per phase and mode (then overall), and the comparison lines of each auto run."""
    first = group[0]
    slo = ", ".join(f"{n} {first[k]:g} ms" for n, k in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                    if first.get(k))  # fmt: skip
    lines = [f"### `{first.get('workload')}` at {float(first['rate']):g} req/s, per phase (SLOs: {slo or 'none given'})",
             "", "Requests count in the phase they were drawn for; goodput is those within both SLOs per second "
             "of the phase.", "",
             "| phase | mode | requests (done / failed) | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
             "| goodput (req/s) | SLO attainment |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    keys = [row["phase"] for row in first["phases"]]
    for k in keys:
        for run in group:
            row = _phase(run, k)
            if row is None:
                continue
            mode = label_of(run)
            if row.get("modes_in_force"):
                mode += f" ({' -> '.join(row['modes_in_force'])})"
            lines.append(f"| {_where(row)} | {mode} | {row['requests']} ({row['completed']} / {row['failed']}) "
                         f"| {_f(row['median_ttft_ms'])} / {_f(row['p90_ttft_ms'])} "
                         f"| {_f(row['median_tpot_ms'], 1)} / {_f(row['p90_tpot_ms'], 1)} "
                         f"| {_f(row['goodput'], 2)} | {_pct(row['slo_attainment'])} |")  # fmt: skip
    for run in group:
        c = run.get("phase_comparison")
        if c is not None:
            lines += ["", comparison_text(c, run)]
    return "\n".join(lines)


def comparison_text(c: dict, run: dict | None = None) -> str:
    """The comparison's lines: each phase, overall, and the advisor's switches."""
    auto = c["auto"]
    lines = [f"`{auto}` against the fixed modes ({', '.join(c['fixed']) or 'none run'}):"]
    if c["overall"]["auto_goodput"] is None:
        return "\n".join(lines + ["- no goodput without SLOs: give --slo-ttft-ms and --slo-tpot-ms"])
    for p in c["phases"]:
        where = f"phase {p['phase'] + 1} ({p['name']}, {p['start_s']:.0f}-{p['end_s']:.0f} s)"
        modes = f" [{' -> '.join(p['auto_modes'])}]" if p.get("auto_modes") else ""
        if p["best_fixed"] is None:
            lines.append(f"- {where}: {auto}{modes} {_f(p['auto_goodput'], 2)} req/s; no fixed mode to compare")
            continue
        lines.append(f"- {where}: {auto}{modes} {_f(p['auto_goodput'], 2)} req/s against the best fixed mode, "
                     f"{p['best_fixed']}, {_f(p['best_fixed_goodput'], 2)} req/s: **{_x(p['ratio'])}**")  # fmt: skip
    o = c["overall"]
    versus = ", ".join(f"{_x(v['ratio'])} {v['mode']} ({_f(v['goodput'], 2)})" for v in o["versus"])
    text = f"- overall: {auto} {_f(o['auto_goodput'], 2)} req/s: {versus or 'no fixed mode run'}"
    if o["best_fixed_per_phase_goodput"] is not None:
        text += (f"; {_x(o['ratio_to_best_fixed_per_phase'])} the best fixed mode of each phase combined "
                 f"({_f(o['best_fixed_per_phase_goodput'], 2)} req/s)")  # fmt: skip
    lines.append(text)
    adv = (run or {}).get("advisor") or {}
    if adv.get("error"):
        lines.append(f"- the advisor: {adv['error']}")
    else:
        moves = [f"{s['at_s']:.1f} s to {s.get('to')}" + _in_phase(run, s["at_s"]) for s in adv.get("switch_log") or []]
        lines.append(f"- the advisor (window {_f(adv.get('window_s'), 0)} s): {c['advisor']['decisions']} decisions "
                     f"during the run, {c['advisor']['switches']} switch(es)" + (f": {', '.join(moves)}" if moves else "")
                     + _cost(c["advisor"]))  # fmt: skip
    return "\n".join(lines)


def _cost(adv: dict) -> str:
    cpu, span = adv.get("cpu_seconds"), adv.get("span_s")
    if cpu is None or not span:
        return ""
    return f"; its predictions took {cpu:.1f} s of CPU in the main process ({cpu / span:.1%} of one core over the run)"


def _in_phase(run: dict | None, at_s: float) -> str:
    k = phase_of_time(run or {}, at_s)
    return "" if k is None else f" (phase {k + 1})"


def tables(runs: list[dict]) -> str:
    """Every (workload, rate) group with phases: its table and comparison lines."""
    return "\n\n".join(table(g) for g in groups(runs))
