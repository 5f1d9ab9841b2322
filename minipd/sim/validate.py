"""Proof before trust: the same requests on the real server and in the simulator (with a profile
measured on the same workers, by loads of its own), metric by metric, and where the time goes
when they differ. Used by `bench --validate-sim`."""

from __future__ import annotations

import statistics

from minipd.bench import report
from minipd.bench.metrics import latency_samples

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
TARGETS = {"median": 0.10, "p90": 0.20}  # |simulated / measured - 1| within these
THROUGHPUT = (("request_throughput", "req/s"), ("output_throughput", "out tok/s"))


# the graded figures: (metric, its key in a run's summary, target, unit)
FIGURES = [(f"{name} {'p50' if stat == 'median' else stat}", f"{stat}_{key}_ms", limit, "ms")
           for key, name in METRICS for stat, limit in TARGETS.items()] + \
          [(f"throughput ({unit})", key, TARGETS["median"], unit) for key, unit in THROUGHPUT]  # fmt: skip


def compare(real: dict, sim: dict) -> list[dict]:
    """One row per metric: measured, simulated, relative error, whether it is within target, and for
    the latencies where the simulated figure falls among the measured samples (`rank`, 0-1): a p90
    far off while at the measured p88 sits where the distribution jumps (the gaps between tokens
    beside a long prompt step), not where the model is wrong."""
    a, b = real["summary"], sim["summary"]
    rows = [_row(metric, a.get(key), b.get(key), limit, unit) for metric, key, limit, unit in FIGURES]
    samples = measured_samples(real)
    for row, (_, key, _, _) in zip(rows, FIGURES):
        got = samples.get(key.split("_", 1)[1].removesuffix("_ms"))
        if got and row["simulated"] is not None:
            row["rank"] = sum(x * 1e3 <= row["simulated"] for x in got) / len(got)
    if a.get("slo_attainment") is not None:
        rows.append(_row("SLO attainment", a["slo_attainment"], b.get("slo_attainment"), None, ""))
    return rows


def measured_samples(run: dict) -> dict[str, list[float]]:
    """The run's latency samples in seconds, as its summary's percentiles were taken from them."""
    return latency_samples([r for r in report.records_of(run) if r.ok])


def _row(metric: str, measured, simulated, limit, unit: str) -> dict:
    err = None
    if measured and simulated is not None:
        err = simulated / measured - 1
    return {"metric": metric, "measured": measured, "simulated": simulated, "error": err, "target": limit,
            "ok": None if limit is None or err is None else abs(err) <= limit, "unit": unit}  # fmt: skip


def ttft_parts(run: dict) -> dict[str, float | None]:
    """Where the first token's time goes, median over the run's requests (seconds): placing it (client
    send -> dispatched), waiting for a worker (-> its prompt's first step), reading the prompt
    (-> the step that made the first token), the KV handoff, and delivery to the client."""
    parts: dict[str, list[float]] = {k: [] for k in ("dispatch", "queue", "prefill", "kv_transfer", "delivery")}
    for r in report.records_of(run):
        t = r.server_timeline or {}
        ev = t.get("events") or {}
        if not r.ok or not r.token_times or not {"dispatched", "prefill_start", "prefill_end"} <= set(ev):
            continue
        parts["dispatch"].append(ev["dispatched"] - r.send_time)
        parts["queue"].append(ev["prefill_start"] - ev["dispatched"])
        parts["prefill"].append(ev["prefill_end"] - ev["prefill_start"])
        parts["delivery"].append(r.token_times[0] - ev["prefill_end"])
        kv = (t.get("kv_transfer") or {}).get("seconds")
        if kv:
            parts["kv_transfer"].append(kv)
    return {k: statistics.median(v) if v else None for k, v in parts.items()}


def step_summary(steps: list[dict], duration: float, workers: int) -> dict:
    """What the workers ran (engine step events, real or simulated, of one run): how many decode-only
    steps and prompt steps, how big and how long at the median, and the share of the run's time the
    workers spent stepping. Where the simulated latencies miss while each step's cost holds, these
    say whether the simulated workers ran other steps than the real ones."""
    decode = [s for s in steps if s["decodes"] and not s["prefill_tokens"]]
    prompt = [s for s in steps if s["prefill_tokens"]]
    by_worker: dict = {}  # time each worker spent stepping (the busiest one's queue grows steepest)
    for s in steps:
        by_worker[s["worker"]] = by_worker.get(s["worker"], 0.0) + s["end"] - s["time"]

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {"decode_steps": len(decode), "decodes_per_step": median([s["decodes"] for s in decode]),
            "decode_step_ms": median([(s["end"] - s["time"]) * 1e3 for s in decode]),
            "prompt_steps": len(prompt), "prompt_tokens_per_step": median([s["prefill_tokens"] for s in prompt]),
            "prompt_step_ms": median([(s["end"] - s["time"]) * 1e3 for s in prompt]),
            "decodes_beside_prompts": sum(s["decodes"] for s in prompt),
            "busy": sum(s["end"] - s["time"] for s in steps) / (duration * workers) if duration and workers else None,
            "busiest": max(by_worker.values()) / duration if duration and by_worker else None}  # fmt: skip


STEP_COLUMNS = (("decode_steps", "decode steps", 0), ("decodes_per_step", "decodes per step p50", 0),
                ("decode_step_ms", "decode step p50 (ms)", 1), ("prompt_steps", "prompt steps", 0),
                ("prompt_tokens_per_step", "prompt tokens per step p50", 0), ("prompt_step_ms", "prompt step p50 (ms)", 0),
                ("decodes_beside_prompts", "decodes beside prompts", 0), ("busy", "workers busy", 2), ("busiest", "busiest worker busy", 2))  # fmt: skip


def validate(pairs: list[tuple[dict, dict]]) -> dict:
    """pairs: (real run, simulated run) of the same workload, rate, mode and requests."""
    out = []
    for real, sim in pairs:
        rows = compare(real, sim)
        graded = [r for r in rows if r["ok"] is not None]
        out.append({"workload": real["workload"], "label": report.label_of(real), "rate": real["rate"], "rows": rows,
                    "within_target": sum(r["ok"] for r in graded), "graded": len(graded),
                    "ttft_parts": {"measured": ttft_parts(real), "simulated": ttft_parts(sim)},
                    "steps": {"measured": real.get("step_summary"), "simulated": sim.get("step_summary")}})  # fmt: skip
    return {"targets": "p50 and throughput within 10%, p90 within 20%", "runs": out}


def table(v: dict) -> str:
    lines = ["| workload | mode | rate | metric | measured | simulated | error | within target | simulated at measured |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in v["runs"]:
        for r in run["rows"]:
            ok = "-" if r["ok"] is None else ("yes" if r["ok"] else f"**no** (±{r['target']:.0%})")
            err = "-" if r["error"] is None else f"{r['error']:+.1%}"
            rank = "-" if r.get("rank") is None else f"p{r['rank'] * 100:.0f}"
            lines.append(f"| {run['workload']} | {run['label']} | {run['rate']:g} | {r['metric']} | {_num(r['measured'])} "
                         f"| {_num(r['simulated'])} | {err} | {ok} | {rank} |")  # fmt: skip
    lines += ["", "Simulated at measured: where the simulated figure falls among the measured run's samples (a p90 "
              "far off while at the measured p85-p95 sits where the distribution jumps, e.g. from a decode step to a "
              "long prompt step between two tokens, rather than on a wrong step time)."]  # fmt: skip
    lines += ["", "Where the first token's time goes (median seconds, measured / simulated):", "",
              "| workload | mode | rate | dispatch | queue | prefill | KV transfer | delivery |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in v["runs"]:
        m, s = run["ttft_parts"]["measured"], run["ttft_parts"]["simulated"]
        cells = " | ".join(f"{_num(m[k], 3)} / {_num(s[k], 3)}" for k in ("dispatch", "queue", "prefill", "kv_transfer",
                                                                         "delivery"))  # fmt: skip
        lines.append(f"| {run['workload']} | {run['label']} | {run['rate']:g} | {cells} |")
    stepped = [run for run in v["runs"] if (run.get("steps") or {}).get("measured") and run["steps"].get("simulated")]
    if stepped:
        lines += ["", "What the workers ran (engine steps of the run, measured / simulated):", "",
                  "| workload | mode | rate | " + " | ".join(name for _, name, _ in STEP_COLUMNS) + " |",
                  "|---|---|---|" + "---|" * len(STEP_COLUMNS)]  # fmt: skip
        for run in stepped:
            m, s = run["steps"]["measured"], run["steps"]["simulated"]
            cells = " | ".join(f"{_num(m.get(k), d)} / {_num(s.get(k), d)}" for k, _, d in STEP_COLUMNS)
            lines.append(f"| {run['workload']} | {run['label']} | {run['rate']:g} | {cells} |")
    graded = sum(r["graded"] for r in v["runs"])
    ok = sum(r["within_target"] for r in v["runs"])
    lines += ["", f"{ok} of {graded} graded figures within target ({v['targets']})."]
    return "\n".join(lines)


def _num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:.0f}"
