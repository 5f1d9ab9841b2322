"""The acceptance run on the default model: 8 concurrent streaming chats through the `openai`
client give identical text in every mode, across run-time switches, and equal the offline API."""

import asyncio

import openai
import pytest

from minipd import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.helpers import serving

pytestmark = pytest.mark.slow
QUESTIONS = CHAT_PROMPTS + ["Name a colour.", "What is 2 + 2?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline_texts():
    llm = LLM()
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))  # fmt: skip
    return [o.text for o in outs]


async def eight_streams(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

    async def one(q):
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": q}], stream=True,
            max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True})  # fmt: skip
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    try:
        return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_same_text_in_every_mode_and_across_switches(offline_texts):
    assert len(QUESTIONS) == 8
    with serving("--workers", "2", "--threads-per-worker", "1", "--mode", "colocated") as s:
        for mode in ({"mode": "colocated"}, {"mode": "chunked", "chunk_tokens": 16},
                     {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, {"mode": "colocated"}):  # fmt: skip
            status, got = s.post("/admin/mode", mode)
            assert status == 200 and got["mode"] == mode["mode"]
            assert await eight_streams(s.url) == offline_texts, mode
