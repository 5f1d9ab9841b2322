"""What one worker's decode step costs when the box's other worker decodes at the same time:
a real server (colocated, 2 workers of 1 thread), replies of short prompts decoding alone on one
worker (`workers: 1`) and then as many again on each of the two, side by side in one run, by batch.
Prints the gaps between a reply's tokens (p50/p90, its first 20 and last 5 left out) and the ratio.

    python scripts/bench_corun.py                      # default model, batches 1,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from minipd.cli_help import listed, positive_int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=listed(positive_int), default="1,4,8", help="replies per worker")
    ap.add_argument("--tokens", type=positive_int, default=160, help="tokens per reply")
    args = ap.parse_args()
    import aiohttp

    from minipd.bench.server_process import ServerProcess

    server = ServerProcess(*(["--model", args.model] if args.model else []), "--workers", "2",
                           "--threads-per-worker", "1", "--log-level", "warning")  # fmt: skip

    async def gaps(n: int) -> tuple[float, float, list[int]]:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> tuple[int, list[float]]:
                body = {"prompt": [100 + i, 200 + i, 300 + i] * 10, "max_tokens": args.tokens, "ignore_eos": True,
                        "temperature": 0}  # fmt: skip
                async with session.post(server.url + "/v1/completions", json=body) as resp:
                    rid = (await resp.json())["id"]
                async with session.get(server.url + f"/v1/requests/{rid}/timeline") as resp:
                    timeline = await resp.json()
                times = timeline["token_times"][20:-5]
                return timeline["decode_worker"], [b - a for a, b in zip(times, times[1:])]

            replies = await asyncio.gather(*(one(i) for i in range(n)))
        every = sorted(g for _, got in replies for g in got)
        split = [sum(w == i for w, _ in replies) for i in (0, 1)]
        return statistics.median(every) * 1e3, every[int(0.9 * len(every))] * 1e3, split

    try:
        for batch in map(int, args.batches.split(",")):
            server.post("/admin/mode", {"mode": "colocated", "workers": 1})
            alone = asyncio.run(gaps(batch))
            server.post("/admin/mode", {"mode": "colocated", "workers": None})  # all (omitted, it would stay 1)
            both = asyncio.run(gaps(2 * batch))
            print(f"batch {batch}: one worker decoding {alone[0]:.1f} / {alone[1]:.1f} ms, both workers "
                  f"{both[0]:.1f} / {both[1]:.1f} ms (p50 / p90): {both[0] / alone[0]:.2f}x, "
                  f"+{both[0] - alone[0]:.1f} ms a step (replies per worker: {both[2][0]} and {both[2][1]})",
                  flush=True)  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    main()
