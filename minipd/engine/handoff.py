from __future__ import annotations

from dataclasses import dataclass

import torch

from minipd.engine.sequence import Sequence
from minipd.sampling_params import SamplingParams


@dataclass(slots=True)
class HandoffMeta:
    """Everything the decode side needs besides the KV tensor. Plain data (msgpack-able)."""

    request_id: str
    token_ids: list[int]  # prompt + first token
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV travels
    params: dict
    kv_shape: list[int]
    kv_dtype: str

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * getattr(torch, self.kv_dtype).itemsize


@dataclass(slots=True)
class KVHandoff:
    meta: HandoffMeta
    kv: torch.Tensor | None  # (2, layers, num_computed_tokens, kv_heads, head_dim); None if already in the seat

    @classmethod
    def from_sequence(cls, seq: Sequence, kv_cache: torch.Tensor, kv: torch.Tensor | None = None) -> KVHandoff:
        shape = list(kv_cache.shape)
        shape[2] = seq.num_computed_tokens
        meta = HandoffMeta(
            request_id=seq.request_id, token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens, num_computed_tokens=seq.num_computed_tokens,
            params=seq.params.to_dict(), kv_shape=shape, kv_dtype=str(kv_cache.dtype).removeprefix("torch."),
        )  # fmt: skip
        return cls(meta, kv)

    def to_sequence(self) -> Sequence:
        m = self.meta
        seq = Sequence.new(m.request_id, m.token_ids[: m.num_prompt_tokens], SamplingParams.from_dict(m.params))
        seq.token_ids = list(m.token_ids)
        seq.num_computed_tokens = m.num_computed_tokens
        return seq
