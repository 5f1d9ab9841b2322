"""Synthetic request streams, reproducible from a seed: prompt and reply lengths plus arrival times.

No dataset is downloaded; lengths are drawn from lognormal fits to published summary statistics.

chat (ShareGPT-shaped, as in the vLLM and DistServe chatbot benchmarks)
    vLLM paper (Kwon et al., SOSP'23, sec. 6.1 and Fig. 11): first-round ShareGPT conversations, OPT
    tokenizer, mean input 161.31 tokens and mean output 337.99 tokens ("8.4x longer input prompts and
    5.8x longer outputs than Alpaca, with higher variance"). vLLM's benchmark keeps prompts of 4..1024
    tokens and prompt + output <= 2048 (`sample_sharegpt_requests`). The paper gives means only, so
    the spread is our assumption: lognormal with sigma 1.0, median = mean * exp(-sigma^2 / 2)
    (input median ~98, output median ~205), clipped to vLLM's bounds.
summarize (long prompt, short reply, as DistServe's LongBench summarization workload)
    DistServe (Zhong et al., OSDI'24, sec. 6.1 and Table 1) serves LongBench summarization with
    inputs truncated to 2048 tokens (OPT's position limit), SLOs TTFT 15 s and TPOT 0.15 s on OPT-66B.
    LongBench's own statistics (THUDM/LongBench task.md) give average English summarization inputs
    of 2,113 (MultiNews), 8,734 (GovReport) and 10,614 (QMSum) words, and its generation cap for
    GovReport/QMSum is 512 new tokens (config/dataset2maxlen.json). Full size here: input median
    3000 tokens (sigma 0.5, clipped to 1024..8192), output median 150 (sigma 0.4, clipped to 32..512).
generate (short prompt, long reply: writing, code generation)
    Synthetic, from no published dataset: prompts of median 100 tokens (sigma 0.5, 16..512), replies
    of median 800 (sigma 0.3, 256..2048). Decode-heavy: it rewards decode capacity, where summarize
    rewards prompt-reading capacity.
mixed
    Each request is a summarize request with probability MIXED_SUMMARIZE_FRACTION, else chat.
fixed
    Every request has the given input_len and output_len.
phases
    Traffic that changes phase: the run is cut into equal parts, by default three (PHASES): chat, then
    summarize (long documents: long prompts, short replies), then chat again; `phases=` (bench's
    --phases) names others, from PHASE_KINDS. Each phase has arrivals of its own at the run's rate and
    lengths drawn as its workload's, from random streams of its own; each request carries its
    phase's index (0, 1, 2, ...). With a duration each phase lasts its share of it; with num_prompts
    alone each has its share of the requests and starts one mean gap after the last request of the
    one before (phase_spans gives the spans either way).

`quick=True` scales lengths down so one request takes seconds on a 2-core CPU with a 135M model:
chat prompts 50..300 (median 120), replies 16..64 (median 32); summarize prompts 600..1500
(median 1000), replies 16..32 (median 24); generate prompts 16..128 (median 40), replies 48..192
(median 96).

Arrivals follow vLLM's `benchmark_serving`: gamma inter-arrival times with shape = burstiness and
scale = 1 / (rate * burstiness) (burstiness 1 is a Poisson process); rate = inf sends everything at
time 0. Lengths and arrivals come from separate random streams, so the same seed gives the same
requests at every rate (with `num_prompts`), only their arrival times change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("chat", "summarize", "generate", "mixed", "fixed", "phases")
PHASES = ("chat", "summarize", "chat")  # the phases workload's default phases, in order, each a third of the run
PHASE_KINDS = ("chat", "summarize", "generate")  # what a phase can be
MIXED_SUMMARIZE_FRACTION = 0.2
VLLM_SHAREGPT_MAX_TOTAL = 2048  # vLLM keeps ShareGPT pairs with prompt + output <= 2048


@dataclass(slots=True)
class BenchRequest:
    index: int
    prompt_len: int
    output_len: int
    arrival: float  # seconds after the run's start
    phase: int = 0  # the phases workload: the index of the phase the request belongs to (PHASES)
    max_tokens: int | None = None  # the client's cap where the reply ends before it (the advisor's replay), else None


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A lognormal length distribution, rounded and clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, n) if self.sigma > 0 else np.full(n, self.median)
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


def median_for_mean(mean: float, sigma: float) -> float:
    """The lognormal median whose mean is `mean`: mean = median * exp(sigma^2 / 2)."""
    return mean * math.exp(-(sigma**2) / 2)


# (prompt, output) length distributions per workload, full size and quick
LENGTHS: dict[tuple[str, bool], tuple[LengthDist, LengthDist]] = {
    ("chat", False): (LengthDist(median_for_mean(161.31, 1.0), 1.0, 4, 1024),
                      LengthDist(median_for_mean(337.99, 1.0), 1.0, 4, VLLM_SHAREGPT_MAX_TOTAL)),
    ("summarize", False): (LengthDist(3000, 0.5, 1024, 8192), LengthDist(150, 0.4, 32, 512)),
    ("chat", True): (LengthDist(120, 0.5, 50, 300), LengthDist(32, 0.4, 16, 64)),
    ("summarize", True): (LengthDist(1000, 0.3, 600, 1500), LengthDist(24, 0.25, 16, 32)),
    ("generate", False): (LengthDist(100, 0.5, 16, 512), LengthDist(800, 0.3, 256, 2048)),
    ("generate", True): (LengthDist(40, 0.5, 16, 128), LengthDist(96, 0.3, 48, 192)),
}  # fmt: skip


def arrival_times(
    rng: np.random.Generator,
    *,
    rate: float,
    burstiness: float = 1.0,
    num_prompts: int | None = None,
    duration: float | None = None,
) -> np.ndarray:
    """Arrival offsets in seconds; the first request at 0, then gamma-distributed gaps (vLLM's process)."""
    if num_prompts is None and duration is None:
        raise ValueError("give num_prompts or duration")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        if num_prompts is None:
            raise ValueError("rate=inf needs num_prompts (a duration would hold infinitely many requests)")
        return np.zeros(num_prompts)
    scale = 1.0 / (rate * burstiness)
    if num_prompts is not None:
        gaps = rng.gamma(burstiness, scale, max(num_prompts - 1, 0))
        times = np.concatenate([[0.0], np.cumsum(gaps)])[:num_prompts]
        return times if duration is None else times[times < duration]
    times = [np.zeros(1)]
    last = 0.0
    while last < duration:
        block = last + np.cumsum(rng.gamma(burstiness, scale, max(16, int(rate * duration))))
        times.append(block)
        last = float(block[-1])
    out = np.concatenate(times)
    return out[out < duration]


def clip_to_model_len(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Make prompt + output <= max_model_len; when both are long, the output keeps at least half."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    prompt_len, output_len = max(1, prompt_len), max(1, output_len)
    if prompt_len + output_len > max_model_len:
        output_len = min(output_len, max(max_model_len - prompt_len, max_model_len // 2))
        prompt_len = max_model_len - output_len
    return prompt_len, output_len


def workload_names(text: str | None, input_len: int | None, output_len: int | None, flag: str) -> list[str]:
    """The workloads `flag` (comma-separated) names; lengths given without it mean the fixed workload.
    Raises ValueError where the lengths would be ignored, or the fixed workload lacks them."""
    lengths = input_len is not None or output_len is not None
    names = text.split(",") if text else ["fixed" if lengths else "chat"]
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if lengths and "fixed" not in names:
        raise ValueError(
            f"--input-len and --output-len are the fixed workload's lengths; {flag} {text} does not run it"
        )
    if "fixed" in names and (input_len is None or output_len is None):
        raise ValueError("the fixed workload needs both --input-len and --output-len")
    if lengths and min(input_len, output_len) < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    return names


def make_workload(
    name: str,
    *,
    num_prompts: int | None = None,
    duration: float | None = None,
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    quick: bool = False,
    input_len: int | None = None,
    output_len: int | None = None,
    max_model_len: int = 8192,
    phases: tuple[str, ...] = PHASES,
) -> list[BenchRequest]:
    """The requests of one run, sorted by arrival; bounded by `num_prompts`, `duration` or both."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if name == "phases":
        return _phases(num_prompts, duration, rate, burstiness, seed, quick, max_model_len, phases)
    arrivals = arrival_times(
        np.random.default_rng([seed, 3]), rate=rate, burstiness=burstiness, num_prompts=num_prompts, duration=duration
    )
    n = len(arrivals)
    if name == "fixed":
        if input_len is None or output_len is None or input_len < 1 or output_len < 1:
            raise ValueError("the fixed workload needs input_len >= 1 and output_len >= 1")
        prompts, outputs = np.full(n, input_len), np.full(n, output_len)
    elif name == "generate":
        gen_in, gen_out = LENGTHS[("generate", quick)]
        prompts = gen_in.sample(np.random.default_rng([seed, 0]), n)
        outputs = gen_out.sample(np.random.default_rng([seed, 1]), n)
    else:
        in_rng, out_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
        chat_in, chat_out = LENGTHS[("chat", quick)]
        sum_in, sum_out = LENGTHS[("summarize", quick)]
        if name == "mixed":
            is_sum = np.random.default_rng([seed, 2]).random(n) < MIXED_SUMMARIZE_FRACTION
        else:
            is_sum = np.full(n, name == "summarize")
        chat_p, chat_o = chat_in.sample(in_rng, n), chat_out.sample(out_rng, n)
        if not quick:
            chat_o = np.minimum(chat_o, np.maximum(4, VLLM_SHAREGPT_MAX_TOTAL - chat_p))
        prompts = np.where(is_sum, sum_in.sample(in_rng, n), chat_p)
        outputs = np.where(is_sum, sum_out.sample(out_rng, n), chat_o)
    out = []
    for i in range(n):
        p, o = clip_to_model_len(int(prompts[i]), int(outputs[i]), max_model_len)
        out.append(BenchRequest(index=i, prompt_len=p, output_len=o, arrival=float(arrivals[i])))
    return out


def parse_phases(text: str | None) -> tuple[str, ...]:
    """'chat,generate,chat' -> its phases; ValueError names a bad one."""
    if not text:
        return PHASES
    kinds = tuple(x.strip() for x in text.split(","))
    for kind in kinds:
        if kind not in PHASE_KINDS:
            raise ValueError(f"--phases: unknown phase {kind!r}; each is one of {', '.join(PHASE_KINDS)}")
    if len(kinds) < 2:
        raise ValueError("--phases needs at least two phases (e.g. chat,generate,chat)")
    return kinds


def _phases(num_prompts: int | None, duration: float | None, rate: float, burstiness: float, seed: int,
            quick: bool, max_model_len: int, kinds: tuple[str, ...] = PHASES) -> list[BenchRequest]:  # fmt: skip
    """The phases workload (see the module's docstring): its phases one after the other."""
    if num_prompts is None and duration is None:
        raise ValueError("give num_prompts or duration")
    k = len(kinds)
    counts = [num_prompts // k + (i < num_prompts % k) for i in range(k)] if duration is None else [None] * k
    out: list[BenchRequest] = []
    start = 0.0
    for phase, kind in enumerate(kinds):
        arrivals = arrival_times(np.random.default_rng([seed, 3, 100 + phase]), rate=rate, burstiness=burstiness,
                                 num_prompts=counts[phase], duration=None if duration is None else duration / k)  # fmt: skip
        n = len(arrivals)
        prompt_dist, output_dist = LENGTHS[(kind, quick)]
        prompts = prompt_dist.sample(np.random.default_rng([seed, 0, 100 + phase]), n)
        outputs = output_dist.sample(np.random.default_rng([seed, 1, 100 + phase]), n)
        if kind == "chat" and not quick:
            outputs = np.minimum(outputs, np.maximum(4, VLLM_SHAREGPT_MAX_TOTAL - prompts))
        if duration is not None:
            start = phase * duration / k
        for i in range(n):
            p, o = clip_to_model_len(int(prompts[i]), int(outputs[i]), max_model_len)
            out.append(BenchRequest(len(out), p, o, start + float(arrivals[i]), phase))
        if duration is None:
            start += (float(arrivals[-1]) if n else 0.0) + (0.0 if math.isinf(rate) else 1.0 / rate)
    return out[:num_prompts] if num_prompts is not None else out


def phase_spans(requests: list[BenchRequest], duration: float | None, rate: float,
                num_phases: int = len(PHASES)) -> list[tuple[float, float]]:  # fmt: skip
    """(start, end) in seconds after the run's start of each phase of a phases workload's `requests`.
    With a duration: equal shares of it. Else each phase from its first arrival to the next phase's
    (the last one to its last arrival plus one mean gap at `rate`)."""
    k = num_phases
    if duration is not None:
        return [(i * duration / k, (i + 1) * duration / k) for i in range(k)]
    firsts: list[float | None] = [min((r.arrival for r in requests if r.phase == i), default=None) for i in range(k)]
    last = max((r.arrival for r in requests), default=0.0) + (0.0 if math.isinf(rate) else 1.0 / rate)
    spans: list[tuple[float, float]] = []
    for i in range(k):
        lo = firsts[i] if firsts[i] is not None else (spans[-1][1] if spans else 0.0)
        hi = next((f for f in firsts[i + 1 :] if f is not None), last)
        spans.append((lo, max(lo, hi)))
    return spans


def prompt_token_ids(req: BenchRequest, seed: int, vocab_size: int = 49152) -> list[int]:
    """The request's prompt: the same ids in every run and mode, drawn from [100, vocab_size - 100)."""
    lo, hi = (100, vocab_size - 100) if vocab_size > 400 else (0, vocab_size)
    rng = np.random.default_rng([seed, req.index, 7])
    return rng.integers(lo, hi, req.prompt_len).tolist()
