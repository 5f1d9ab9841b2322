"""python -m minipd plan: profile minipd's workers and recommend how many prefill and how many
decode workers to run for a traffic description and SLOs, with the arithmetic shown.

    python -m minipd plan --workload summarize --rate 0.3 --slo-ttft-ms 8000 --slo-tpot-ms 150
"""

from __future__ import annotations

import argparse

from minipd.cli_help import DefaultsFormatter


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    ap.add_argument("--url", default=None, help="a running minipd server (default: start one)")
    ap.add_argument("--api-key", default=None, help="its API key, if it needs one")
    ap.add_argument("--model", default=None, help="model for the server this starts (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--workers", type=int, default=2, help="workers of the server this starts")
    ap.add_argument(
        "--workload",
        default=None,
        help="chat, summarize, mixed or fixed: its length distributions "
        "(default: chat; fixed when --input-len and --output-len are given)",
    )
    ap.add_argument("--input-len", type=int, default=None, help="the fixed workload's prompt tokens")
    ap.add_argument("--output-len", type=int, default=None, help="the fixed workload's reply tokens")
    ap.add_argument("--quick", action="store_true", help="the workload's 2-core sizes, and a shorter profile")
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--slo-ttft-ms", type=float, required=True, help="SLO on time to first token")
    ap.add_argument("--slo-tpot-ms", type=float, required=True, help="SLO on time per output token")
    ap.add_argument("--plan-workers", type=int, default=None, help="workers to split (default: the server's)")
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
    from minipd.bench.target import Target
    from minipd.bench.workloads import make_workload

    server = None
    if args.url is None:
        extra = ["--model", args.model] if args.model else []
        server = ServerProcess("--workers", str(args.workers), "--threads-per-worker", "1", "--log-level", "warning",
                               *extra)  # fmt: skip
    try:
        target = Target.probe(args.url or server.url, args.api_key)
        profile = plan.profile(target, quick=args.quick)
    finally:
        if server is not None:
            server.stop()
    reqs = make_workload(args.workload, num_prompts=200, rate=args.rate, quick=args.quick, input_len=args.input_len,
                         output_len=args.output_len, max_model_len=target.max_model_len)  # fmt: skip
    traffic = plan.Traffic(args.rate, sum(r.prompt_len for r in reqs) / len(reqs),
                           sum(r.output_len for r in reqs) / len(reqs))  # fmt: skip
    result = plan.recommend(profile, traffic, args.plan_workers or target.num_workers, args.slo_ttft_ms / 1e3,
                            args.slo_tpot_ms / 1e3)  # fmt: skip
    print(plan.explain(result, profile))
    rule = plan.nanopd_rule(profile, result["best"]["decode_batch"] or 1.0)
    print(f"\nnanoPD's rule: interference/token over transfer/token = {rule['lhs']:.3g}, B*/load = {rule['rhs']:.3g}: "
          f"disaggregation {'pays' if rule['disagg_pays'] else 'does not pay'}; break-even link "
          f"{rule['predicted_crossover_gbps']:.3g} Gb/s.")  # fmt: skip
    return 0
