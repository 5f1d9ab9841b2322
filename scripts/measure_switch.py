"""What a live mode switch costs the replies streaming through it, measured on a real server.

Starts `python -m minipd serve` (2 workers, the default model unless --model), streams N replies,
and once every stream has its first tokens switches colocated -> disagg 1P1D (the replies on the
worker that becomes the prefill worker move), then disagg -> colocated (nothing needs to move),
then, for comparison, colocated -> disagg with {"drain": true} (the call waits for the replies).
Per switch: how long POST /admin/mode took, what moved (count, bytes, slowest move), and for each
stream its longest gap between tokens across the switch against its own move's time (the target:
no stream pauses longer than twice its own move, plus one decode step if it did not move).

    python scripts/measure_switch.py [--model tiny-random] [--replies 8] [--transport shm|tcp]
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


async def one_switch(server, model, replies, body, max_tokens, after_tokens=5):
    times = [[] for _ in range(replies)]
    ids = [None] * replies
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        tasks = [asyncio.ensure_future(stream(session, server.url, model, i, times[i], ids, max_tokens))
                 for i in range(replies)]  # fmt: skip
        while min(len(t) for t in times) < after_tokens:
            await asyncio.sleep(0.005)
        sent = time.time()
        status, answer = await asyncio.get_running_loop().run_in_executor(None, server.post, "/admin/mode", body)
        answered = time.time()
        await asyncio.gather(*tasks)
    assert status == 200, answer
    rows = []
    for i in range(replies):
        timeline = server.get(f"/v1/requests/{ids[i]}/timeline")[1]
        moves = [m for m in timeline["moves"] if m["start"] >= sent - 1]
        gaps = [(b - a, a, b) for a, b in zip(times[i], times[i][1:]) if b >= sent and a <= answered]
        gap = max((g for g, _, _ in gaps), default=0.0)
        itl = statistics.median(b - a for a, b in zip(times[i], times[i][1:]))
        move_s = max((m["seconds"] or 0.0 for m in moves if m["outcome"] == "moved"), default=None)
        rows.append({"stream": i, "moved": move_s is not None, "move_s": move_s, "gap_s": gap, "median_itl_s": itl,
                     "bytes": sum(m["bytes"] for m in moves)})  # fmt: skip
    return {"body": body, "post_seconds": answered - sent, "switch": answer["switch"], "streams": rows}


def report(result: dict) -> str:
    s = result["switch"]
    lines = [f"switch {json.dumps(result['body'])}: POST answered in {result['post_seconds'] * 1e3:.0f} ms "
             f"(serving the new mode after {s.get('serving_after_seconds', 0) * 1e3:.0f} ms); moved {s.get('moved', 0)}"
             f" replies, {s.get('bytes', 0) / 1e6:.2f} MB, slowest move "
             f"{(s.get('slowest_move_seconds') or 0) * 1e3:.0f} ms",
             "  stream  moved  move (ms)  longest gap across the switch (ms)  its median ITL (ms)  gap / move"]  # fmt: skip
    for r in result["streams"]:
        ratio = f"{r['gap_s'] / r['move_s']:.2f}" if r["move_s"] else "-"
        move = f"{r['move_s'] * 1e3:9.1f}" if r["move_s"] else "        -"
        lines.append(f"  {r['stream']:6d}  {'yes' if r['moved'] else 'no':>5}  {move}  {r['gap_s'] * 1e3:34.1f}"
                     f"  {r['median_itl_s'] * 1e3:19.1f}  {ratio:>10}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the server's default model")
    ap.add_argument("--replies", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    args = ap.parse_args()
    extra = ("--model", args.model) if args.model else ()
    server = ServerProcess(*extra, "--workers", "2", "--kv-transport", args.transport)
    try:
        model = server.get("/v1/models")[1]["data"][0]["id"]
        import torch

        print(f"CPU: {torch.backends.cpu.get_cpu_capability()}; model {model}; 2 workers; {args.replies} replies "
              f"of {args.max_tokens} tokens streaming; transport {args.transport}")  # fmt: skip
        for body in ({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, {"mode": "colocated"},
                     {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1, "drain": True}):  # fmt: skip
            result = asyncio.run(one_switch(server, model, args.replies, body, args.max_tokens))
            print(report(result), flush=True)
        server.post("/admin/mode", {"mode": "colocated"})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
