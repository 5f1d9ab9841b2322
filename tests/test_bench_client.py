"""run_load against a small OpenAI-compatible stand-in server (aiohttp, in-process, on a free port).

The stand-in picks its behaviour from the prompt length, since the prompts are random ids.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from aiohttp import web

from minipd.bench.client import completions_url, run_load
from minipd.bench.metrics import summarize
from minipd.bench.workloads import BenchRequest, prompt_token_ids

TTFT = 0.05
ITL = 0.02
HTTP_500, SSE_ERROR, NO_DONE, MULTI_TOKEN, NO_TIMELINE = 13, 17, 19, 23, 11  # prompt lengths


class StandIn:
    def __init__(self):
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        n_prompt, n = len(body["prompt"]), body["max_tokens"]
        if n_prompt == HTTP_500:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

            await asyncio.sleep(TTFT)
            chunks = 2 if n_prompt == MULTI_TOKEN else n
            for i in range(chunks):
                if i:
                    await asyncio.sleep(ITL)
                if n_prompt == SSE_ERROR and i == 2:
                    await send({"error": {"message": "worker died", "type": "server_error", "code": 500}})
                    await send(b"[DONE]")
                    return resp
                if n_prompt == NO_DONE and i == 2:
                    return resp
                await send({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]})
            usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n}}
            if n_prompt != NO_TIMELINE:
                usage["timeline"] = {"kv_transfer": {"bytes": 1000, "seconds": 0.01, "gbps": 0.0008}}
            await send(usage)
            await send(b"[DONE]")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away (the cancellation test)
        finally:
            self.in_flight -= 1
        return resp


async def serve(standin: StandIn) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", standin.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def req(index, prompt_len, output_len, arrival=0.0):
    return BenchRequest(index=index, prompt_len=prompt_len, output_len=output_len, arrival=arrival)


def test_completions_url():
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"


@pytest.mark.asyncio
async def test_tokens_timings_errors_and_payload():
    reqs = [req(0, 10, 5), req(1, NO_TIMELINE, 4), req(2, HTTP_500, 4), req(3, SSE_ERROR, 6),
            req(4, NO_DONE, 6), req(5, MULTI_TOKEN, 6)]  # fmt: skip
    standin = StandIn()

    t0 = time.time()
    runner, url = await serve(standin)
    try:
        recs = await run_load(url, "m", reqs, api_key="k", progress=False, seed=5)
    finally:
        await runner.cleanup()
    assert [r.index for r in recs] == list(range(6))
    ok, no_tl, http500, sse, no_done, multi = recs

    assert ok.ok and ok.output_tokens == 5 and len(ok.token_times) == 5
    assert TTFT <= ok.ttft < TTFT + 0.25
    assert all(ITL * 0.5 <= g < ITL + 0.15 for g in ok.itls)
    assert ok.tpot == pytest.approx(ITL, abs=0.03)
    assert ok.server_timeline["kv_transfer"]["seconds"] == 0.01
    assert t0 <= ok.send_time <= ok.token_times[0] <= ok.end_time

    assert no_tl.ok and no_tl.output_tokens == 4 and no_tl.server_timeline is None
    assert http500.error.startswith("HTTP 500") and http500.output_tokens == 0 and http500.ttft is None
    assert sse.error == "worker died" and sse.output_tokens == 2
    assert no_done.error == "stream ended without [DONE]" and no_done.output_tokens == 2
    assert multi.ok and len(multi.token_times) == 2 and multi.output_tokens == 6

    by_len = {len(b["prompt"]): b for b in standin.bodies}
    body = by_len[10]
    assert body["prompt"] == prompt_token_ids(reqs[0], 5)
    assert body["max_tokens"] == 5 and body["temperature"] == 0 and body["model"] == "m"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert set(standin.auth) == {"Bearer k"}

    s = summarize(recs, duration=1.0)
    assert (s["completed"], s["failed"]) == (3, 3)
    assert s["kv_transfer_count"] == 2


@pytest.mark.asyncio
async def test_arrival_times_and_max_concurrency():
    standin = StandIn()

    async def main(reqs, **kw):
        runner, url = await serve(standin)
        try:
            return await run_load(url, "m", reqs, progress=False, **kw)
        finally:
            await runner.cleanup()

    recs = await main([req(0, 10, 2, 0.0), req(1, 10, 2, 0.3), req(2, 10, 2, 0.6)])
    offsets = [r.send_time - recs[0].send_time for r in recs]
    assert offsets == pytest.approx([0.0, 0.3, 0.6], abs=0.08)

    standin.max_in_flight = 0
    recs = await main([req(i, 10, 3) for i in range(4)], max_concurrency=1)
    assert all(r.ok for r in recs) and standin.max_in_flight == 1
    order = sorted(recs, key=lambda r: r.send_time)
    assert all(b.send_time >= a.end_time - 0.01 for a, b in zip(order, order[1:]))


@pytest.mark.asyncio
async def test_connection_error_is_recorded():
    runner, url = await serve(StandIn())
    await runner.cleanup()  # nothing listens there any more
    (r,) = await run_load(url, "m", [req(0, 10, 3)], progress=False, timeout=5)
    assert not r.ok and r.error and r.output_tokens == 0


@pytest.mark.asyncio
async def test_cancellation_returns_partial_records():
    standin = StandIn()
    reqs = [req(0, 10, 2), req(1, 10, 2), req(2, 10, 100), req(3, 10, 2, arrival=30.0)]

    t0 = time.time()
    runner, url = await serve(standin)
    try:
        task = asyncio.ensure_future(run_load(url, "m", reqs, progress=False))
        await asyncio.sleep(0.5)
        task.cancel()
        recs = await task
    finally:
        await runner.cleanup()
    assert time.time() - t0 < 5
    assert [r.index for r in recs] == [0, 1, 2]  # request 3 was never sent
    assert recs[0].ok and recs[1].ok and recs[0].output_tokens == 2
    slow = recs[2]
    assert slow.error == "cancelled"
    assert 3 <= len(slow.token_times) < 100 and slow.output_tokens == len(slow.token_times)
    assert slow.end_time is not None


def test_ctrl_c_during_a_run_ends_the_bench_with_what_the_run_measured():
    """Defect: Ctrl-C during a bench cancelled the run under way, whose requests in flight were
    recorded as failed, and the bench went on to the next mode or rate (one Ctrl-C per run left):
    run_load returns its records when cancelled, so asyncio.run saw the run end normally and never
    raised KeyboardInterrupt. A Ctrl-C must end the bench, with the run marked interrupted."""
    import os
    import signal
    import threading

    from minipd.bench import experiment as ex
    from minipd.bench.target import Target

    standin, ready, box = StandIn(), threading.Event(), {}
    loop = asyncio.new_event_loop()

    def serve_in_thread() -> None:
        box["runner"], box["url"] = loop.run_until_complete(serve(standin))
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve_in_thread, daemon=True).start()
    assert ready.wait(10)
    s = ex.Settings(num_prompts=3, duration=None, burstiness=1.0, seed=0, quick=True, input_len=10, output_len=100,
                    max_concurrency=None, slo_ttft_ms=None, slo_tpot_ms=None, progress=False)  # fmt: skip
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # each reply takes ~2 s
    try:
        timer.start()
        t0 = time.time()
        with pytest.raises(ex.Interrupted) as stopped:
            ex.run_once(Target(box["url"], "m"), "fixed", "stand-in", {}, math.inf, s)
        assert time.time() - t0 < 5
    finally:
        timer.cancel()
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    run = stopped.value.run
    assert run["interrupted"] and len(run["records"]) == 3
    assert all(r.error == "cancelled" and 0 < r.output_tokens < 100 for r in run["records"])
