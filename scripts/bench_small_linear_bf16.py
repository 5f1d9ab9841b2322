"""small_linear in bfloat16 against float32 and PyTorch's bfloat16 product (oneDNN), and where it is
built for bfloat16 (AVX512-BF16) blocked_linear in both, on the default
model's decode shapes (30 layers of q/k/v, o, gate/up and down), at 1, 2, 4 and 8 rows, one thread:
GB/s of weights read (bfloat16 is half the bytes of float32 for the same layers). Run it from two
checkouts to compare two builds of the kernel; the float32 column, the same code in both, is the
control for the machine's drift between the runs.

    python scripts/bench_small_linear_bf16.py
"""

from __future__ import annotations

import argparse
import time

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of SmolLM2-135M's linears
LAYERS = 30


def gb_per_s(weights: list, rows: int, product, rounds: int = 5) -> float:
    import torch

    xs = {k: torch.randn(rows, k).to(weights[0].dtype) for k in {w.shape[1] for w in weights}}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for w in weights:
            product(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8", help="batch sizes (rows of x); small_linear takes at most 8")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from minipd.models import cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are not built here: {cpu_kernels.error()}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    f32 = [torch.randn(n, k) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    bf16 = [w.bfloat16() for w in f32]
    print(f"kernels {cpu_kernels.kernel_isa()}, bfloat16 dot products: {cpu_kernels.bfloat16_dot()}; "
          f"bfloat16 instructions: {cpu_kernels.native_bfloat16()}; one thread; GB/s of weights read")  # fmt: skip

    def small(x, w):
        return torch.ops.minipd.small_linear(x, w, None)

    blocked = cpu_kernels.blocked_bfloat16()
    if blocked:
        held = {id(w): torch.ops.minipd.blocked_weight(w) for w in f32 + bf16}
        x = torch.randn(3, 576)
        for w in (bf16[0], f32[0]):  # the same answers, or the comparison means nothing
            want = F.linear(x.to(w.dtype).float(), w.float())
            got = torch.ops.minipd.blocked_linear(x.to(w.dtype), held[id(w)], None).float()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    def blocks(x, w):
        return torch.ops.minipd.blocked_linear(x, held[id(w)], None)

    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        if rows <= 8:
            cells += [f"small_linear bf16 {gb_per_s(bf16, rows, small):5.1f}", f"f32 {gb_per_s(f32, rows, small):5.1f}"]
        if blocked:
            cells += [f"blocked bf16 {gb_per_s(bf16, rows, blocks):5.1f}", f"f32 {gb_per_s(f32, rows, blocks):5.1f}"]
        cells.append(f"F.linear bf16 {gb_per_s(bf16, rows, F.linear):5.1f}")
        print(f"rows {rows}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
