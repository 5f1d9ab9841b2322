"""minipd's prefill attention alone (torch.ops.minipd.paged_prefill), float32 and bfloat16, on the
default model's shape (9 query heads, 3 kv heads, head_dim 64): one prompt of T tokens attending
causally to itself, its blocks scattered in the cache, one call as one layer of a prefill. Prints
ms per call and GFLOP/s (the causal half of QK^T and PV: 2 x 2 x T^2 / 2 x head_dim per query head).

    python scripts/bench_prefill_attention.py --tokens 512,2048
    python scripts/bench_prefill_attention.py --against HEAD   # a kernel change, side by side

--against REV also builds the kernels of git revision REV (revision_kernels.py), checks that both
give the same answers, and times the two in alternating calls, with the ratio.
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", default="512,2048", help="prompt lengths (multiples of 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="best of this many calls")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--against", metavar="REV", help="also time the prefill attention of this git revision")
    args = ap.parse_args()
    import torch
    from revision_kernels import kernels_side_by_side  # beside this script

    from minipd.models import cpu_kernels

    kernels = kernels_side_by_side(args.against, args.threads)
    Hq, Hkv, D, bs = 9, 3, 64, 16
    print(f"kernels built for {cpu_kernels.kernel_isa()}; threads {args.threads}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            blocks = T // bs
            k, v = torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)
            table = torch.randperm(blocks)
            k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
            slots = (table.view(-1, 1) * bs + torch.arange(bs)).view(-1)
            k_cache[slots], v_cache[slots] = k, v
            q = torch.randn(T, Hq, D, dtype=dtype)

            def call(ops):
                return ops.paged_prefill(q, k_cache, v_cache, table, T, bs, 1 / math.sqrt(D))

            answers = [call(ops) for ops in kernels.values()]
            for a in answers[1:]:
                torch.testing.assert_close(a, answers[0])
            took = {name: [] for name in kernels}
            for _ in range(args.repeats):  # calls in turn: a slow moment of the machine falls on both
                for name, ops in kernels.items():
                    t = time.perf_counter()
                    call(ops)
                    took[name].append(time.perf_counter() - t)
            flop = 2 * 2 * T * T / 2 * D * Hq
            for name in kernels:
                best = min(took[name])
                print(f"{str(dtype):<16} {T:>6} tokens  {name:<20} {best * 1e3:8.1f} ms  {flop / best / 1e9:6.1f} GFLOP/s")
            if args.against:
                now, then = kernels
                print(f"{'':<16} {'':>13}  {'ratio (then / now)':<20} {min(took[then]) / min(took[now]):.2f}x")


if __name__ == "__main__":
    main()
