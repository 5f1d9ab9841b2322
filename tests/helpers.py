"""Shared test helpers: run requests through an engine with staggered arrivals."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager

from minipd.bench.server_process import ServerProcess
from minipd.engine.engine import Engine
from minipd.sampling_params import SamplingParams


def run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams, join_every: int = 3,
                  check=None) -> list[list[int]]:  # fmt: skip
    """Add one prompt every `join_every` steps, so later ones join while earlier ones decode."""
    outputs = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if check:
            check(engine)
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


def run_disaggregated(prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Prefill every prompt on one engine, hand each KV into a seat on the other, decode there."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params)
    while prefill.has_unfinished() or decode.has_unfinished():
        for out in prefill.step():
            outputs[out.request_id] += out.new_token_ids
            if out.handoff:
                handoff = prefill.export_handoff(out.request_id)
                assert handoff.kv.shape[2] == len(prompts[int(out.request_id)])
                assert decode.add_seat(out.request_id, handoff.meta.num_computed_tokens)
                decode.import_handoff(handoff.meta, handoff.kv)
                prefill.release_handoff(out.request_id)
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


@contextmanager
def serving(*args: str, env: dict | None = None):
    """A real server for the block; afterwards no worker process and no shared memory may remain."""
    server = ServerProcess(*args, env=env)
    try:
        yield server
    finally:
        server.stop()
    assert server.leftovers() == ([], [])


def wait_for_idle_workers(server: ServerProcess, timeout: float) -> list[dict]:
    """Until every worker reports no KV blocks in use, no seat, no handoff and no request in
    flight; its block accounting must then check out."""
    deadline = time.monotonic() + timeout
    while True:
        workers = server.get("/admin/workers")[1]["workers"]
        if all(w["kv_blocks_used"] == 0 and w["inflight"] == 0 and not w["handoffs"] for w in workers):
            assert all(w["integrity_error"] is None for w in workers), workers
            return workers
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)


def wait_for_health(server: ServerProcess, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, body = server.get("/health")
        if isinstance(body, dict) and body.get("status") == status:
            return body
        assert time.monotonic() < deadline, (code, body)
        time.sleep(0.1)


async def stream_completions(url: str, prompts: list, max_tokens: int, on_token=None, **extra) -> list[dict]:
    """One streaming completion per prompt, all at once (greedy, ignore_eos). Each result has the
    request id, its text and token ids, and the error event's message if the stream ended with one."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(i, prompt):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True, **extra}  # fmt: skip
            out = {"id": None, "text": "", "token_ids": [], "error": None}
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    out["error"] = f"HTTP {resp.status}: {await resp.text()}"
                    return out
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        out["error"] = obj["error"]["message"]
                        continue
                    out["id"] = obj["id"]
                    out["text"] += obj["choices"][0]["text"]
                    out["token_ids"] += obj["choices"][0]["token_ids"]
                    if on_token is not None:
                        on_token(i)
            return out

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
