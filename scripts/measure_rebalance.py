"""What rebalancing between decoding workers buys, measured on a real server, off and on in one run.

The case it is for: a worker that comes back empty (drained, or restarted for a new setting) while
the others hold every running reply. Worker 1 is drained, N replies start (all on worker 0), and
once each has its first tokens worker 1 is resumed. Without rebalancing the replies finish on
worker 0 at its batch's pace; with `--rebalance-ratio` half of them move to worker 1 at a token
boundary. Per setting: the replies' inter-token latency after the resume (median, p90), the time
from the resume to the last token, and what moved. Two servers, one after the other, same prompts.

    python scripts/measure_rebalance.py [--model tiny-random] [--replies 8] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

from minipd.bench.server_process import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 3


async def stream(session, url, model, i, times: list[float], ids: list, max_tokens: int):
    body = {"model": model, "prompt": f"{i}. {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                ids[i] = obj["id"]
                times.append(time.time())


async def crowd_then_resume(server, model, replies, max_tokens, after_tokens=3) -> dict:
    status, _ = server.post("/admin/workers/1/drain", {})
    assert status == 200
    times = [[] for _ in range(replies)]
    ids = [None] * replies
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        tasks = [asyncio.ensure_future(stream(session, server.url, model, i, times[i], ids, max_tokens))
                 for i in range(replies)]  # fmt: skip
        while min(len(t) for t in times) < after_tokens:
            await asyncio.sleep(0.005)
        resumed = time.time()
        status, _ = await asyncio.get_running_loop().run_in_executor(None, server.post, "/admin/workers/1/resume", {})
        assert status == 200
        await asyncio.gather(*tasks)
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]) if a >= resumed)
    timelines = [server.get(f"/v1/requests/{i}/timeline")[1] for i in ids]
    moves = [mv for t in timelines for mv in t["moves"] if mv["reason"] == "rebalance"]
    moved = [mv for mv in moves if mv["outcome"] == "moved"]
    return {"itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p90_ms": 1e3 * gaps[int(0.9 * len(gaps))],
            "to_last_token_s": max(t[-1] for t in times) - resumed, "moved": len(moved),
            "move_mb": sum(mv["bytes"] for mv in moved) / 1e6,
            "slowest_move_ms": 1e3 * max((mv["seconds"] or 0.0 for mv in moved), default=0.0),
            "redone": sum(len(t["redos"]) for t in timelines)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--replies", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ratio", type=float, default=1.5, help="--rebalance-ratio of the second server")
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []
    rows = {}
    for label, flags in (("off", []), (f"on (ratio {args.ratio:g})", ["--rebalance-ratio", str(args.ratio)])):
        server = ServerProcess("--workers", "2", "--threads-per-worker", "1", "--log-level", "warning", *extra, *flags)
        try:
            model = server.get("/v1/models")[1]["data"][0]["id"]
            asyncio.run(crowd_then_resume(server, model, 2, 8))  # warm
            rows[label] = asyncio.run(crowd_then_resume(server, model, args.replies, args.max_tokens))
        finally:
            server.stop()
        print(label, json.dumps(rows[label]), flush=True)
    off, on = rows["off"], rows[next(k for k in rows if k != "off")]
    print(f"\n{args.replies} replies of {args.max_tokens} tokens on worker 0; worker 1 resumed after their first tokens")
    print(f"{'rebalancing':18s} {'ITL p50 ms':>10s} {'ITL p90 ms':>10s} {'to last token s':>16s} {'moved':>6s} "
          f"{'MB':>6s} {'slowest move ms':>16s}")  # fmt: skip
    for label, r in rows.items():
        print(f"{label:18s} {r['itl_p50_ms']:10.1f} {r['itl_p90_ms']:10.1f} {r['to_last_token_s']:16.2f} "
              f"{r['moved']:6d} {r['move_mb']:6.1f} {r['slowest_move_ms']:16.1f}")  # fmt: skip
    print(f"on / off: ITL p50 {on['itl_p50_ms'] / off['itl_p50_ms']:.2f}x, time to the last token "
          f"{on['to_last_token_s'] / off['to_last_token_s']:.2f}x")


if __name__ == "__main__":
    main()
