"""The replies of one request (OpenAI's n choices, for each of its prompts): each is a request of
its own to the router; their deltas are read here as one sequence, in the order they come."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from minipd.sampling_params import SamplingParams
from minipd.server.request_state import Delta, RequestState


@dataclass(slots=True)
class Reply:
    """One HTTP request's choices, in OpenAI's order: choice index = prompt index * n + choice."""

    rid: str
    states: list[RequestState]
    chat: bool
    echoes: list[str | None]  # per choice: the text it starts with (echo: its prompt's; chat: the assistant's), or None
    token_text: Callable[[int], str]  # how logprobs name a token
    prompt_tokens: int  # the usage's: each prompt counted once, however many choices it has
    return_token_ids: bool = False  # vLLM's: the prompt's and the reply's token ids beside the text
    echo_only: bool = False  # completions' echo with max_tokens 0: the one token made is left out

    def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        return only_the_end(deltas_of(self.states)) if self.echo_only else deltas_of(self.states)

    def stop_reason(self, index: int):
        return None if self.echo_only else self.states[index].stop_reason


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of a seeded request draws with seed + i, as vLLM's child requests do."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


async def deltas_of(states: list[RequestState]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) until every choice has ended (an error ends its choice too)."""
    if len(states) == 1:
        while True:
            d = await states[0].deltas.get()
            yield 0, d
            if d.finish_reason or d.error:
                return
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, state: RequestState) -> None:
        while True:
            d = await state.deltas.get()
            merged.put_nowait((index, d))
            if d.finish_reason or d.error:
                return

    tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(states)]
    try:
        left = len(states)
        while left:
            index, d = await merged.get()
            yield index, d
            left -= bool(d.finish_reason or d.error)
    finally:
        for task in tasks:
            task.cancel()


async def only_the_end(deltas: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas with their tokens left out: each choice ends at its length (max_tokens 0), or in its error."""
    async with aclosing(deltas):
        async for i, d in deltas:
            if d.error:
                yield i, d
            elif d.finish_reason:
                yield i, Delta("", 0, "length")
