"""The linear layers of a prefill at several row counts: MKL's float32 product (F.linear, plain
weights) against oneDNN's on weights prepacked in its blocked layout (as `--prepack` holds them),
on the default model's layer shapes, interleaved rounds in one process, one thread. Prints each
side's best and median time and oneDNN's speed-up; minipd uses oneDNN up to the rows where it
stops winning (cpu_kernels.onednn_max_rows). Where minipd's kernels are built for a vector ISA,
its product on column-blocked weights (csrc/blocked_linear.cpp) runs in the same rounds, and the
best GFLOP/s of each side is printed.

    python scripts/bench_prefill_linear.py --rows 64,128,256,512,1024
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128,256,512,1024", help="rows of x (prompt tokens in the step)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds per row count")
    ap.add_argument("--layers", type=int, default=2, help="layers of weights per round")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from minipd.info import cpu_name
    from minipd.models import blocked_choice, cpu_kernels

    torch.set_num_threads(1)
    shapes = list(blocked_choice.SHAPES) * args.layers  # SmolLM2-135M's, q/k/v and gate/up stacked as minipd holds them
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1024) for w in weights]
    with_blocked = cpu_kernels.available() and cpu_kernels.small_linear_available()
    blocked = [torch.ops.minipd.blocked_weight(w) for w in weights] if with_blocked else []
    flop_per_row = 2 * sum(n * k for n, k in shapes)
    print(f"{cpu_name()}, torch capability {torch.backends.cpu.get_cpu_capability()}, float32, one thread, "
          f"{args.layers} layers of the default model per round, {args.rounds} interleaved rounds")  # fmt: skip
    if with_blocked:
        print(f"minipd blocked_linear built for {cpu_kernels.kernel_isa()}")
    print(f"{'rows':>6} {'MKL best':>9} {'median':>8} {'oneDNN best':>12} {'median':>8}  oneDNN speed-up (best, median)"
          + ("   blocked best  median  x MKL  x oneDNN (best)" if with_blocked else "") + "   GFLOP/s (best)")  # fmt: skip

    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}

        def mkl():
            return [F.linear(xs[w.shape[1]], w) for w in weights]

        def onednn():
            return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(weights, packed)]  # fmt: skip

        def minipd_blocked():
            return [torch.ops.minipd.blocked_linear(xs[w.shape[1]], bw, None) for w, bw in zip(weights, blocked)]

        mkl(), onednn()
        if with_blocked:
            minipd_blocked()
        a, b, c = [], [], []
        for _ in range(args.rounds):
            a.append(once(mkl))
            b.append(once(onednn))
            if with_blocked:
                c.append(once(minipd_blocked))
        ma, mb = statistics.median(a), statistics.median(b)
        line = (f"{rows:>6} {min(a) * 1e3:>7.1f}ms {ma * 1e3:>6.1f}ms {min(b) * 1e3:>10.1f}ms {mb * 1e3:>6.1f}ms  "
                f"{min(a) / min(b):.2f}x, {ma / mb:.2f}x")  # fmt: skip
        rates = [min(a), min(b)]
        if with_blocked:
            line += (f"   {min(c) * 1e3:>10.1f}ms {statistics.median(c) * 1e3:>6.1f}ms {min(a) / min(c):>5.2f}x "
                     f"{min(b) / min(c):>7.2f}x")  # fmt: skip
            rates.append(min(c))
        print(line + "   " + " / ".join(f"{flop_per_row * rows / t / 1e9:.0f}" for t in rates))


if __name__ == "__main__":
    main()
