"""python -m minipd plan: profile minipd's workers and recommend how many prefill and how many
decode workers to run for a traffic description and SLOs, with the arithmetic shown.

    python -m minipd plan --workload summarize --rate 0.3 --slo-ttft-ms 8000 --slo-tpot-ms 150
"""

from __future__ import annotations

import argparse
import sys

from minipd.cli_help import DefaultsFormatter, positive_float, positive_int, server_url


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    ap.add_argument("--url", type=server_url, default=None, help="a running minipd server (default: start one)")
    ap.add_argument("--api-key", default=None, help="its API key, if it needs one")
    ap.add_argument("--model", default=None, help="model for the server this starts (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--workers", type=positive_int, default=2, help="workers of the server this starts")
    ap.add_argument(
        "--workload",
        default=None,
        help="chat, summarize, generate, mixed, fixed or phases: its length distributions "
        "(default: chat; fixed when --input-len and --output-len are given)",
    )
    ap.add_argument("--input-len", type=positive_int, default=None, help="the fixed workload's prompt tokens")
    ap.add_argument("--output-len", type=positive_int, default=None, help="the fixed workload's reply tokens")
    ap.add_argument("--quick", action="store_true", help="the workload's 2-core sizes, and a shorter profile")
    ap.add_argument("--rate", type=positive_float, default=0.5, help="requests per second")
    ap.add_argument("--slo-ttft-ms", type=positive_float, required=True, help="SLO on time to first token")
    ap.add_argument("--slo-tpot-ms", type=positive_float, required=True, help="SLO on time per output token")
    ap.add_argument("--plan-workers", type=positive_int, default=None, help="workers to split (default: the server's)")
    ap.add_argument("--profile", default=None,
                    help="a profile JSON from `python -m minipd profile` instead of profiling a server (the "
                    "workers need not be running; give --plan-workers)")  # fmt: skip
    ap.add_argument("--sim", action="store_true",
                    help="also run every split in the simulator at the rate (minipd's own scheduler on the profile's "
                    "step times) and recommend by simulated SLO attainment, beside the queueing model's choice")  # fmt: skip
    ap.add_argument("--sim-prompts", type=positive_int, default=400, help="requests per simulated split")
    args = ap.parse_args(argv)
    from minipd.bench.workloads import workload_names

    try:
        names = workload_names(args.workload, args.input_len, args.output_len, "--workload")
    except ValueError as err:
        ap.error(str(err))
    if len(names) > 1:
        ap.error(f"--workload takes one workload, got {args.workload!r}")
    args.workload = names[0]
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    from minipd.bench import plan
    from minipd.bench.server_process import ServerProcess
    from minipd.bench.target import Target, Unreachable
    from minipd.bench.workloads import make_workload

    server = sim_profile = None
    if args.profile:
        from minipd.sim.profile import Profile as SimProfile

        try:
            sim_profile = SimProfile.load(args.profile)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"python -m minipd plan: error: cannot read the profile {args.profile}: {err}", file=sys.stderr)
            return 2
        num_workers, max_model_len = args.plan_workers or args.workers, sim_profile.worker.max_model_len
    else:
        if args.url is None:
            extra = ["--model", args.model] if args.model else []
            server = ServerProcess("--workers", str(args.workers), "--threads-per-worker", "1", "--log-level",
                                   "warning", *extra)  # fmt: skip
        try:
            try:
                target = Target.probe(args.url or server.url, args.api_key)
            except Unreachable as err:
                print(f"python -m minipd plan: error: cannot reach a server at {args.url or server.url}: {err}",
                      file=sys.stderr)  # fmt: skip
                return 2
            if args.sim:
                from minipd.sim.measure import measure

                sim_profile = measure(target, quick=args.quick)
            profile = plan.profile(target, quick=args.quick) if sim_profile is None else None
        finally:
            if server is not None:
                server.stop()
        num_workers, max_model_len = args.plan_workers or target.num_workers, target.max_model_len
    reqs = make_workload(args.workload, num_prompts=200, rate=args.rate, quick=args.quick, input_len=args.input_len,
                         output_len=args.output_len, max_model_len=max_model_len)  # fmt: skip
    if sim_profile is not None:
        profile = plan.from_step_model(sim_profile, sum(r.prompt_len for r in reqs) / len(reqs))
    traffic = plan.Traffic(args.rate, sum(r.prompt_len for r in reqs) / len(reqs),
                           sum(r.output_len for r in reqs) / len(reqs))  # fmt: skip
    result = plan.recommend(profile, traffic, num_workers, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    print(plan.explain(result, profile))
    rule = plan.nanopd_rule(profile, result["best"]["decode_batch"] or 1.0)
    print(f"\nnanoPD's rule: interference/token over transfer/token = {rule['lhs']:.3g}, B*/load = {rule['rhs']:.3g}: "
          f"disaggregation {'pays' if rule['disagg_pays'] else 'does not pay'}; break-even link "
          f"{rule['predicted_crossover_gbps']:.3g} Gb/s.")  # fmt: skip
    if args.sim:
        print()
        print(simulated_splits(sim_profile, args, num_workers))
    return 0


def simulated_splits(profile, args, num_workers: int) -> str:
    """Every split (and colocated) at the rate, in the simulator: what the queueing model leaves out
    (batches that vary, prompts that differ, seats, the tail) is in it."""
    from minipd.bench import experiment as ex
    from minipd.sim.runs import sim_once

    s = ex.Settings(args.sim_prompts, None, 1.0, 0, args.quick, args.input_len, args.output_len, None, args.slo_ttft_ms,
                    args.slo_tpot_ms, False)  # fmt: skip
    options = [("colocated", {"mode": "colocated", "workers": None})] + [
        (f"{p}P{num_workers - p}D", {"mode": "disagg", "prefill_workers": p, "decode_workers": num_workers - p})
        for p in range(1, num_workers)]  # fmt: skip
    rows = []
    for label, body in options:
        sm = sim_once(profile, args.workload, label, body, args.rate, s, num_workers)["summary"]
        rows.append((label, sm))
    best = max(rows, key=lambda r: (r[1]["slo_attainment"] or 0.0, -(r[1]["p90_ttft_ms"] or 0.0)))
    lines = [f"Simulated ({profile.source} profile), {args.sim_prompts} requests at {args.rate:g} req/s:", "",
             "| split | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | SLO attainment |", "|---|---|---|---|"]  # fmt: skip
    for label, sm in rows:
        lines.append(f"| {label} | {sm['median_ttft_ms'] or 0:.0f} / {sm['p90_ttft_ms'] or 0:.0f} | "
                     f"{sm['median_tpot_ms'] or 0:.1f} / {sm['p90_tpot_ms'] or 0:.1f} | {sm['slo_attainment'] or 0:.1%} |")  # fmt: skip
    lines += ["", f"Recommended by the simulator: **{best[0]}** ({best[1]['slo_attainment'] or 0:.1%} of requests within "
              "both SLOs; a tie goes to the lower TTFT p90)."]  # fmt: skip
    return "\n".join(lines)
