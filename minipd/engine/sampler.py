"""The whole batch sampled in a few tensor operations: temperature, top-k and top-p on the
probabilities, then one uniform number per row drawn through the row's cumulative distribution.

A seeded request's uniform for its output token i is a hash of (seed, i) and nothing else, so the
request draws the same tokens whatever it is batched with, after a preemption or a handoff."""

from __future__ import annotations

import torch

from minipd.sampling_params import SamplingParams

CANDIDATES = 256  # top-p looks at this many best tokens first, and at all of them only if it must


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    """One token per row of logits (B, V)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens.tolist()
    dev = logits.device
    rows = torch.tensor(sampled_rows, device=dev)
    sub = [params[i] for i in sampled_rows]
    temperature = torch.tensor([p.temperature for p in sub], device=dev)
    probs = torch.softmax(logits.index_select(0, rows) / temperature[:, None], dim=-1)
    top_k, top_p = [p.top_k for p in sub], [p.top_p for p in sub]
    if any(k > 0 for k in top_k) or any(q < 1.0 for q in top_p):
        probs = _keep_top(probs, top_k, top_p)
    cdf = probs.double().cumsum(dim=-1)  # float32 sums drift by more than a token's width over 49k tokens
    u = _uniforms([p.seed for p in sub], [output_index[i] for i in sampled_rows], dev)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    tokens.index_copy_(0, rows, picked)
    return tokens.tolist()


def _keep_top(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero all but each row's top_k tokens and the smallest set of them reaching top_p."""
    vocab = probs.shape[-1]
    k = [kk if 0 < kk < vocab else vocab for kk in top_k]
    width = min(vocab, max(min(kk, CANDIDATES) if q < 1.0 else kk for kk, q in zip(k, top_p)))
    values, order = probs.topk(width, dim=-1)
    if width < vocab and any(
        q < 1.0 and kk > width and mass < q for kk, q, mass in zip(k, top_p, values.sum(dim=-1).tolist())
    ):
        values, order = probs.sort(dim=-1, descending=True)  # a nucleus wider than the candidates
        width = vocab
    ranks = torch.arange(width, device=probs.device)[None, :]
    keep = ranks < torch.tensor(k, device=probs.device)[:, None]
    before = values.cumsum(dim=-1) - values  # mass of the better tokens
    keep &= before < torch.tensor(top_p, device=probs.device)[:, None]
    return torch.zeros_like(probs).scatter_(-1, order, values * keep)


def _uniforms(seeds: list[int | None], index: list[int], device) -> torch.Tensor:
    """One number in (0, 1) per row: hashed from (seed, index) when seeded, else random."""
    out = torch.rand(len(seeds), device=device, dtype=torch.float64)
    for r, seed in enumerate(seeds):
        if seed is not None:
            out[r] = _hash_to_unit(seed, index[r])
    return out


def _hash_to_unit(seed: int, index: int) -> float:
    """splitmix64 of (seed, index), to (0, 1)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return ((x >> 11) + 0.5) / (1 << 53)
