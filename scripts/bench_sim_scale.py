"""How fast the simulator is at fleet scale: N requests on W workers (disagg with a quarter of them
prefilling, and colocated), from a roofline profile of an accelerator, on one core (the simulator is
one Python thread). Prints wall time, steps and time per generated token, and the machine.

    python scripts/bench_sim_scale.py --requests 100000 --workers 512 --rate 20000 --quick
    python scripts/bench_sim_scale.py --requests 100000 --workers 512 --rate 5000
"""

from __future__ import annotations

import argparse
import platform
import time

from minipd.bench.workloads import make_workload
from minipd.cli_help import positive_float, positive_int
from minipd.server.modes import Mode
from minipd.sim import profile as pf
from minipd.sim.cluster import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=100000)
    ap.add_argument("--workers", type=positive_int, default=512, help="(disagg needs 2 or more)")
    ap.add_argument("--rate", type=positive_float, default=20000.0, help="req/s offered to the whole fleet")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--quick", action="store_true", help="the bench's short lengths (chat: replies of 16-64 tokens)")
    ap.add_argument("--accelerator", default="h100")
    ap.add_argument("--modes", default="disagg,colocated")
    args = ap.parse_args()
    acc = pf.ACCELERATORS.get(args.accelerator.lower())
    if acc is None:
        ap.error(f"--accelerator: one of {', '.join(pf.ACCELERATORS)}")
    if any(name not in ("disagg", "colocated") for name in args.modes.split(",")):
        ap.error("--modes: disagg and/or colocated")
    if "disagg" in args.modes and args.workers < 2:
        ap.error("disagg needs --workers 2 or more")
    profile = pf.roofline(acc, 8e9, 131072, 16e9, pf.WorkerShape(num_blocks=262144 // 16, kv_bytes_per_token=131072))
    reqs = make_workload(args.workload, num_prompts=args.requests, rate=args.rate, seed=0, quick=args.quick)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    try:
        import torch

        isa = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        isa = "?"
    print(f"{cpu} ({isa}), Python {platform.python_version()}; {args.requests} {args.workload}"
          f"{' (quick)' if args.quick else ''} requests at {args.rate:g} req/s on {args.workers} simulated workers "
          f"({profile.source}, 8B parameters)")  # fmt: skip
    for name in args.modes.split(","):
        p = max(1, args.workers // 4)
        mode = Mode("disagg", p, args.workers - p) if name == "disagg" else Mode(name)
        started = time.perf_counter()
        records, sim = simulate(profile, reqs, mode, args.workers)
        wall = time.perf_counter() - started
        tokens = sum(r.output_tokens for r in records)
        steps = sum(w.steps for w in sim.workers)
        done = sum(r.output_tokens == r.output_len_wanted for r in records)
        label = f"disagg {p}P{args.workers - p}D" if name == "disagg" else name
        print(f"{label:>18}: {wall:6.1f} s wall, {done}/{len(records)} requests complete, {tokens} tokens in {steps} "
              f"steps (mean batch {tokens / max(steps, 1):.1f}), {wall / tokens * 1e6:.2f} us per token")  # fmt: skip


if __name__ == "__main__":
    main()
