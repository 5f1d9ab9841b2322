"""What crosses from a prefill engine to a decode engine: plain metadata, and a view of where a
request's KV lies in a paged cache (so a transfer reads or writes it without knowing the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipd.engine.sequence import Sequence
from minipd.sampling_params import SamplingParams


@dataclass(slots=True)
class HandoffMeta:
    """Everything the decode side needs besides the KV. Plain data (msgpack-able)."""

    request_id: str
    token_ids: list[int]  # prompt, tokens already sent, and the one just sampled
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV travels
    params: dict
    kv_shape: list[int]  # (2, layers, num_computed_tokens, kv_heads, head_dim)
    kv_dtype: str

    @classmethod
    def of(cls, seq: Sequence, kv_cache: torch.Tensor) -> HandoffMeta:
        shape = list(kv_cache.shape)
        shape[2] = seq.num_computed_tokens
        return cls(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed_tokens,
                   seq.params.to_dict(), shape, str(kv_cache.dtype).removeprefix("torch."))  # fmt: skip

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * getattr(torch, self.kv_dtype).itemsize

    def to_sequence(self) -> Sequence:
        seq = Sequence.new(self.request_id, self.token_ids[: self.num_prompt_tokens], SamplingParams.from_dict(self.params))
        seq.token_ids = list(self.token_ids)
        seq.num_computed_tokens = self.num_computed_tokens
        return seq


@dataclass(slots=True)
class KVSlots:
    """The first num_tokens positions of one request in a paged cache (2, layers, slots, kv_heads, head_dim),
    through its blocks. Parts are numbered kind * layers + layer (kind 0 = K, 1 = V)."""

    cache: torch.Tensor
    blocks: list[int]
    num_tokens: int
    block_size: int

    def slots(self) -> torch.Tensor:
        pos = torch.arange(self.num_tokens)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.cache.device)

    @property
    def num_parts(self) -> int:
        return self.cache.shape[0] * self.cache.shape[1]

    def read(self) -> torch.Tensor:
        """(2, layers, num_tokens, kv_heads, head_dim), a copy."""
        return self.cache.index_select(2, self.slots())

    def read_part(self, part: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        """(num_tokens, kv_heads, head_dim), a copy."""
        return self.cache.flatten(0, 1)[part].index_select(0, self.slots() if slots is None else slots)

    def write(self, kv: torch.Tensor) -> None:
        for part, layer_kv in enumerate(kv.flatten(0, 1)):
            self.write_part(part, layer_kv)

    def write_part(self, part: int, kv: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        slots = self.slots() if slots is None else slots
        target = self.cache.flatten(0, 1)[part]
        target.index_copy_(0, slots, kv.to(device=target.device, dtype=target.dtype))


@dataclass(slots=True)
class KVHandoff:
    """A handoff with its KV copied out: for moving KV between engines in one process."""

    meta: HandoffMeta
    kv: torch.Tensor
