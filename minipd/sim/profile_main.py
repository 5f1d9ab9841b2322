"""python -m minipd profile: measure minipd's workers (a server it starts, or a running one with --url)
and write a profile JSON: step time against what the step carried (prompt tokens and what they attend
to, decodes and their context, mixed steps), the worker's time between steps, KV transfer time
against bytes on the server's transport, and the host's own delays. `sim` and `plan` read it.

    python -m minipd profile --quick --out profile.json
    python -m minipd profile --url http://127.0.0.1:8000 --out profile.json
"""

from __future__ import annotations

import argparse
import sys

from minipd.cli_help import DefaultsFormatter, positive_int, server_url


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd profile", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    ap.add_argument("--url", type=server_url, default=None, help="a running minipd server (default: start one)")
    ap.add_argument("--api-key", default=None, help="its API key, if it needs one")
    ap.add_argument("--model", default=None, help="model for the server this starts (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--workers", type=positive_int, default=2, help="workers of the server this starts")
    ap.add_argument("--threads-per-worker", type=positive_int, default=1, help="torch threads per worker")
    ap.add_argument("--kv-transport", default="shm", choices=["shm", "tcp"], help="for the server this starts")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter loads (2-4 minutes on 2 cores)")
    ap.add_argument("--out", default="profile.json", help="where the profile is written")
    return ap.parse_args(argv)


def run(argv=None) -> int:
    args = parse_args(argv)
    from minipd.bench.server_process import ServerProcess
    from minipd.bench.target import Target, Unreachable
    from minipd.sim.measure import measure

    server = None
    if args.url:
        try:
            target = Target.probe(args.url, args.api_key)
        except Unreachable as err:
            print(f"python -m minipd profile: error: cannot reach a minipd server at {args.url}: {err}", file=sys.stderr)
            return 2
        if not target.is_minipd:
            print(f"python -m minipd profile: error: {args.url} is not a minipd server (a profile reads its workers' "
                  "engine steps)", file=sys.stderr)  # fmt: skip
            return 2
    else:
        extra = ["--model", args.model] if args.model else []
        server = ServerProcess("--workers", str(args.workers), "--threads-per-worker", str(args.threads_per_worker),
                               "--kv-transport", args.kv_transport, "--log-level", "warning", *extra)  # fmt: skip
        target = Target.probe(server.url)
    try:
        profile = measure(target, quick=args.quick, say=lambda text: print(text, file=sys.stderr))
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        profile.about["threads_per_worker"] = args.threads_per_worker
    profile.save(args.out)
    print(describe(profile), file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def describe(profile) -> str:
    s, fit = profile.step, profile.about.get("step_fit", {})
    lines = [f"step = {s.fixed * 1e3:.2f} ms + {s.per_prefill_token * 1e6:.2f} us/prompt token{s.prompt_bends_text()} + "
             f"{s.per_attention_pair * 1e9:.3f} ns/(query, key) pair + {s.per_decode * 1e3:.3f} ms/decode{s.bends_text()} + "
             f"{s.per_decode_context * 1e6:.3f} us/decode context token (+ {s.per_mixed_decode * 1e3:.3f} ms/decode beside prompt "
             f"tokens), {s.co_runner_text()}; {s.gap * 1e3:.2f} ms between steps",
             f"  fitted on {fit.get('steps', '?')} steps: median error {fit.get('median_abs_rel_error', float('nan')):.1%}, "
             f"p90 {fit.get('p90_abs_rel_error', float('nan')):.1%}",
             f"host: {profile.host.dispatch_s * 1e3:.1f} ms to place a request, {profile.host.token_s * 1e3:.1f} ms from a "
             "step's end to the client"]  # fmt: skip
    for name, link in profile.links.items():
        lines.append(f"KV over {name}: {link.latency_s * 1e3:.2f} ms + {link.bytes_per_s * 8 / 1e9:.2f} Gb/s"
                     + (" (the writer's loop copies)" if link.blocks_writer else ""))  # fmt: skip
    return "\n".join(lines)
