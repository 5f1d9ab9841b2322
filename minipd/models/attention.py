from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """Tokens [start, start + q_len) of the flat batch belong to one sequence whose context
    (cached prefix + these tokens) has ctx_len tokens."""

    start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor | None = None  # read in place (the CPU kernel): the sequence's blocks
    # gathered (portable), when there is a cached prefix
    context_slots: torch.Tensor | None = None  # (ctx_len,)
    mask: torch.Tensor | None = None  # (q_len, ctx_len) bool, causal with the prefix offset


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # (T,) where each new token's K/V goes
    num_decodes: int = 0  # the first B rows of the flat batch are decodes, one token each
    # read in place (the CPU kernel): the decodes' block tables and the position each attends up to
    block_size: int = 16
    decode_tables: torch.Tensor | None = None  # (B, W) block ids
    decode_rows: torch.Tensor | None = None  # (B,) row of decode_tables per decode: 0..B-1
    decode_positions: torch.Tensor | None = None  # (B,) last position of each context
    # gathered (portable): each context's slots, padded, and the mask of the padding
    decode_slots: torch.Tensor | None = None  # (B, Lmax)
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, Lmax) or None if all have Lmax
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (slots, Hkv, D)
    v_cache: torch.Tensor,  # (slots, Hkv, D)
    meta: AttentionMetadata,
) -> torch.Tensor:  # (T, Hq * D)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    T, Hq, D = q.shape
    out = q.new_empty(T, Hq, D)
    if meta.decode_tables is not None:
        out[: meta.num_decodes] = torch.ops.minipd.paged_attention(
            q[: meta.num_decodes], k_cache, v_cache, meta.decode_tables, meta.decode_rows, meta.decode_positions,
            meta.block_size, D**-0.5)  # fmt: skip
    elif meta.num_decodes:
        qd = q[: meta.num_decodes]
        kd = gather(k_cache, meta.decode_slots).transpose(1, 2)  # (B, Hkv, L, D)
        vd = gather(v_cache, meta.decode_slots).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, enable_gqa=True
        )  # (B, Hq, 1, D)
        out[: meta.num_decodes] = od.squeeze(2)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.q_len)
        if span.block_table is not None:
            out[rows] = torch.ops.minipd.paged_prefill(
                q[rows], k_cache, v_cache, span.block_table, span.ctx_len, meta.block_size, D**-0.5)  # fmt: skip
            continue
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, Hq, q, D)
        if span.context_slots is None:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = gather(k_cache, span.context_slots), gather(v_cache, span.context_slots)
        kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True
        )
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out.view(T, Hq * D)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for (..., L) slots; index_select is several times faster than indexing on CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
