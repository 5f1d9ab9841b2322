"""The validation runs of docs/validation/ simulated again with today's simulator: the same profile
(measured then, on the same workers), the same requests, and several noise seeds, against the figures
measured then. Shows how far the simulated figures move with the simulator's own random draws (the
step-time and delivery noise drawn from the profile's measured spread), which is the least error a
validation run this small can show.

    python scripts/resimulate_validation.py [--seeds 5] [--refit] [--out docs/validation/resimulated.md]

--refit fits the step model again on the steps each profile measured (kept in the profile), with
today's fit, instead of taking the coefficients fitted then: a change of the step model measured on
the same data.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from minipd.bench import experiment as ex
from minipd.cli_help import positive_int
from minipd.sim.cluster import Options
from minipd.sim.profile import Profile, fit_steps
from minipd.sim.runs import sim_once
from minipd.sim.validate import FIGURES, compare

DURATIONS = {"chat-1": 60, "summarize-0.15": 120, "summarize-0.3": 120, "generate-1.2": 80,
             "generate-1.2-2026-12-04": 80, "generate-2-3-avx512-2026-12-04-first": 60,
             "generate-2-3-avx512-2026-12-04": 60, "chat-2-avx512-2026-12-04": 60,
             "summarize-0.4-avx512-2026-12-04": 120, "mixed-1.5-avx512-2026-12-04": 60,
             "summarize-0.25-avx512-2026-12-04": 120, "chat-3-avx512-2026-12-05-first": 60,
             "chat-3-avx512-2026-12-05": 60, "chat-3-avx512-2026-12-05-repeat": 60,
             "chat-3-avx512-2026-12-05-cokind": 60, "summarize-0.35-avx512-2026-12-05": 120,
             "chat-2.5-avx512-2026-12-05": 60, "chat-2.5-avx512-2026-12-05-spread": 60,
             "mixed-1-avx512-2026-12-05": 90, "summarize-0.3-avx512-2026-12-05": 120,
             "mixed-1.25-avx512-2026-12-05": 90, "chat-1.5-zen3-avx2-2026-12-07": 60,
             "chat-2-zen5-avx512-2026-12-08": 60}  # the runs' --duration
METRICS = ("TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "ITL p50", "ITL p90", "throughput (out tok/s)")
REFIT_NOTE = ", the step model fitted again on each profile's steps"
GRADED = (*METRICS, "throughput (req/s)")  # the eight figures graded (the table shows out tok/s for both)


def cell(errors: list[float], limit: float) -> str:
    mid = statistics.median(errors)
    text = f"{mid:+.0%} [{min(errors):+.0%}, {max(errors):+.0%}]"
    return text if abs(mid) <= limit else f"**{text}**"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=positive_int, default=5, help="noise seeds per run (0, 1, ...)")
    ap.add_argument("--folder", default=str(Path(__file__).resolve().parent.parent / "docs" / "validation"))
    ap.add_argument("--refit", action="store_true", help="fit the step model again on each profile's measured steps")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    ap.add_argument("--runs", default=None, help="only these runs, FOLDER:DURATION[,...] (default: every run listed here)")
    args = ap.parse_args()
    runs = DURATIONS if args.runs is None else {f: float(d) for f, _, d in (r.rpartition(":") for r in args.runs.split(","))}
    lines = [f"Simulated again on {platform.python_implementation()} {platform.python_version()} with noise seeds "
             f"0-{args.seeds - 1}{REFIT_NOTE if args.refit else ''}: the median error over the seeds, [lowest, highest]; bold: the median outside "
             "the target (p50 and throughput within 10%, p90 within 20%).", "",
             "| run | mode | " + " | ".join(m.replace("throughput (out tok/s)", "out tok/s") for m in METRICS)
             + " | within target (median) |", "|---|---|" + "---|" * (len(METRICS) + 1)]  # fmt: skip
    for folder, duration in runs.items():
        v = json.loads((Path(args.folder) / folder / "validation.json").read_text())
        profile = Profile.from_dict(json.loads((Path(args.folder) / folder / "profile.json").read_text()))
        if args.refit:
            gap = profile.step.gap
            profile.step, _ = fit_steps([dict(s) for s in profile.points["steps"]])
            profile.step.gap = gap
        for measured, then in zip(v["runs"], v["simulated_runs"]):
            assert measured["label"] == then["label"]
            keys = {metric: key for metric, key, *_ in FIGURES}
            real = {"summary": {keys[row["metric"]]: row["measured"] for row in measured["rows"] if row["metric"] in keys}}
            s = ex.Settings(None, duration, then["burstiness"], then["seed"], then["quick"], None, None, None,
                            then["slo_ttft_ms"], then["slo_tpot_ms"], False)  # fmt: skip
            errors: dict[str, list[float]] = {m: [] for m in GRADED}
            limits = {}
            for seed in range(args.seeds):
                run = sim_once(profile, then["workload"], then["label"], then["mode_body"], then["rate"], s,
                               then["workers"], Options(seed=seed))  # fmt: skip
                assert run["num_prompts"] == then["num_prompts"], "not the requests of the validation run"
                for row in compare(real, run):
                    if row["metric"] in errors:
                        errors[row["metric"]].append(row["error"])
                        limits[row["metric"]] = row["target"]
            cells = [cell(errors[m], limits[m]) for m in METRICS]
            ok = sum(abs(statistics.median(errors[m])) <= limits[m] for m in GRADED)
            lines.append(f"| {folder} | {then['label']} | " + " | ".join(cells) + f" | {ok} of 8 |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
