"""minipd's decode attention alone (torch.ops.minipd.paged_attention), float32 and bfloat16, on
the default model's shape (9 query heads, 3 kv heads, head_dim 64): a batch of sequences whose
blocks lie scattered in the cache, one call per layer over 30 layers' caches (read from memory,
as in a step), and one layer's cache called 30 times (hot in the CPU's caches). Prints ms per 30
calls and the bytes of KV read per second.

    python scripts/bench_decode_attention.py --batch 8 --context 512
    python scripts/bench_decode_attention.py --against HEAD   # a kernel change, side by side

--against REV also builds the kernels of git revision REV (revision_kernels.py), checks that both
give the same answers, and times the two in alternating passes, with the ratio.
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512, help="tokens per sequence (a multiple of 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", metavar="REV", help="also time the decode attention of this git revision")
    args = ap.parse_args()
    import torch
    from revision_kernels import kernels_side_by_side  # beside this script

    from minipd.models import cpu_kernels

    kernels = kernels_side_by_side(args.against, args.threads)
    B, L, Hq, Hkv, D, bs, layers = args.batch, args.context, 9, 3, 64, 16, 30
    print(f"kernels built for {cpu_kernels.kernel_isa()}; batch {B}, context {L}, threads {args.threads}")
    for dtype in (torch.float32, torch.bfloat16):
        blocks = B * L // bs
        caches = [(torch.randn(blocks * bs, Hkv, D, dtype=dtype), torch.randn(blocks * bs, Hkv, D, dtype=dtype))
                  for _ in range(layers)]  # fmt: skip
        tables = torch.randperm(blocks).view(B, L // bs)
        q = torch.randn(B, Hq, D, dtype=dtype)
        seq, pos = torch.arange(B), torch.full((B,), L - 1)

        def call(ops, k, v):
            return ops.paged_attention(q, k, v, tables, seq, pos, bs, 1 / math.sqrt(D))

        answers = [call(ops, *caches[0]) for ops in kernels.values()]  # same answers, or the timing means nothing
        for a in answers[1:]:
            torch.testing.assert_close(a, answers[0])  # the dtype's own tolerance: sums in another order may round apart
        cold = {name: [] for name in kernels}
        hot = {name: [] for name in kernels}
        for _ in range(5):  # passes in turn: a slow moment of the machine falls on both
            for name, ops in kernels.items():
                cold[name].append(timed(lambda: [call(ops, k, v) for k, v in caches]))
                hot[name].append(timed(lambda: [call(ops, *caches[0]) for _ in range(layers)]))
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
        for name in kernels:
            c, h = min(cold[name]), min(hot[name])
            print(f"{str(dtype):<16} {name:<20} 30 layers {c * 1e3:6.1f} ms ({nbytes / c / 1e9:.1f} GB/s of KV)   "
                  f"one layer x30, hot {h * 1e3:6.1f} ms")  # fmt: skip
        if args.against:
            now, then = kernels
            print(f"{'':<16} {'ratio (then / now)':<20} cold {min(cold[then]) / min(cold[now]):.2f}x, "
                  f"hot {min(hot[then]) / min(hot[now]):.2f}x")  # fmt: skip


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
