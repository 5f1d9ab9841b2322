"""Every request's state lives here, in one place that can say who holds it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from minipd.detokenizer import TextStream
from minipd.sampling_params import SamplingParams


@dataclass(slots=True)
class Delta:
    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500  # what the client is told: 500 a fault, 503 a limit or a state a retry may pass
    error_code: str | None = None
    logprobs: list | None = None  # per token, when the request asked: [id, logprob, [[id, logprob], ...]]
    token_ids: list[int] | None = None  # the tokens this delta adds


@dataclass(slots=True)
class Placement:
    """One attempt of a request on the workers: the only record of who holds its blocks."""

    key: str  # what the workers call this attempt
    worker: int | None = None  # runs it, or (with a reader) prefills or holds it and writes its KV
    reader: int | None = None  # a handoff or move under way: holds its seat, then decodes it
    dispatched: bool = False  # `worker` was sent the request
    first_token_at: float | None = None  # the handoff's lease runs from here (the prefill's token, or the move's start)

    @property
    def holders(self) -> set[int]:
        """Workers that hold something of this attempt. Once the KV is in the reader, the reader
        becomes `worker` (the writer frees its own blocks when its send is over)."""
        writer = self.worker if self.dispatched else None
        return {w for w in (writer, self.reader) if w is not None}


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream | None
    arrival: float = field(default_factory=time.time)
    deadline: float = float("inf")  # time.monotonic() past which it fails
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None  # when asked: per prompt token [id, logprob, rank, top] (first None)
    placement: Placement | None = None
    attempt: int = 0
    redos: list[dict] = field(default_factory=list)  # {"time", "cause", "tokens_done"} per redo
    moves: list[dict] = field(default_factory=list)  # moves.MoveRecord fields, per move tried
    path: str | None = None  # disagg: "remote" (a prefill worker's, then a handoff), "local" (its decode worker's
    #   own prefill) or "prefill_only" (it ends at its first token, on the prefill worker)
    local_only: bool = False  # its KV failed to cross once: redone, it is read where it decodes
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids token that ended it
    events: dict[str, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    prefill_worker: int | None = None  # the last ones that served it, for the timeline
    decode_worker: int | None = None
    kv_bytes: int = 0
    kv_seconds: float | None = None
    early: dict = field(default_factory=dict)  # index -> Tokens that arrived before the ones before them
    gap_since: float | None = None  # time.monotonic() since when `early` waits for the tokens it lacks

    def prompt_entries(self) -> list:
        """prompt_logprobs as received, or each a None (a reply that ended before its first token)."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else [None] * len(self.prompt_token_ids)

    def tokens_left(self, sequence_length: int = 0) -> int:
        """sequence_length: prompt and tokens as a worker reported them (its newest tokens may still
        be on their way here)."""
        made = max(len(self.output_token_ids), sequence_length - len(self.prompt_token_ids))
        return self.params.max_tokens - made

    def ends_at_its_next_token(self, sequence_length: int = 0) -> bool:
        """max_tokens 1, echo-only scoring, a redo one token short: nothing is left to decode after it."""
        return self.tokens_left(sequence_length) <= 1

    def new_key(self) -> str:
        self.attempt += 1
        return f"{self.request_id}.{self.attempt}"

    @property
    def holders(self) -> set[int]:
        return self.placement.holders if self.placement else set()

    def timeline(self) -> dict:
        t = self.token_times
        ttft = t[0] - self.arrival if t else None
        e2e = (self.events.get("finish", t[-1] if t else self.arrival)) - self.arrival
        tpot = (e2e - ttft) / (len(t) - 1) if ttft is not None and len(t) > 1 else None
        return {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "events": dict(self.events),
            "token_times": list(t),
            "prompt_tokens": len(self.prompt_token_ids),
            "output_tokens": len(self.output_token_ids),
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "redos": list(self.redos),
            "moves": list(self.moves),
            "path": self.path,
            "kv_transfer": {"bytes": self.kv_bytes, "seconds": self.kv_seconds,
                            "gbps": (self.kv_bytes * 8 / self.kv_seconds / 1e9) if self.kv_seconds else None},
            "ttft": ttft, "tpot": tpot, "e2e": e2e if self.finished else None,
            "finish_reason": self.finish_reason,
        }  # fmt: skip
