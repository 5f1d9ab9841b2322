"""The linear layers of a prefill at several row counts: MKL's float32 product (F.linear, plain
weights) against oneDNN's on weights prepacked in its blocked layout (as `--prepack` holds them),
on the default model's layer shapes, interleaved rounds in one process, one thread. Prints each
side's best and median time and oneDNN's speed-up; minipd uses oneDNN up to the rows where it
stops winning (cpu_kernels.onednn_max_rows).

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

    torch.set_num_threads(1)
    hidden, inter, kv = 576, 1536, 192  # SmolLM2-135M, q/k/v and gate/up stacked as minipd holds them
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * args.layers
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1024) for w in weights]
    print(f"{cpu_name()}, torch capability {torch.backends.cpu.get_cpu_capability()}, float32, one thread, "
          f"{args.layers} layers of the default model per round, {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'rows':>6} {'MKL best':>9} {'median':>8} {'oneDNN best':>12} {'median':>8}  oneDNN speed-up (best, median)")

    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (hidden, inter)}

        def mkl():
            return [F.linear(xs[w.shape[1]], w) for w in weights]

        def onednn():
            return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(weights, packed)]  # fmt: skip

        mkl(), onednn()
        a, b = [], []
        for _ in range(args.rounds):
            a.append(once(mkl))
            b.append(once(onednn))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{rows:>6} {min(a) * 1e3:>7.1f}ms {ma * 1e3:>6.1f}ms {min(b) * 1e3:>10.1f}ms {mb * 1e3:>6.1f}ms  "
              f"{min(a) / min(b):.2f}x, {ma / mb:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
