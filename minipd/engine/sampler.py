"""The whole batch sampled in a few tensor operations: temperature, then top-k and top-p on the
probabilities, then the exponential race (the argmax of probs / noise with noise ~ Exp(1) draws
from probs; a tiny change in the probabilities rarely changes the winner).

A request's noise for its output token i and vocabulary entry v is a hash of (seed, i, v) and
nothing else: a seeded request draws the same tokens whatever it is batched with, after a
preemption or a handoff, on CPU or CUDA. An unseeded request gets a random seed per token."""

from __future__ import annotations

import math
import random

import torch

from minipd.sampling_params import SamplingParams

CANDIDATES = 256  # top-p looks at this many best tokens first, and at all of them only if it must
_GOLDEN = -1640531527  # 0x9E3779B9 as a signed int32


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
    if any(p.min_p > 0 for p in sub):
        floor = torch.tensor([p.min_p for p in sub], device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs * (probs >= floor)
    ids = None  # the vocabulary ids of probs' columns, when only candidates are kept
    top_k, top_p = [p.top_k for p in sub], [p.top_p for p in sub]
    if any(k > 0 for k in top_k) or any(q < 1.0 for q in top_p):
        probs, ids = _keep_top(probs, top_k, top_p)  # ids None: the whole vocabulary is kept in place
    keys = [_key(p.seed, output_index[i]) for p, i in zip(sub, sampled_rows)]
    columns = ids if ids is not None else torch.arange(probs.shape[-1], device=dev).expand(len(sub), -1)
    picked = (probs / _exponential(torch.tensor(keys, dtype=torch.int32, device=dev), columns)).argmax(dim=-1)
    if ids is not None:
        picked = ids.gather(1, picked[:, None]).squeeze(1)
    tokens.index_copy_(0, rows, picked)
    return tokens.tolist()


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: each row's logit_bias added to its tokens' logits."""
    for row, p in zip(logits, params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=row.dtype))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[tuple[list[int], int]]) -> None:
    """In place, as vLLM applies them before temperature: each row's repetition penalty on the tokens
    of its prompt and reply, then frequency and presence penalties on those of its reply.
    histories: (the sequence's token ids, how many of them are its prompt)."""
    vocab = logits.shape[-1]
    for row, p, (token_ids, num_prompt) in zip(logits, params, histories):
        if not p.penalized:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(token_ids, device=logits.device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        reply = token_ids[num_prompt:]
        if reply and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(reply, device=logits.device), minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def hold_back_stops(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
                    eos_token_ids: tuple[int, ...]) -> None:  # fmt: skip
    """In place: a row still short of its min_tokens cannot sample its eos or stop token ids."""
    for row, p, index in zip(logits, params, output_index):
        if index < p.min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            if banned:
                row[torch.tensor(banned, device=logits.device)] = -math.inf


def logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[list | None]:
    """For each row that wants them: [the sampled token's log probability, [[id, log probability]
    of the `wanted` best tokens, best first]], from the model's own distribution (before temperature,
    top-k and top-p, as vLLM's default raw logprobs). None for the other rows."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    out: list[list | None] = [None] * len(wanted)
    if not rows:
        return out
    dev = logits.device
    lp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=dev)).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=dev)[:, None]).squeeze(1).tolist()
    width = max(wanted[i] for i in rows)
    values, ids = lp.topk(width, dim=-1) if width else (lp[:, :0], lp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = wanted[i]
        out[i] = [chosen[j], [[t, v] for t, v in zip(ids[j][:n], values[j][:n])]]
    return out


def _keep_top(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's candidates, best first: (their probabilities, 0 where dropped; their vocabulary ids).
    Kept: the top_k best, and of those the smallest set reaching top_p."""
    vocab = probs.shape[-1]
    k = [kk if 0 < kk < vocab else vocab for kk in top_k]
    width = min(vocab, max(min(kk, CANDIDATES) if q < 1.0 else kk for kk, q in zip(k, top_p)))
    values, order = probs.topk(width, dim=-1)
    if width < vocab and any(
        q < 1.0 and kk > width and mass < q for kk, q, mass in zip(k, top_p, values.sum(dim=-1).tolist())
    ):
        return _keep_top_wide(probs, k, top_p), None  # a nucleus wider than the candidates
    ranks = torch.arange(width, device=probs.device)[None, :]
    keep = ranks < torch.tensor(k, device=probs.device)[:, None]
    before = values.cumsum(dim=-1) - values  # mass of the better tokens
    keep &= before < torch.tensor(top_p, device=probs.device)[:, None]
    return values * keep, order


def _keep_top_wide(probs: torch.Tensor, k: list[int], top_p: list[float]) -> torch.Tensor:
    """The same on the whole vocabulary without sorting it: the nucleus is every token at or above
    the highest probability threshold whose tokens still reach top_p, found by bisection."""
    kth = torch.stack([probs[r].topk(kk).values[-1] if kk < probs.shape[-1] else probs.new_zeros(())
                       for r, kk in enumerate(k)])  # fmt: skip
    target = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
    lo, hi = torch.zeros_like(target), probs.max(dim=-1).values
    for _ in range(32):
        mid = (lo + hi) / 2
        enough = (probs * (probs >= mid[:, None])).sum(dim=-1) >= target
        lo, hi = torch.where(enough, mid, lo), torch.where(enough, hi, mid)
    keep = (probs >= lo[:, None]) & (probs >= kth[:, None])
    return probs * keep


def _key(seed: int | None, index: int) -> int:
    """A 32-bit key for (seed, token index): splitmix64, folded; random when there is no seed."""
    if seed is None:
        return random.getrandbits(32) - (1 << 31)
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 31)) & 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _exponential(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise for each (row key, vocabulary id): lowbias32 of key + id * golden, in int32
    tensors (wrapping arithmetic; logical shifts by masking)."""
    x = keys[:, None] + columns.to(torch.int32) * _GOLDEN
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -2073254261  # 0x846CA68B
    x = x ^ ((x >> 16) & 0xFFFF)
    u = (((x >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
