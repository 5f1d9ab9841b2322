"""The load generator: streams `/v1/completions` requests at their arrival times to any OpenAI-compatible server.

Each request sends token ids as the prompt, greedy, `ignore_eos` (vLLM's and minipd's extension; other
servers ignore it) so the reply has exactly `output_len` tokens, and asks for the usage chunk. The
client stamps every content chunk as it arrives (one token per chunk; if the usage reports more
completion tokens than chunks, the usage count is kept). minipd's `timeline` field in the usage chunk
is recorded when present.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from tqdm import tqdm

from minipd.bench.metrics import RequestRecord
from minipd.bench.workloads import BenchRequest, prompt_token_ids

T = TypeVar("T")


def run_interruptible(main: Callable[[], Awaitable[T]]) -> tuple[T | None, bool]:
    """asyncio.run(main()), where Ctrl-C cancels `main` and is reported: (what it returned, None if it
    ended cancelled; whether Ctrl-C came). asyncio.run alone turns Ctrl-C into KeyboardInterrupt only
    when its task ends cancelled, and run_load, cancelled, returns what it measured."""
    interrupted = False

    async def wrapper() -> T | None:
        nonlocal interrupted
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()

        installed = False

        def on_sigint() -> None:  # once: a second Ctrl-C, while the load winds down, raises KeyboardInterrupt
            nonlocal interrupted, installed
            interrupted, installed = True, False
            loop.remove_signal_handler(signal.SIGINT)
            task.cancel()

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # no signals here (Windows, not the main thread)
            pass
        try:
            result = await task
        except asyncio.CancelledError:
            if not interrupted:
                raise
            return None
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
        if cancelling is not None and cancelling():  # asyncio.run's own Ctrl-C, where ours was not installed
            interrupted = True
        return result

    result = asyncio.run(wrapper())
    return result, interrupted


def load_or_interrupt(url: str, model: str, requests: list[BenchRequest], **kwargs) -> list[RequestRecord]:
    """run_load in a loop of its own; Ctrl-C raises KeyboardInterrupt once the requests in flight are cancelled."""
    records, interrupted = run_interruptible(lambda: run_load(url, model, requests, **kwargs))
    if interrupted:
        raise KeyboardInterrupt
    return records


def completions_url(url: str, endpoint: str = "completions") -> str:
    base = url.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    return f"{base}/v1/{endpoint.lstrip('/')}"


def _error_message(obj: dict) -> str:
    err = obj.get("error")
    return str(err.get("message") or err) if isinstance(err, dict) else str(err)


async def _stream_one(
    session: aiohttp.ClientSession, url: str, payload: dict, headers: dict, rec: RequestRecord
) -> None:
    """Send one request and fill `rec` from its SSE stream; every failure ends up in `rec.error`."""
    chunks, usage_tokens, done = 0, 0, False
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                rec.error = f"HTTP {resp.status}: {body}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                now = time.time()
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(body)
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj:
                        rec.error = _error_message(obj)
                        return
                    choices = obj.get("choices") or []
                    if choices and choices[0].get("text"):
                        rec.token_times.append(now)
                        chunks += 1
                    if obj.get("usage"):
                        usage_tokens = int(obj["usage"].get("completion_tokens") or 0)
                        if obj.get("timeline") is not None:
                            rec.server_timeline = obj["timeline"]
                if done:
                    break
            if not done:
                rec.error = "stream ended without [DONE]"
    except Exception as e:  # a load generator records what went wrong and goes on
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        rec.output_tokens = max(chunks, usage_tokens)
        rec.end_time = time.time()


async def run_load(
    url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    endpoint: str = "completions",
    progress: bool = True,
    ignore_eos: bool = True,
    timeout: float = 600.0,
    seed: int = 0,
    vocab_size: int = 49152,
) -> list[RequestRecord]:
    """Send `requests` at their arrival times and return one record per request sent, by index.

    `url` is the server's base URL (with or without /v1); `endpoint` the path under /v1/.
    `max_concurrency` caps the requests in flight (a request waits for a slot before it is sent, as in
    vLLM). `timeout` bounds each request. Prompts are `prompt_token_ids(req, seed, vocab_size)`.

    When cancelled, the requests in flight are cancelled and marked with error "cancelled", and the
    records so far are returned instead of raising; requests not yet sent have no record. Under plain
    asyncio.run a Ctrl-C then looks like a load that ended: run it under run_interruptible.
    """
    target = completions_url(url, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    loop = asyncio.get_running_loop()
    start = loop.time()
    conn = aiohttp.TCPConnector(limit=max_concurrency or 0)
    session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout))

    async def one(req: BenchRequest) -> None:
        delay = start + req.arrival - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        payload = {
            "model": model,
            "prompt": prompt_token_ids(req, seed, vocab_size),
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            payload["ignore_eos"] = True
        if sem is not None:
            await sem.acquire()
        try:
            rec = RequestRecord(req.index, req.prompt_len, req.output_len, send_time=time.time())
            records.append(rec)
            try:
                await _stream_one(session, target, payload, headers, rec)
            except asyncio.CancelledError:
                rec.error = "cancelled"
                raise
        finally:
            if sem is not None:
                sem.release()
            bar.update(1)

    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        bar.close()
        await session.close()
    return sorted(records, key=lambda r: r.index)
