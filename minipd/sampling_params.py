from __future__ import annotations

from dataclasses import asdict, dataclass, field

MAX_LOGPROBS = 20  # as vLLM's default --max-logprobs
MAX_REPETITION_PENALTY = 10.0


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's log probability and this many best others (vLLM's)
    prompt_logprobs: int | None = None  # ... and the same for each prompt token after the first
    presence_penalty: float = 0.0  # subtracted from the logit of every token the reply holds (OpenAI's)
    frequency_penalty: float = 0.0  # ... times how often it holds it
    repetition_penalty: float = 1.0  # a token of the prompt or the reply: logit / this if > 0, else * this (vLLM's)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    min_p: float = 0.0  # after temperature, tokens less likely than this times the best one are not drawn (vLLM's)
    min_tokens: int = 0  # before this many tokens, eos and stop_token_ids are not sampled and stop strings not looked for
    include_stop_str_in_output: bool = False  # the stop string that ended the reply stays in its text (vLLM's)
    skip_special_tokens: bool = True  # special tokens (eos, ...) leave no text (vLLM's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def changes_logits(self, output_index: int) -> bool:
        """Whether what output token `output_index` is sampled from differs from the model's logits."""
        return bool(self.logit_bias) or self.penalized or output_index < self.min_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)
