"""How well the advisor's live step fit predicts the steps of the window after each decision, from
the steps it keeps: the latest 800 (before 2026-12-04) or its sample of every shape of step
(server/step_sample.py); and, with --profile, a measured profile for reference. Reads the step
events of a run, as GET /admin/events sends them (save them with
`curl -sN "localhost:8000/admin/events?since=T" --max-time 20 > events.sse` after the run).

    python scripts/measure_live_fit.py events.sse --profile profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("events", help="server-sent events of a run (lines 'data: {...}')")
    ap.add_argument("--profile", help="a measured profile, predicted beside the live fits")
    ap.add_argument("--window", type=float, default=10.0, help="seconds between decisions, and predicted after each")
    ap.add_argument("--span", type=float, default=80.0, help="report the errors per span of this many seconds")
    args = ap.parse_args()
    from minipd.server.advisor_sim import live_profile
    from minipd.server.step_sample import StepSample
    from minipd.sim.profile import Profile, WorkerShape

    with open(args.events) as f:
        steps = sorted((e for e in (json.loads(line[6:]) for line in f if line.startswith("data: {")) if e.get("type") == "step"),
                       key=lambda s: s["end"])  # fmt: skip
    if not steps:
        raise SystemExit("no step events in that file")
    t0, t1 = steps[0]["time"], steps[-1]["end"]

    def sample(kept: list[dict]) -> list[dict]:
        s = StepSample()
        for step in kept:
            s.add(step)
        return s.steps(kept[-1]["end"])

    def live_fit(kept: list[dict]):
        got = live_profile(kept, [], WorkerShape(), "shm")
        return got[0].step if got else None

    fits = {"latest 800 steps": lambda kept: live_fit(kept[-800:]), "sample of every shape": lambda kept: live_fit(sample(kept))}
    if args.profile:
        with open(args.profile) as f:
            measured = Profile.from_dict(json.load(f)).step
        fits["measured profile"] = lambda kept: measured
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in fits}
    t = t0 + 2 * args.window
    while t + args.window <= t1:
        kept = [s for s in steps if s["end"] <= t]
        after = [s for s in steps if t <= s["time"] < t + args.window]
        if len(after) >= 5:
            for name, fit in fits.items():
                if (cost := fit(kept)) is not None:
                    rows[name].append((t - t0, *errors(cost, after)))
        t += args.window
    print(f"{len(steps)} steps over {t1 - t0:.0f} s; each decision's fit predicting the next {args.window:g} s of steps")
    print(f"{'from':<24}{'span':>12}{'median |error|':>16}{'mean bias':>11}{'decisions':>11}")
    for name, r in rows.items():
        spans = [(lo, lo + args.span) for lo in np.arange(0, t1 - t0, args.span)] + [(0.0, float("inf"))]
        for lo, hi in spans:
            sel = [x for x in r if lo <= x[0] < hi]
            if sel:
                span = "all" if hi == float("inf") else f"{lo:.0f}-{hi:.0f} s"
                print(f"{name:<24}{span:>12}{statistics.fmean(x[1] for x in sel):>16.1%}"
                      f"{statistics.fmean(x[2] for x in sel):>+11.1%}{len(sel):>11}")  # fmt: skip


def errors(cost, steps: list[dict]) -> tuple[float, float]:
    """Median absolute relative error and mean relative error (bias) of `cost` on `steps`."""
    predicted = np.array([cost.seconds(s["prefill_tokens"], s["prefill_attention"], s["decodes"], s["decode_context"])
                          for s in steps])  # fmt: skip
    rel = predicted / np.array([s["end"] - s["time"] for s in steps]) - 1
    return float(np.median(np.abs(rel))), float(np.mean(rel))


if __name__ == "__main__":
    main()
