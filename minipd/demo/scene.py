"""One scene of the demo, against a running minipd server: a few chat replies are streaming when a
long document arrives. Every token is timed where the client receives it; the server's events
(engine steps, KV transfers, seats) are recorded next to them."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

STORY_PROMPTS = [
    "Tell me a long story about a lighthouse keeper and a storm.",
    "Describe, step by step, how bread is baked, in detail.",
    "Write a long letter from a sailor to his family at home.",
    "Explain how a steam engine works, with many details.",
    "Tell a long story about a fox who learns to read.",
    "Describe a walk through a busy market in a big city.",
]
DOCUMENT = (
    "The history of the harbour town begins with a handful of fishing families who settled on the "
    "sheltered side of the bay. Over the centuries the town grew into a trading port: merchants built "
    "warehouses along the quay, shipwrights opened yards on the eastern shore, and a stone lighthouse "
    "was raised on the rocks at the mouth of the bay to guide ships through the narrow channel. "
)


@dataclass(slots=True)
class Stream:
    name: str
    sent: float = 0.0
    request_id: str | None = None
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # client arrival time of each token
    timeline: dict | None = None  # the server's, from the final usage chunk
    error: str | None = None
    done: bool = False


@dataclass(slots=True)
class Scene:
    mode: dict
    run: int
    streams: list[Stream]
    long: Stream
    long_prompt_tokens: int = 0
    events: list[dict] = field(default_factory=list)  # /admin/events while the scene played
    started: float = 0.0
    ended: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def long_document(tokenizer, num_tokens: int) -> str:
    """About num_tokens tokens of document (the default model's tokenizer counts them)."""
    if tokenizer is None:
        return DOCUMENT * max(1, num_tokens // 60)
    copies = max(1, num_tokens // len(tokenizer.encode(DOCUMENT)))  # then counted whole: a few tries, not one per copy
    while len(tokenizer.encode(DOCUMENT * copies)) < num_tokens:
        copies += 1
    return DOCUMENT * copies


async def play(url: str, mode: dict, run: int, *, streams: int, stream_tokens: int, document: str,
               headers: dict | None = None, on_change=None) -> Scene:  # fmt: skip
    """Switch to `mode`, start the streams, and once each has a few tokens send the document."""
    headers = headers or {}
    scene = Scene(mode, run, [Stream(f"reply {i + 1}") for i in range(streams)], Stream("long document"))
    notify = on_change or (lambda scene: None)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(url + "/admin/mode", json=mode) as resp:
            if resp.status != 200:
                raise RuntimeError(f"switching to {mode} failed: {await resp.text()}")
        scene.started = time.time()
        events = asyncio.ensure_future(_record_events(session, url, scene, notify))
        try:
            replies = [asyncio.ensure_future(_chat(session, url, s, STORY_PROMPTS[i % len(STORY_PROMPTS)],
                                                   stream_tokens, notify, scene))  # fmt: skip
                       for i, s in enumerate(scene.streams)]
            while min(len(s.token_times) for s in scene.streams) < 8:
                if any(r.done() for r in replies):
                    break
                await asyncio.sleep(0.01)
            question = "Summarise this document in one sentence.\n\n" + document
            await asyncio.gather(*replies, _chat(session, url, scene.long, question, 8, notify, scene))
            await asyncio.sleep(0.3)  # the last events
        finally:
            events.cancel()
        scene.ended = time.time()
    timeline = scene.long.timeline or {}
    scene.long_prompt_tokens = timeline.get("prompt_tokens", 0)
    return scene


async def _chat(session, url: str, stream: Stream, prompt: str, max_tokens: int, notify, scene: Scene) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    stream.sent = time.time()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            stream.error = await resp.text()
            stream.done = True
            return
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.time()
            obj = json.loads(line[6:])
            if "error" in obj:
                stream.error = obj["error"]["message"]
                continue
            stream.request_id = obj["id"]
            if obj.get("usage"):
                stream.timeline = obj.get("timeline")
            for choice in obj["choices"]:
                content = choice["delta"].get("content")
                if content is None or (content == "" and choice["delta"].get("role")):
                    continue
                stream.text += content
                stream.token_times.append(now)
                notify(scene)
    stream.done = True
    notify(scene)


async def _record_events(session, url: str, scene: Scene, notify) -> None:
    async with session.get(url + "/admin/events", params={"since": str(scene.started)}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                scene.events.append(json.loads(line[6:]))
                notify(scene)
