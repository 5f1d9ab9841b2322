from __future__ import annotations

import torch

from minipd.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    """One token per row. A seeded request draws token i from a generator seeded with
    (seed, i), so its sampling state is plain data that survives a handoff or a preemption."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for row, (p, i) in enumerate(zip(params, output_index)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, i)
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if p.seed is not None:
        generator = torch.Generator(device=probs.device).manual_seed((p.seed * 1_000_003 + index) % (2**63))
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
