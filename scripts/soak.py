"""Soak test: a bounded run of the real server on the default model, mixing normal traffic,
client aborts, bad input, a hostile client (cross-origin calls, a DNS-rebinding Host, huge
prompts, oversized bodies, unbounded lists), run-time mode switches, worker kills and stops.
At the end it reports requests sent, completed, errored (as expected, e.g. bad input), aborted by
the client, hung (no answer within --request-deadline), lost (a stream that ended without [DONE]
or an error event), hostile requests let through, worker restarts, KV blocks still in use once
the server is idle, processes and shared-memory segments left after it stopped, and the peak
memory (RSS) of the main process and of the workers, early and late in the run.
Target: 0 hung, 0 lost, 0 let through, 0 blocks, nothing left. Exits 1 if it is missed.

    python scripts/soak.py --minutes 30
"""

from __future__ import annotations

import argparse


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run traffic")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--users", type=int, default=6, help="concurrent simulated clients")
    ap.add_argument("--switch-every", type=float, default=20.0, help="seconds between mode switches")
    ap.add_argument("--kill-every", type=float, default=45.0, help="seconds between SIGKILLs of a random worker")
    ap.add_argument("--stop-every", type=float, default=240.0,
                    help="seconds between SIGSTOPs of a random worker (hung: the server must replace it)")
    ap.add_argument("--hostile-every", type=float, default=2.0, help="seconds between hostile requests")
    ap.add_argument("--request-deadline", type=float, default=180.0, help="a request unanswered this long is hung")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    return ap.parse_args()


async def soak(args) -> dict:
    import asyncio
    import json
    import os
    import random
    import signal
    import time

    import aiohttp

    from minipd.bench.server_process import ServerProcess

    rng = random.Random(args.seed)
    extra = ["--model", args.model] if args.model else []
    server = ServerProcess("--workers", str(args.workers), "--threads-per-worker", "1", "--log-level", "warning",
                           "--worker-timeout", "15", "--max-worker-restarts", "1000", *extra)  # fmt: skip
    # the chaos kills a worker every --kill-every seconds: more than the default restart budget
    # (5 in 10 minutes) allows, which would leave both workers dead for good and measure nothing
    counts = {k: 0 for k in ("sent", "completed", "errored", "aborted", "hung", "lost", "bad_input_refused",
                             "hostile_refused", "hostile_let_through", "mode_switches", "kills", "stops")}  # fmt: skip
    let_through: list[str] = []
    rss = Peaks()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain a KV cache.",
                 "List three prime numbers.", "Who wrote Hamlet?", "Name a colour.", "What is 2 + 2?",
                 "Summarise the plot of Romeo and Juliet in two sentences."]  # fmt: skip
    bad_bodies = [b"{not json", {"messages": []}, {"messages": [{"role": "user", "content": "x"}], "temperature": -3},
                  {"prompt": [10**9]}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7}]  # fmt: skip
    stop_at = time.monotonic() + args.minutes * 60

    async def chat(session, stream: bool, abort_after: int | None):
        body = {"messages": [{"role": "user", "content": rng.choice(questions)}], "max_tokens": rng.randint(8, 64),
                "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 9), "stream": stream}  # fmt: skip
        counts["sent"] += 1
        try:
            async with asyncio.timeout(args.request_deadline):
                async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        counts["errored"] += 1
                        counts[f"http_{resp.status}"] = counts.get(f"http_{resp.status}", 0) + 1
                        await asyncio.sleep(0.2)  # a client backs off (503 while a worker restarts)
                        return
                    if not stream:
                        data = await resp.json()
                        ok = data["choices"][0]["finish_reason"] in ("stop", "length")
                        counts["completed" if ok else "lost"] += 1
                        return
                    chunks, done, error = 0, False, False
                    async for line in resp.content:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b"data: "):
                            error |= b'"error"' in line[:20]
                            chunks += 1
                            if abort_after is not None and chunks >= abort_after:
                                counts["aborted"] += 1
                                return
                    counts["completed" if done and not error else "errored" if error else "lost"] += 1
        except TimeoutError:
            counts["hung"] += 1
        except aiohttp.ClientError:
            counts["lost"] += 1

    async def bad(session):
        body = rng.choice(bad_bodies)
        counts["sent"] += 1
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with session.post(server.url + "/v1/chat/completions", data=data,
                                headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
            payload = await resp.json(content_type=None)
            ok = 400 <= resp.status < 500 and "error" in payload
            counts["bad_input_refused" if ok else "lost"] += 1

    port = server.port
    huge = "lorem ipsum dolor sit amet " * 160_000  # 4.3 MB
    long_ = "the quick brown fox jumps over the lazy dog " * 8_000  # 350 kB: tokenized (off the loop), too long
    hostile_calls = [  # (name, method, path, body bytes, headers, statuses that mean "refused")
        ("cross-origin text/plain mode switch", "POST", "/admin/mode", b'{"mode": "chunked"}',
         {"Origin": "http://evil.example", "Content-Type": "text/plain"}, {403}),
        ("cross-origin JSON mode switch", "POST", "/admin/mode", b'{"mode": "chunked"}',
         {"Origin": "http://evil.example", "Content-Type": "application/json"}, {403}),
        ("cross-origin completion", "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
         {"Origin": "http://evil.example", "Content-Type": "application/json"}, {403}),
        ("DNS rebinding", "GET", "/admin/workers", None, {"Host": f"evil.example:{port}"}, {403}),
        ("DNS rebinding switch", "POST", "/admin/mode", b'{"mode": "chunked"}',
         {"Host": f"evil.example:{port}", "Content-Type": "application/json"}, {403}),
        ("text/plain body", "POST", "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, {415}),
        ("4 MB prompt", "POST", "/v1/completions", json.dumps({"prompt": huge}).encode(), None, {400}),
        ("4 MB chat message", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": huge}]}).encode(), None, {400}),
        ("350 kB prompt", "POST", "/v1/completions", json.dumps({"prompt": long_}).encode(), None, {400}),
        ("40 MB body", "POST", "/v1/completions", b'{"prompt": "' + b"x" * 40 * 2**20 + b'"}', None, {413}),
        ("100,000 stop strings", "POST", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["a"] * 100_000}).encode(),
         None, {400}),
        ("100,000 stop token ids", "POST", "/v1/completions",
         json.dumps({"prompt": "hi", "stop_token_ids": list(range(100_000))}).encode(), None, {400}),
        ("100,000 messages", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "x"}] * 100_000}).encode(), None, {400}),
        ("n=5", "POST", "/v1/completions", b'{"prompt": "hi", "n": 5}', None, {400}),
        ("logit_bias", "POST", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 100}}', None, {400}),
    ]  # fmt: skip

    async def hostile(session):
        while time.monotonic() < stop_at:
            await asyncio.sleep(args.hostile_every)
            name, method, path, data, headers, refused = rng.choice(hostile_calls)
            headers = {"Content-Type": "application/json", **(headers or {})}
            counts["sent"] += 1
            try:
                async with asyncio.timeout(args.request_deadline):
                    async with session.request(method, server.url + path, data=data, headers=headers) as resp:
                        payload = await resp.json(content_type=None)
                        ok = resp.status in refused and "error" in payload
            except TimeoutError:
                counts["hung"] += 1
                continue
            except (aiohttp.ClientError, ValueError):
                ok = False
            counts["hostile_refused" if ok else "hostile_let_through"] += 1
            if not ok:
                let_through.append(name)

    async def sample_memory(session):
        while time.monotonic() < stop_at:
            try:
                async with session.get(server.url + "/admin/workers") as resp:
                    pids = [w["pid"] for w in (await resp.json())["workers"] if w["pid"]]
            except aiohttp.ClientError:
                pids = []
            late = time.monotonic() > (started + stop_at) / 2
            rss.add("main", late, rss_mib(server.proc.pid))
            for pid in pids:
                rss.add("worker", late, rss_mib(pid))
            await asyncio.sleep(2)

    async def user(session):
        while time.monotonic() < stop_at:
            r = rng.random()
            if r < 0.6:
                await chat(session, stream=True, abort_after=None)
            elif r < 0.75:
                await chat(session, stream=False, abort_after=None)
            elif r < 0.9:
                await chat(session, stream=True, abort_after=rng.randint(1, 10))
            else:
                await bad(session)

    async def chaos(session):
        modes = [{"mode": "colocated"}, {"mode": "chunked", "chunk_tokens": 64},
                 {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}]  # fmt: skip
        next_switch, next_kill = time.monotonic() + args.switch_every, time.monotonic() + args.kill_every
        next_stop = time.monotonic() + args.stop_every
        while time.monotonic() < stop_at:
            await asyncio.sleep(1)
            now = time.monotonic()
            if now > next_stop:
                next_stop = now + args.stop_every
                async with session.get(server.url + "/admin/workers") as resp:
                    workers = [w for w in (await resp.json())["workers"] if w["alive"]]
                if workers:
                    os.kill(rng.choice(workers)["pid"], signal.SIGSTOP)  # alive but frozen: the server kills it
                    counts["stops"] += 1
            if now > next_switch:
                next_switch = now + args.switch_every
                async with session.post(server.url + "/admin/mode", json=rng.choice(modes)) as resp:
                    counts["mode_switches"] += resp.status == 200
            if now > next_kill:
                next_kill = now + args.kill_every
                async with session.get(server.url + "/admin/workers") as resp:
                    workers = [w for w in (await resp.json())["workers"] if w["alive"]]
                if workers:
                    os.kill(rng.choice(workers)["pid"], signal.SIGKILL)
                    counts["kills"] += 1

    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(chaos(session), hostile(session), sample_memory(session),
                                 *(user(session) for _ in range(args.users)))  # fmt: skip
            idle_by = time.monotonic() + 120
            while True:
                async with session.get(server.url + "/admin/workers") as resp:
                    workers = (await resp.json())["workers"]
                async with session.get(server.url + "/health") as resp:
                    health = (await resp.json())["status"]
                if (health == "ok" and all(w["kv_blocks_used"] == 0 and not w["handoffs"] for w in workers)) \
                        or time.monotonic() > idle_by:  # fmt: skip
                    break
                await asyncio.sleep(0.5)
    finally:
        server.stop()
    processes_left, segments_left = server.leftovers()
    return {**counts, "let_through": sorted(set(let_through)), "minutes": (time.monotonic() - started) / 60,
            "health_at_end": health, "restarts": sum(w["restarts"] for w in workers),
            "kv_blocks_in_use": sum(w["kv_blocks_used"] for w in workers),
            "integrity_errors": [w["integrity_error"] for w in workers if w["integrity_error"]],
            "processes_left": processes_left, "segments_left": segments_left, **rss.report()}  # fmt: skip


class Peaks:
    """Peak RSS per kind of process, in the first and the second half of the run."""

    def __init__(self):
        self.peaks: dict[str, float] = {}

    def add(self, kind: str, late: bool, mib: float | None) -> None:
        if mib is not None:
            key = f"peak_rss_mib_{kind}_{'late' if late else 'early'}"
            self.peaks[key] = max(self.peaks.get(key, 0.0), mib)

    def report(self) -> dict:
        return dict(sorted(self.peaks.items()))


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def main() -> int:
    args = parse_args()
    import asyncio
    import json

    report = asyncio.run(soak(args))
    for k, v in report.items():
        print(f"{k:>20}: {v if not isinstance(v, float) else round(v, 1)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    ok = (report["hung"] == 0 and report["lost"] == 0 and report["hostile_let_through"] == 0
          and report["kv_blocks_in_use"] == 0 and not report["integrity_errors"]
          and report["processes_left"] == [] and report["segments_left"] == [])  # fmt: skip
    print("target met: 0 hung, 0 lost, 0 let through, 0 blocks in use, nothing left" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
