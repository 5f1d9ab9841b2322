"""minipd's decode attention alone (torch.ops.minipd.paged_attention), float32 and bfloat16, on
the default model's shape (9 query heads, 3 kv heads, head_dim 64): a batch of sequences whose
blocks lie scattered in the cache, one call per layer over 30 layers' caches (read from memory,
as in a step), and one layer's cache called 30 times (hot in the CPU's caches). Prints ms per 30
calls and the bytes of KV read per second.

    python scripts/bench_decode_attention.py --batch 8 --context 512
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
    args = ap.parse_args()
    import torch

    from minipd.models import cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are not built: {cpu_kernels.error()}")
    torch.set_num_threads(args.threads)
    B, L, Hq, Hkv, D, bs, layers = args.batch, args.context, 9, 3, 64, 16, 30
    print(f"kernels built for {cpu_kernels.kernel_isa()}; batch {B}, context {L}, threads {args.threads}")
    for dtype in (torch.float32, torch.bfloat16):
        blocks = B * L // bs
        caches = [(torch.randn(blocks * bs, Hkv, D, dtype=dtype), torch.randn(blocks * bs, Hkv, D, dtype=dtype))
                  for _ in range(layers)]  # fmt: skip
        tables = torch.randperm(blocks).view(B, L // bs)
        q = torch.randn(B, Hq, D, dtype=dtype)
        seq, pos = torch.arange(B), torch.full((B,), L - 1)

        def call(k, v):
            torch.ops.minipd.paged_attention(q, k, v, tables, seq, pos, bs, 1 / math.sqrt(D))

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        cold = best(lambda: [call(k, v) for k, v in caches])
        hot = best(lambda: [call(*caches[0]) for _ in range(layers)])
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
        print(f"{str(dtype):<16} 30 layers {cold * 1e3:6.1f} ms ({nbytes / cold / 1e9:.1f} GB/s of KV)   "
              f"one layer x30, hot {hot * 1e3:6.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
