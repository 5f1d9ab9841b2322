"""Simulated runs in the bench's own shape: the same workloads (bench/workloads.py, the same seed
gives the same requests), the same run dict (experiment.run_once's fields), so report.py writes
the same results.json, report and plots, and a simulated run lines up field for field with a
real one. Every run says it was simulated, and from which profile."""

from __future__ import annotations

import dataclasses
import time

from minipd.bench import experiment as ex
from minipd.bench.metrics import distserve_goodput, per_worker, summarize
from minipd.server.modes import Mode
from minipd.sim.cluster import Options, simulate
from minipd.sim.profile import Profile


def mode_of(body: dict) -> Mode:
    """A bench mode body (experiment.parse_mode's) as the server's Mode."""
    name = body.get("mode")
    if name not in ("colocated", "chunked", "disagg"):
        raise ValueError(f"the simulator runs colocated, chunked and disagg, not {name!r}")
    return Mode(name, body.get("prefill_workers", 1), body.get("decode_workers", 1), body.get("chunk_tokens", 512),
                body.get("workers"), body.get("kv_link_gbps"), body.get("kv_link_latency_ms") or 0.0,
                body.get("local_prefill_tokens") or 0)  # fmt: skip


def sim_once(profile: Profile, name: str, label: str, body: dict, rate: float, s: ex.Settings, num_workers: int,
             options: Options | None = None, **extra) -> dict:  # fmt: skip
    options = options or Options()
    if body.get("kv_link_gbps") is not None:
        options = dataclasses.replace(options, kv_link_gbps=body["kv_link_gbps"],
                                      kv_link_latency_ms=body.get("kv_link_latency_ms"))
    requests = ex.workload(name, rate, s, profile.worker.max_model_len)
    wall = time.perf_counter()
    records, sim = simulate(profile, requests, mode_of(body), num_workers, options)
    duration = max((r.end_time or r.send_time) for r in records) if records else 0.0
    run = {"workload": name, "mode": body.get("mode"), "label": label, "mode_body": body, "rate": rate,
           "burstiness": s.burstiness, "seed": s.seed, "quick": s.quick, "num_prompts": len(requests),
           "duration": duration, "slo_ttft_ms": s.slo_ttft_ms, "slo_tpot_ms": s.slo_tpot_ms, "records": records,
           "workers": num_workers, "simulated": True, "profile": profile.source,
           "sim": {"wall_seconds": time.perf_counter() - wall, "transport": options.transport,
                   "worker_busy": [round(w.busy_s / duration, 4) if duration else 0.0 for w in sim.workers],
                   "steps": sum(w.steps for w in sim.workers)}, **extra}  # fmt: skip
    run["summary"] = summarize(records, duration, s.slo_ttft_ms, s.slo_tpot_ms)
    run["request_phases"] = [r.phase for r in requests]
    run["load_start"] = 0.0
    if name == "phases":
        ex.add_phases(run, requests, s, rate)
    if sim.events is not None:
        run["events"] = sim.events
    return run


def sim_goodput(profile: Profile, name: str, label: str, body: dict, s: ex.Settings, num_workers: int, lo: float,
                hi: float, max_runs: int, options: Options | None = None) -> dict:  # fmt: skip
    """DistServe's goodput, searched on the simulator exactly as bench searches the server."""
    runs = []

    def attainment(rate: float) -> float:
        runs.append(sim_once(profile, name, label, body, rate, s, num_workers, options, search=True))
        return runs[-1]["summary"]["slo_attainment"] or 0.0

    best, probes = distserve_goodput(attainment, lo=lo, hi=hi, tolerance=max(lo / 4, 0.02), max_runs=max_runs)
    workers = ex.workers_used(body, num_workers)
    return {"workload": name, "label": label, "goodput_rate": best, "workers": workers,
            "goodput_per_worker": per_worker(best, workers), "probes": probes, "runs": runs, "simulated": True}  # fmt: skip
