"""The garbage collector's stalls, side by side: the same streams against a server whose processes
freeze their startup heap (minipd/heap.py, the default) and one that leaves the collector as Python
sets it (MINIPD_GC_FREEZE=0). Prints per run the streams' largest inter-token gap, their p99 gap,
the wall time and the workers' longest full collection, then the ratios. Runs alternate (a, b, a, b)
so drift on a noisy machine falls on both.

    python scripts/bench_gc_freeze.py [--model tiny-random] [--streams 12] [--tokens 1500] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import aiohttp  # noqa: E402

from minipd.bench.metrics import percentile  # noqa: E402
from minipd.bench.server_process import ServerProcess  # noqa: E402


async def stream_all(url: str, model: str, streams: int, tokens: int, gap_s: float) -> list[list[float]]:
    async def one(session, i):
        body = {"model": model, "prompt": f"story {i}: " + "once upon a time " * 12, "max_tokens": tokens,
                "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
        times = []
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
        return times

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        tasks = []
        for i in range(streams):
            tasks.append(asyncio.create_task(one(session, i)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*tasks)


def one_run(args, freeze: bool) -> dict:
    env = {"MINIPD_GC_FREEZE": "1" if freeze else "0"}
    with_args = ["--model", args.model, "--workers", "2", "--threads-per-worker", "1"]
    server = ServerProcess(*with_args, env=env)
    try:
        name = server.get("/v1/models")[1]["data"][0]["id"]
        started = time.perf_counter()
        got = asyncio.run(stream_all(server.url, name, args.streams, args.tokens, args.gap))
        wall = time.perf_counter() - started
        workers = server.get("/admin/workers")[1]["workers"]
    finally:
        server.stop()
    gaps = [b - a for t in got for a, b in zip(t, t[1:])]
    return {"freeze": freeze, "wall_s": wall, "max_gap_ms": 1000 * max(gaps), "p99_gap_ms": 1000 * percentile(gaps, 99),
            "median_gap_ms": 1000 * statistics.median(gaps),
            "worker_longest_full_gc_ms": max(1000 * (w["gc"] or {}).get("longest_full_seconds", 0) for w in workers),
            "worker_full_gcs": sum((w["gc"] or {}).get("full_collections", 0) for w in workers)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between the streams' starts")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch

    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; model {args.model}, "
          f"2 workers, {args.streams} streams of {args.tokens} tokens")  # fmt: skip
    rows = []
    for _ in range(args.repeats):
        for freeze in (True, False):
            r = one_run(args, freeze)
            rows.append(r)
            print(f"  gc freeze {'on ' if freeze else 'off'}: wall {r['wall_s']:6.2f} s, gap max {r['max_gap_ms']:6.1f} ms, "
                  f"p99 {r['p99_gap_ms']:5.1f} ms, median {r['median_gap_ms']:4.2f} ms; workers' longest full "
                  f"collection {r['worker_longest_full_gc_ms']:5.1f} ms ({r['worker_full_gcs']} full)", flush=True)  # fmt: skip

    def med(key, freeze):
        return statistics.median(r[key] for r in rows if r["freeze"] == freeze)

    for key in ("max_gap_ms", "p99_gap_ms", "wall_s"):
        print(f"{key}: off / on = {med(key, False) / med(key, True):.2f}x (medians {med(key, False):.1f} / "
              f"{med(key, True):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
