"""The P:D planner. Profiles minipd's workers (prefill time against prompt length, decode step time
against batch size and context, the time a prompt token adds to co-located decodes, KV transfer
bandwidth), then for a traffic description and SLOs works out how many prefill and decode
workers to use, showing the arithmetic.

The model: a prefill worker is an M/D/1 queue (Poisson arrivals, service S = a + b*prompt), so
TTFT = S + rho*S / (2(1 - rho)) + KV transfer; a decode worker holds B requests at once, with
B = (rate/D) * output * TPOT (Little's law) and TPOT = c0 + (c1 + c2*context) * B. Co-located,
each worker also reads prompts, which stalls its decodes for a share rho of the time:
TPOT_colocated = TPOT / (1 - rho).

It also states the rule of a published small engine (nanoPD): disaggregation pays when the
interference per prompt token over the transfer cost per token exceeds B* / load, where B* is the
batch at which decode turns compute-bound (c0 / c1 here) and load the decode batch in use."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

from minipd.bench.client import load_or_interrupt
from minipd.bench.target import Target
from minipd.bench.workloads import BenchRequest


@dataclass(slots=True)
class Profile:
    prefill_fixed_s: float  # a
    prefill_per_token_s: float  # b
    decode_fixed_s: float  # c0: a decode step at batch 1, short context
    decode_per_seq_s: float  # c1
    decode_per_context_token_s: float  # c2: per token of context of each sequence
    interference_per_token_s: float  # what one prompt token read in a step adds to that step's decodes
    kv_bytes_per_token: int
    kv_bandwidth_bytes_s: float  # measured on the server's transport
    points: dict  # the measurements the fits came from
    # [[batch, seconds], ...], batches rising: each sequence past `batch` in a step costs `seconds` (not c1)
    decode_bends: list = field(default_factory=list)

    @property
    def compute_bound_batch(self) -> float:
        """B*: the batch whose sequences cost as much as the step's fixed part (along the bends)."""
        start, cost, rate = 0.0, 0.0, self.decode_per_seq_s
        for end, next_rate in [*self.decode_bends, [math.inf, None]]:
            if rate > 0 and cost + rate * (end - start) >= self.decode_fixed_s:
                return start + (self.decode_fixed_s - cost) / rate
            if next_rate is None:
                break
            cost, start, rate = cost + rate * (end - start), end, next_rate
        return math.inf

    def as_dict(self) -> dict:
        return asdict(self) | {"compute_bound_batch": self.compute_bound_batch}


@dataclass(slots=True)
class Traffic:
    rate: float  # requests per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean


def from_step_model(p, prompt_tokens: float = 512.0) -> Profile:
    """The planner's terms from a simulator profile (minipd/sim/profile.py, `python -m minipd profile`):
    prefill per token includes attention at a prompt of `prompt_tokens` (the planner's model is linear
    in the prompt, the step model is not); interference per token is the prompt token's own cost."""
    s = p.step
    link = next(iter(p.links.values()), None)
    n = max(1, round(prompt_tokens))
    past_bends = (s.prompt_seconds(n, 0) - n * s.per_prefill_token) / n  # 0 without prompt bends
    return Profile(prefill_fixed_s=s.fixed, prefill_per_token_s=s.per_prefill_token + s.per_attention_pair * (prompt_tokens + 1) / 2 + past_bends,
                   decode_fixed_s=s.fixed + s.gap, decode_per_seq_s=s.per_decode, decode_per_context_token_s=s.per_decode_context,
                   interference_per_token_s=s.per_prefill_token, kv_bytes_per_token=p.worker.kv_bytes_per_token,
                   kv_bandwidth_bytes_s=link.bytes_per_s if link else float("nan"),
                   points={"from": "a simulator profile", "source": p.source},
                   decode_bends=[list(b) for b in s.decode_bends])  # fmt: skip


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a >= 0: a cost that grows faster than linearly (attention over a long
    prompt) would otherwise give a negative fixed cost, which no step has; then the line goes through 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if my - b * mx >= 0:
        return my - b * mx, b
    squares = sum(x * x for x in xs)
    return 0.0, sum(x * y for x, y in zip(xs, ys)) / squares if squares else 0.0


def _steps_since(target: Target, since: float) -> list[dict]:
    """The engine steps the server reported from `since` on (GET /admin/events replays them)."""
    import json
    import urllib.request

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    req = urllib.request.Request(f"{target.url}/admin/events?since={since}", headers=headers)
    out = []
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data: {"):
                    out.append(json.loads(line[6:]))
    except TimeoutError:
        pass
    return [e for e in out if e["type"] == "step"]


def _load(target: Target, requests: list[BenchRequest], seed: int):
    return load_or_interrupt(target.url, target.model, requests, api_key=target.api_key, seed=seed, progress=False)


def profile(target: Target, quick: bool = False, seed: int = 1) -> Profile:
    if not target.is_minipd:
        raise RuntimeError("the planner profiles minipd workers (it reads their timelines and steps)")
    lengths = [128, 512, 1024] if quick else [128, 512, 1024, 2048]
    batches = [1, 4, 8] if quick else [1, 4, 8, 16]
    target.set_mode({"mode": "colocated", "workers": 1})
    _load(target, [BenchRequest(0, 64, 4, 0.0)], seed)  # warm
    prefill = []
    for i, n in enumerate(lengths):
        rec = _load(target, [BenchRequest(i, n, 1, 0.0)], seed + i)[0]
        ev = rec.server_timeline["events"]
        prefill.append((n, ev["prefill_end"] - ev["prefill_start"]))
    a, b = _fit([n for n, _ in prefill], [t for _, t in prefill])
    decode = {}
    for context in (64, 1024):
        for batch in batches if context == 64 else [4]:
            since = time.time()
            _load(target, [BenchRequest(i, context, 40, 0.0) for i in range(batch)], seed + 100 + batch)
            durations = [e["end"] - e["time"] for e in _steps_since(target, since)
                         if not e["prefill_tokens"] and e["decodes"] == batch]  # fmt: skip
            decode[(context, batch)] = statistics.median(durations)
    c0, c1 = _fit(batches, [decode[(64, bt)] for bt in batches])
    c2 = max(0.0, (decode[(1024, 4)] - decode[(64, 4)]) / (4 * (1024 - 64)))
    interference = _interference(target, seed, lambda batch: c0 + c1 * batch)
    kv_per_token, bandwidth = _kv_bandwidth(target, seed)
    return Profile(a, b, c0, c1, c2, interference, kv_per_token, bandwidth,
                   {"prefill_s_by_prompt": prefill, "decode_step_s_by_context_batch":
                    {f"{c}x{bt}": t for (c, bt), t in decode.items()}})  # fmt: skip


def _interference(target: Target, seed: int, decode_step) -> float:
    """Replies decode while 1024-token prompts are read 128 tokens a step (chunked): what each prompt
    token adds to a step that also carries replies (its time beyond a decode-only step of that batch)."""
    target.set_mode({"mode": "chunked", "chunk_tokens": 132, "workers": 1})
    since = time.time()
    requests = [BenchRequest(i, 64, 400, 0.0) for i in range(4)] + [BenchRequest(4 + i, 1024, 1, 0.3 * (i + 1))
                                                                   for i in range(3)]  # fmt: skip
    _load(target, requests, seed + 300)
    extra = [(e["end"] - e["time"] - decode_step(e["decodes"])) / e["prefill_tokens"]
             for e in _steps_since(target, since) if e["prefill_tokens"] >= 64 and e["decodes"]]  # fmt: skip
    return max(0.0, statistics.median(extra)) if extra else float("nan")


def _kv_bandwidth(target: Target, seed: int) -> tuple[int, float]:
    if target.num_workers < 2:
        return 0, float("nan")
    target.set_mode({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1, "kv_link_gbps": None})
    recs = _load(target, [BenchRequest(i, 1024, 2, 0.2 * i) for i in range(3)], seed + 400)
    kv = [r.server_timeline["kv_transfer"] for r in recs if r.server_timeline]
    per_token = kv[0]["bytes"] // 1024
    return per_token, statistics.median(k["bytes"] / k["seconds"] for k in kv if k["seconds"])


# ---- the plan ---------------------------------------------------------------------------------------


def prefill_ttft(p: Profile, t: Traffic, workers: int, link_bytes_s: float | None = None) -> float:
    """Mean TTFT on `workers` prefill workers (M/D/1), plus the KV transfer; inf if overloaded."""
    service = p.prefill_fixed_s + p.prefill_per_token_s * t.prompt_tokens
    rho = t.rate / workers * service
    if rho >= 1:
        return float("inf")
    bandwidth = link_bytes_s or p.kv_bandwidth_bytes_s
    transfer = p.kv_bytes_per_token * t.prompt_tokens / bandwidth if bandwidth == bandwidth and bandwidth else 0.0
    return service + rho * service / (2 * (1 - rho)) + transfer


def decode_tpot(p: Profile, t: Traffic, workers: int) -> tuple[float, float]:
    """(TPOT, batch) on `workers` decode workers; inf if the batch would grow without bound."""
    per_context = p.decode_per_context_token_s * (t.prompt_tokens + t.output_tokens / 2)
    load = t.rate / workers * t.output_tokens  # tokens per second a worker must produce
    # the step is a line on each stretch between bends: the batch is the first that Little's law
    # (batch = load x step(batch)) puts on the stretch whose line it solved
    start, rate, fixed = 0.0, p.decode_per_seq_s, p.decode_fixed_s  # fixed: the stretch's line at batch 0
    for end, next_rate in [*p.decode_bends, [math.inf, None]]:
        per_seq = rate + per_context
        if load * per_seq < 1:
            batch = load * fixed / (1 - load * per_seq)
            if batch <= end:
                return fixed + per_seq * batch, max(batch, start)
        if next_rate is not None:
            fixed, start, rate = fixed + (rate - next_rate) * end, end, next_rate
    return math.inf, math.inf


def colocated(p: Profile, t: Traffic, workers: int) -> tuple[float, float]:
    """(TTFT, TPOT) with every worker doing both (prefill first): decodes stall while prompts are read."""
    ttft = prefill_ttft(p, t, workers, link_bytes_s=float("inf"))
    rho = t.rate / workers * (p.prefill_fixed_s + p.prefill_per_token_s * t.prompt_tokens)
    tpot, _ = decode_tpot(p, t, workers)
    return ttft, (tpot / (1 - rho) if rho < 1 else float("inf"))


def _margin(slo_s: float, predicted_s: float) -> float:
    """How many times the prediction fits in the SLO (a fit of zero cost, on a fast machine, fits always)."""
    return slo_s / predicted_s if predicted_s > 0 else float("inf")


def recommend(p: Profile, t: Traffic, workers: int, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Every split of `workers` (and co-located), scored by the tighter of the two SLO margins."""
    rows = []
    for prefill in range(1, workers):
        ttft = prefill_ttft(p, t, prefill)
        tpot, batch = decode_tpot(p, t, workers - prefill)
        rows.append({"split": f"{prefill}P{workers - prefill}D", "prefill": prefill, "decode": workers - prefill,
                     "ttft_s": ttft, "tpot_s": tpot, "decode_batch": batch,
                     "margin": min(_margin(slo_ttft_s, ttft), _margin(slo_tpot_s, tpot))})  # fmt: skip
    ttft, tpot = colocated(p, t, workers)
    rows.append({"split": "colocated", "prefill": 0, "decode": 0, "ttft_s": ttft, "tpot_s": tpot, "decode_batch": None,
                 "margin": min(_margin(slo_ttft_s, ttft), _margin(slo_tpot_s, tpot))})  # fmt: skip
    best = max(rows, key=lambda r: r["margin"])
    return {"traffic": asdict(t), "workers": workers, "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s,
            "options": rows, "best": best, "meets_slos": best["margin"] >= 1.0}  # fmt: skip


def nanopd_rule(p: Profile, decode_batch: float) -> dict:
    """Disaggregation pays when interference/token over transfer cost/token exceeds B*/load.
    Returns both sides and the link rate at which they are equal (the predicted crossover)."""
    transfer_per_token = p.kv_bytes_per_token / p.kv_bandwidth_bytes_s
    lhs = p.interference_per_token_s / transfer_per_token
    rhs = p.compute_bound_batch / max(decode_batch, 1e-9)
    crossover_bytes_s = rhs * p.kv_bytes_per_token / p.interference_per_token_s
    return {"interference_per_token_s": p.interference_per_token_s, "transfer_per_token_s": transfer_per_token,
            "lhs": lhs, "compute_bound_batch": p.compute_bound_batch, "decode_batch": decode_batch, "rhs": rhs,
            "disagg_pays": lhs > rhs, "predicted_crossover_gbps": crossover_bytes_s * 8 / 1e9}  # fmt: skip


def explain(plan: dict, p: Profile) -> str:
    """The arithmetic, in words and numbers."""
    t, best = plan["traffic"], plan["best"]
    service = p.prefill_fixed_s + p.prefill_per_token_s * t["prompt_tokens"]
    lines = [
        f"Traffic: {t['rate']:.2f} req/s, {t['prompt_tokens']:.0f} prompt and {t['output_tokens']:.0f} output "
        f"tokens on average; SLOs TTFT {plan['slo_ttft_s'] * 1e3:.0f} ms, TPOT {plan['slo_tpot_s'] * 1e3:.0f} ms; "
        f"{plan['workers']} workers.",
        f"Prefill of one prompt: {p.prefill_fixed_s * 1e3:.1f} ms + {p.prefill_per_token_s * 1e3:.3f} ms/token x "
        f"{t['prompt_tokens']:.0f} = {service * 1e3:.0f} ms; a prefill worker is busy rate/P x that of the time.",
        f"Decode step: {p.decode_fixed_s * 1e3:.1f} ms + {p.decode_per_seq_s * 1e3:.2f} ms per sequence "
        f"+ {p.decode_per_context_token_s * 1e6:.2f} us per context token per sequence"
        + "".join(f", {rate * 1e3:.2f} ms per sequence past {batch:.0f}" for batch, rate in p.decode_bends)
        + "; it turns compute-bound "
        f"(twice the batch-1 step) at B* = {p.compute_bound_batch:.0f}.",
        "",
        "| split | TTFT (ms) | TPOT (ms) | decode batch | SLO margin |",
        "|---|---|---|---|---|",
    ]
    for r in plan["options"]:
        batch = "-" if r["decode_batch"] is None else f"{r['decode_batch']:.1f}"
        lines.append(f"| {r['split']} | {_ms(r['ttft_s'])} | {_ms(r['tpot_s'])} | {batch} | {r['margin']:.2f} |")
    verdict = "meets both SLOs" if plan["meets_slos"] else "does not meet both SLOs (best effort)"
    lines += ["", f"Recommended: **{best['split']}**, which {verdict} with margin {best['margin']:.2f}."]
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "overloaded" if seconds == float("inf") else f"{seconds * 1e3:.0f}"
