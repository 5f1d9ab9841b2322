"""Whether blocked_linear (weights in column blocks, csrc/blocked_linear.cpp) runs a float32 model's
products on this CPU, where that is not known for its instruction set: measured once per kernel
build, beside the paths it would replace, and kept in the build's folder (blocked_choice.json).

On AVX-512 it is known (cpu_kernels.BLOCKED_ISAS). For AVX2 and NEON the kernel is the same source
but the cores differ: on a 2-core AMD EPYC Zen 1 (AVX2) it read the default model's weights 1.2-1.6x
faster than small_linear at 1-8 rows and multiplied 1.0-1.2x faster than oneDNN and MKL from 16 to
1,024 rows (scripts/bench_small_linear.py, scripts/bench_prefill_linear.py), and other AVX2 cores
were never measured. So it is timed here against what runs without it: small_linear for a decode
step's rows, oneDNN on prepacked weights and MKL for a prefill's, on the default model's layer
shapes, alternating, best of a few passes (a few seconds, in the build's child before the workers
spawn). It runs every product if it is faster for decode (by DECODE_GAIN) and no slower for
prefill (within PREFILL_SLACK). Where it is faster for decode but slower for prefill (the Zen 3
AVX2 EPYC: 1.2-1.4x at 1-16 rows, 0.7-0.9x from 32) it runs the products up to the largest row
count measured no slower (MIDDLE_ROWS: a decode batch's sizes), and the rest keep their paths.
MINIPD_BLOCKED_LINEAR=1 (every product) or 0 overrides."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from minipd.models import kernel_build

DECODE_ROWS = (1, 8)
MIDDLE_ROWS = (16, 32)  # a large decode batch, read from memory like DECODE_ROWS: how far the blocks may go
PREFILL_ROWS = (128, 1024)
DECODE_GAIN = 1.05  # geometric mean over DECODE_ROWS of the other path's time / blocked's
PREFILL_SLACK = 0.95  # each of PREFILL_ROWS: the other path's time / blocked's at least this
DECODE_BYTES = 96 << 20  # weights per decode pass: more than any cache, so read from memory
PASSES = 3
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # a layer of the default model, q/k/v and gate/up stacked


def path() -> Path:
    return kernel_build.build_directory() / kernel_build.BLOCKED_CHOICE_FILE


def decide(speedups: dict[int, float]) -> int:
    """Rows up to which blocked_linear runs (0: never, sys.maxsize: every product), from its measured
    speed-ups over the other path per row count."""
    decode = math.exp(sum(math.log(speedups[r]) for r in DECODE_ROWS) / len(DECODE_ROWS))
    if decode < DECODE_GAIN:
        return 0
    if all(speedups[r] >= PREFILL_SLACK for r in PREFILL_ROWS):
        return sys.maxsize
    rows = max(DECODE_ROWS)
    for r in sorted(r for r in speedups if r > rows):
        if speedups[r] < 1.0:
            break
        rows = r
    return rows


def rows_of(found: dict) -> int:
    """The rows a kept measurement decided (decide()); JSON keeps "every product" as null."""
    if not found.get("use"):
        return 0
    return sys.maxsize if found.get("rows") is None else int(found["rows"])


def cached() -> dict | None:
    """The kept measurement, or None where there is none or it is not one (then it is taken again)."""
    return kernel_build.read_blocked_choice(path())


def choice() -> dict:
    """The measured choice for this build: read, or measured now and kept. A measurement that
    fails leaves blocked_linear off (and says why), not the kernels."""
    if (found := cached()) is not None:
        return found
    try:
        measured = measure()
    except Exception as err:  # e.g. a torch without oneDNN: the paths it would be timed against are not there
        measured = {"use": False, "rows": 0, "speedup": {}, "error": f"{type(err).__name__}: {err}"[:300]}
    target = path()
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(measured, indent=1))
        temporary.replace(target)  # whole or not at all: another process may read it now
    except OSError:
        temporary.unlink(missing_ok=True)
    return measured


def measure() -> dict:
    """Blocked against the path it replaces, per row count, on one thread (a worker may have more:
    the products split their column blocks among threads, the same for every path)."""
    import torch
    import torch.nn.functional as F

    from minipd.models import cpu_kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer_bytes = 4 * sum(n * k for n, k in SHAPES)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(-(-DECODE_BYTES // layer_bytes)) for n, k in SHAPES]
        blocked = [torch.ops.minipd.blocked_weight(w) for w in weights]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1024) for w in weights]
        small_rows, onednn_rows = cpu_kernels.SMALL_LINEAR_MAX_ROWS, cpu_kernels.onednn_max_rows()

        def other(x, i):
            if x.shape[0] <= small_rows:
                return torch.ops.minipd.small_linear(x, weights[i], None)
            if x.shape[0] <= onednn_rows:
                return torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
            return F.linear(x, weights[i])

        speedups, times = {}, {}
        for rows in DECODE_ROWS + MIDDLE_ROWS + PREFILL_ROWS:
            layers = len(SHAPES) if rows in PREFILL_ROWS else len(weights)  # a prefill's products: one layer
            xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}

            def run(fn) -> float:
                start = time.perf_counter()
                for i in range(layers):
                    fn(xs[weights[i].shape[1]], i)
                return time.perf_counter() - start

            def with_blocks(x, i):
                return torch.ops.minipd.blocked_linear(x, blocked[i], None)

            best = {"blocked": math.inf, "other": math.inf}
            for _ in range(PASSES):
                best["blocked"] = min(best["blocked"], run(with_blocks))
                best["other"] = min(best["other"], run(other))
            speedups[rows] = round(best["other"] / best["blocked"], 3)  # kept as decided
            times[rows] = {name: round(t * 1e3, 3) for name, t in best.items()}
    finally:
        torch.set_num_threads(threads)
    rows = decide(speedups)
    return {
        "isa": cpu_kernels.kernel_isa(),
        "use": rows > 0,
        "rows": None if rows == sys.maxsize else rows,  # null: every product
        "speedup": {str(r): s for r, s in speedups.items()},
        "ms": {str(r): t for r, t in times.items()},
        "other": f"small_linear to {small_rows} rows, oneDNN prepacked to {min(onednn_rows, 10**9)}, then MKL",
        "rule": f"decode (rows {DECODE_ROWS}) geometric mean >= {DECODE_GAIN}; then every product if prefill (rows "
        f"{PREFILL_ROWS}) each >= {PREFILL_SLACK}, else up to the rows past the decode's where each is >= 1.0",
    }


def summary(found: dict | None) -> str:
    if not found:
        return "not measured yet"
    if found.get("error"):
        return f"off (its measurement failed: {found['error']})"
    rates = ", ".join(f"{r} {'row' if r == '1' else 'rows'} {s:.2f}x" for r, s in found["speedup"].items())
    rows = rows_of(found)
    state = "in use for every product" if rows == sys.maxsize else f"in use up to {rows} rows" if rows else "off"
    return f"{state}; measured here, its speed over the other paths' (above 1x: faster): {rates}"
