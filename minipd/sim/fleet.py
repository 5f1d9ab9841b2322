"""Questions bigger than this box, answered in the simulator: DistServe's placement search (the P:D
split with the most goodput per worker, per fleet size, link and SLO) and the link crossover (the
KV link rate from which disaggregation's goodput matches co-located serving's) at fleet scale."""

from __future__ import annotations

import dataclasses

from minipd.bench import experiment as ex
from minipd.sim.cluster import Options
from minipd.sim.profile import Profile
from minipd.sim.runs import sim_goodput

SHARES = (0.125, 0.25, 0.375, 0.5, 0.625)  # prefill workers as a share of the fleet


def splits(num_workers: int, shares=SHARES) -> list[tuple[str, dict]]:
    """colocated and the disagg splits whose prefill share is in `shares` (at least one of each)."""
    out = [("colocated", {"mode": "colocated", "workers": None})]
    for p in sorted({min(num_workers - 1, max(1, round(num_workers * s))) for s in shares}):
        out.append((f"disagg:{p}p{num_workers - p}d", {"mode": "disagg", "prefill_workers": p,
                                                        "decode_workers": num_workers - p, "kv_link_gbps": None}))  # fmt: skip
    return out


def placement_search(profile: Profile, workload: str, sizes: list[int], s: ex.Settings, per_worker_rate: float,
                     max_runs: int = 8, options: Options | None = None, say=None) -> list[dict]:  # fmt: skip
    """For each fleet size, every split's goodput (a rate search from per_worker_rate x size), and the best.
    With s.duration set, each probe plays that many seconds of arrivals, so a bigger fleet gets more requests."""
    rows = []
    for n in sizes:
        for label, body in splits(n):
            lo = per_worker_rate * n
            found = sim_goodput(profile, workload, label, body, s, n, lo, 32 * lo, max_runs, options)
            row = {"workers": n, "label": label, "prefill": body.get("prefill_workers", 0), "goodput": found["goodput_rate"],
                   "per_worker": found["goodput_rate"] / n, "probes": found["probes"],
                   "requests": sum(r["num_prompts"] for r in found["runs"]),
                   "sim_seconds": sum(r["sim"]["wall_seconds"] for r in found["runs"])}  # fmt: skip
            rows.append(row)
            if say:
                say(f"{n:>4} workers {label:>18}: goodput {row['goodput']:.2f} req/s ({row['per_worker']:.3f} per worker), "
                    f"{row['requests']} requests simulated in {row['sim_seconds']:.1f} s")  # fmt: skip
    return rows


def best_by_size(rows: list[dict]) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for r in rows:
        if r["workers"] not in best or r["per_worker"] > best[r["workers"]]["per_worker"]:
            best[r["workers"]] = r
    return best


def link_study(profile: Profile, workload: str, num_workers: int, gbps: list[float], s: ex.Settings,
               per_worker_rate: float, max_runs: int = 8, say=None) -> dict:  # fmt: skip
    """Goodput against the KV link's rate: every disagg split at each rate against colocated (which
    moves no KV). The crossover is the lowest rate from which the best split stays at or above it."""
    lo = per_worker_rate * num_workers
    base = sim_goodput(profile, workload, "colocated", {"mode": "colocated", "workers": None}, s, num_workers, lo,
                       32 * lo, max_runs)["goodput_rate"]  # fmt: skip
    points = []
    for g in gbps:
        best = 0.0
        for label, body in splits(num_workers)[1:]:
            body = dict(body, kv_link_gbps=g)
            best = max(best, sim_goodput(profile, workload, label, body, s, num_workers, lo, 32 * lo, max_runs,
                                         Options(transport="tcp"))["goodput_rate"])  # fmt: skip
        points.append((g, best))
        if say:
            say(f"link {g:g} Gb/s: best disagg goodput {best:.2f} req/s (colocated {base:.2f})")
    return {"workers": num_workers, "colocated": base, "points": points, "crossover_gbps": ex.crossover(points, base)}


def fixed_duration(s: ex.Settings, seconds: float) -> ex.Settings:
    return dataclasses.replace(s, num_prompts=None, duration=seconds)
