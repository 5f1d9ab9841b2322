"""The interference stall, measured: a few replies are streaming when a long prompt arrives.

For each mode on one server (switched at run time, same workers and weights), prints the
streams' median inter-token latency, their worst gap while the long prompt was being prefilled
(the stall), and the long prompt's TTFT.

    python scripts/bench_stall.py --long-prompt 1500 --streams 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import openai

from minipd.bench.server_process import ServerProcess

MODES = [{"mode": "colocated"}, {"mode": "chunked", "chunk_tokens": 64},
         {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}]  # fmt: skip


async def one_round(server: ServerProcess, streams: int, long_prompt: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    started = asyncio.Event()
    counts = [0] * streams

    async def stream(i):
        s = await client.completions.create(model=server_model(server), prompt=f"Story number {i}:",
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        rid = None
        async for chunk in s:
            rid = chunk.id
            counts[i] += 1
            if min(counts) >= 8:
                started.set()
        return rid

    async def long_one():
        await started.wait()
        out = await client.completions.create(model=server_model(server), prompt=[100 + i % 5000 for i in range(long_prompt)],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        return out.id

    try:
        ids = await asyncio.gather(*(stream(i) for i in range(streams)), long_one())
    finally:
        await client.close()
    lines = [server.get(f"/v1/requests/{rid}/timeline")[1] for rid in ids]
    long_t = lines[-1]
    window = (long_t["events"]["prefill_start"], long_t["events"]["prefill_end"])
    gaps, stall = [], 0.0
    for t in lines[:-1]:
        times = t["token_times"]
        for a, b in zip(times, times[1:]):
            gaps.append(b - a)
            if b >= window[0] and a <= window[1]:
                stall = max(stall, b - a)
    return {"median_itl": statistics.median(gaps), "stall": stall, "long_ttft": long_t["ttft"],
            "long_prefill": window[1] - window[0]}  # fmt: skip


def server_model(server: ServerProcess) -> str:
    return server.get("/v1/models")[1]["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--long-prompt", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []
    server = ServerProcess("--workers", "2", "--threads-per-worker", "1", "--log-level", "warning", *extra)
    try:
        print(f"{args.streams} streams decoding; a {args.long_prompt}-token prompt arrives")
        print(f"{'mode':<12}{'median ITL ms':>15}{'stall ms':>10}{'stall/ITL':>11}{'long TTFT ms':>14}")
        for mode in MODES:
            status, body = server.post("/admin/mode", mode)
            assert status == 200, body
            r = asyncio.run(one_round(server, args.streams, args.long_prompt, args.max_tokens))
            print(f"{mode['mode']:<12}{r['median_itl'] * 1e3:>15.1f}{r['stall'] * 1e3:>10.1f}"
                  f"{r['stall'] / r['median_itl']:>11.1f}{r['long_ttft'] * 1e3:>14.0f}")  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    main()
