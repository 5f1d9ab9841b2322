from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minipd.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HANDOFF = "handoff"  # its KV is held for export to another worker (after a prefill, or a move)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside an engine. Its KV covers token_ids[:num_computed_tokens]."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    hand_off: bool | None = None  # its KV goes to another worker once its next token is sampled (None: the role says)
    prompt_logprobs: list | None = None  # params.prompt_logprobs: per prompt position, [id, logprob, rank, top] (first None)
    stop_reason: int | None = None  # the stop_token_ids token that ended it (eos, checked first: None), as vLLM

    @classmethod
    def new(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        return cls(request_id, list(prompt_token_ids), len(prompt_token_ids), params)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
