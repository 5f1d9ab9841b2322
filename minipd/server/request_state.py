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


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream | None
    arrival: float = field(default_factory=time.time)
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefill_worker: int | None = None
    decode_worker: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    events: dict[str, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    kv_seconds: float | None = None

    @property
    def holders(self) -> set[int]:
        return {w for w in (self.prefill_worker, self.decode_worker) if w is not None}

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
            "kv_transfer": {"bytes": self.kv_bytes, "seconds": self.kv_seconds,
                            "gbps": (self.kv_bytes * 8 / self.kv_seconds / 1e9) if self.kv_seconds else None},
            "ttft": ttft, "tpot": tpot, "e2e": e2e if self.finished else None,
            "finish_reason": self.finish_reason,
        }  # fmt: skip
