"""The decode step's linear layers alone, at 1 to 8 rows (or more): minipd's small-row kernel
(to 8 rows) and its product on weights in column blocks (csrc/blocked_linear.cpp) against
torch's F.linear (MKL) and oneDNN (plain weights, and prepacked in its blocked layout), on the
default model's weight shapes in step order (30 layers and the LM head, 538 MB: more than the
caches, so every call reads from memory). Prints GB/s of
weights read and the ratio to a plain read stream measured in the same process, one thread.

    python scripts/bench_small_linear.py
    python scripts/bench_small_linear.py --against HEAD~1   # a kernel change, side by side
    python scripts/bench_small_linear.py --rows 8,16,32,64     # decode batches past 8 rows

--against REV also builds the kernels of git revision REV (under other namespaces, so both load in
this process) and adds its column and the ratio of the working tree's kernel to it.
"""

from __future__ import annotations

import argparse
import time

SMALL_ROWS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8", help="rows of x (the decode batch)")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many passes")
    ap.add_argument("--only", choices=["down"], help="only the MLP's down projections (K 1,536): 106 MB")
    ap.add_argument("--against", metavar="REV", help="also time the small-row and blocked kernels of this git revision")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from minipd.models import cpu_kernels

    if not cpu_kernels.small_linear_available():
        raise SystemExit("the small-row kernel is not in use here (needs a compiler and a vector ISA: AVX-512, AVX2 or NEON; see python -m minipd info)")
    hidden, inter, kv, vocab, layers = 576, 1536, 192, 49152, 30  # SmolLM2-135M
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [
        (vocab, hidden)]  # q/k/v and gate/up stacked, as minipd holds them  # fmt: skip
    if args.only == "down":
        shapes = [(hidden, inter)] * layers
    weights = [torch.randn(n, k) for n, k in shapes]
    total = sum(w.numel() for w in weights) * 4

    def best(*fns) -> list[float]:
        """Each fn's best time, their passes taken in turn so that drifts in the machine's speed
        fall on all of them alike."""
        times = [[] for _ in fns]
        for i in range(args.repeats + 1):
            for fn, took in zip(fns, times):
                t = time.perf_counter()
                fn()
                if i:  # the first pass warms up
                    took.append(time.perf_counter() - t)
        return [min(took) for took in times]

    stream = torch.ones(128 * 2**20)
    bw = stream.numel() * 4 / best(stream.sum)[0]
    print(f"read stream {bw / 1e9:.1f} GB/s; weights {total / 1e6:.0f} MB per pass; GB/s (fraction of the stream)")
    onednn = torch.ops.mkldnn._linear_pointwise
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 1024) for w in weights}  # as --prepack holds them
    blocked = {id(w): torch.ops.minipd.blocked_weight(w) for w in weights}  # as --prepack holds them on AVX-512
    ways = {"minipd": lambda x, w: torch.ops.minipd.small_linear(x, w, None)}
    if args.against:
        from revision_kernels import kernels_of_revision  # beside this script

        then = kernels_of_revision(args.against)  # torch.ops.minipd_then
        ways[f"minipd@{args.against}"] = lambda x, w: then.small_linear(x, w, None)
    ways |= {"minipd blocked": lambda x, w: torch.ops.minipd.blocked_linear(x, blocked[id(w)], None)}
    if args.against:  # the same copy where both revisions lay the blocks out alike (a second copy's pages read at another speed)
        same = all(torch.equal(then.blocked_weight(w[:, :64]), torch.ops.minipd.blocked_weight(w[:, :64])) for w in weights[:4])
        blocked_then = blocked if same else {id(w): then.blocked_weight(w) for w in weights}
        ways[f"blocked@{args.against}"] = lambda x, w: then.blocked_linear(x, blocked_then[id(w)], None)
    ways |= {
        "F.linear": torch.nn.functional.linear,
        "oneDNN": lambda x, w: onednn(x, w, None, "none", [], ""),
        "oneDNN packed": lambda x, w: onednn(x, packed[id(w)], None, "none", [], ""),
    }
    print(f"{'rows':>4}" + "".join(f"{name:>17}" for name in ways) + ("  minipd / then, blocked / then" if args.against else ""))
    small = {"minipd", f"minipd@{args.against}"}  # the small-row kernel takes at most SMALL_ROWS
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {hidden: torch.randn(m, hidden), inter: torch.randn(m, inter)}
            runs = {name: fn for name, fn in ways.items() if m <= SMALL_ROWS or name not in small}
            for fn in runs.values():  # same answers, or the comparison means nothing
                torch.testing.assert_close(fn(xs[inter], weights[3]), xs[inter] @ weights[3].t(), rtol=1e-4, atol=1e-3)
            passes = [lambda fn=fn: [fn(xs[w.shape[1]], w) for w in weights] for fn in runs.values()]
            rates = dict(zip(runs, (total / t for t in best(*passes))))
            ratio = f"{rates['minipd'] / rates[f'minipd@{args.against}']:>12.2f}x" if args.against and m <= SMALL_ROWS else ""
            ratio += f"{rates['minipd blocked'] / rates[f'blocked@{args.against}']:>12.2f}x" if args.against else ""
            cells = [f"{rates[n] / 1e9:>10.1f} ({rates[n] / bw:>4.0%})" if n in rates else f"{'-':>17}" for n in ways]
            print(f"{m:>4}" + "".join(cells) + ratio, flush=True)


if __name__ == "__main__":
    main()
