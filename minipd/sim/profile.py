"""A profile: what a worker's engine step costs, what moving KV costs, and what the host adds, as
plain numbers in a JSON file. `python -m minipd profile` measures one (sim/measure.py); `roofline`
estimates one from an accelerator's published figures. The simulator and the planner read it.

The step model is linear in what the scheduler put in the step (StepShape):

    step = fixed + prefill_tokens * per_prefill_token + prefill_attention * per_attention_pair
                 + decodes * per_decode + decode_context * per_decode_context
                 + (decodes in a step that also reads prompt tokens) * per_mixed_decode

where the decodes' own cost bends at some batch sizes (decode_bends): past each bend every further
decode costs that bend's rate (on the CPU a step's cost per row changes where the engine's product
changes kind: from the small-row kernel to oneDNN's, which costs more to start and less per row).
It is fitted on measured steps by non-negative least squares on relative error (a 20 ms decode step
counts as much as a 2 s prefill), with bends at the batch sizes measured, so that the decode term
follows the measured curve up or down and, past the largest batch measured, its last slope; `gap`
is the worker's own time between two steps. The prompt tokens' cost bends too (prefill_bends): on the
CPU a prompt token costs more in a step of thousands of them (its activations, megabytes per thousand
tokens, outgrow the caches), so past a step size measured often, with steps well past it measured,
each further prompt token in the step costs the bend's rate, which the fit keeps at or above
per_prefill_token."""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

FORMAT = 1
GAP_CAP_S = 0.05  # two steps closer than this were back to back (the worker had work)
TERMS = ("fixed", "per_prefill_token", "per_attention_pair", "per_decode", "per_decode_context", "per_mixed_decode")
MAX_BENDS = 4  # the fit tries every set of terms: 2^(6 + bends + prompt bends) least squares
BEND_MIN_STEPS = 3  # steps of a batch size (run alone) before a bend may sit there
BEND_SPACING = 1.5  # each bend at least this many times the batch size of the one before
PROMPT_BEND_PAST = 2  # steps (run alone) of at least BEND_SPACING x a prompt bend's tokens, before it may sit there


def features(prefill_tokens: int, prefill_attention: int, decodes: int, decode_context: int,
             bends: list[int] = (), prompt_bends: list[int] = ()) -> tuple:  # fmt: skip
    """The step's terms: per_decode's is the decodes up to the first bend, then one per bend (the
    decodes past it, up to the next); then one per prompt bend: the prompt tokens past it (what each
    costs beyond the rate before it)."""
    mixed = decodes if prefill_tokens else 0
    edges = [0, *bends, math.inf]
    stretches = [float(max(0, min(decodes, b) - a)) for a, b in zip(edges, edges[1:])]
    past = [float(max(0, prefill_tokens - b)) for b in prompt_bends]
    return (1.0, float(prefill_tokens), float(prefill_attention), stretches[0], float(decode_context), float(mixed),
            *stretches[1:], *past)  # fmt: skip


@dataclass(slots=True)
class StepCost:
    fixed: float = 0.0
    per_prefill_token: float = 0.0
    per_attention_pair: float = 0.0
    per_decode: float = 0.0
    per_decode_context: float = 0.0
    per_mixed_decode: float = 0.0  # what a decode adds beyond per_decode in a step that also reads prompt tokens
    gap: float = 0.0  # the worker's loop between two steps (messages, sending tokens)
    noise: list[float] = field(default_factory=list)  # quantiles of measured / modelled step time ([]: none)
    # A step's time past its prompt tokens (bound by memory) is (1 + co_runner x b) longer, b the share of the
    # box's other workers stepping past their own prompt tokens meanwhile (reading weights and KV too), and
    # (1 + co_runner_by_prompts x p) longer, p the share they spent on prompt tokens (bound by arithmetic);
    # co_runner_prompt and co_runner_prompt_by_prompts the same for the step's prompt tokens. None: the
    # factor it stands beside (co_runner_by_prompts: co_runner; co_runner_prompt_by_prompts:
    # co_runner_prompt; co_runner_prompt: co_runner), where the profile saw no steps to tell them apart.
    co_runner: float = 0.0
    co_runner_prompt: float | None = None
    co_runner_by_prompts: float | None = None
    co_runner_prompt_by_prompts: float | None = None
    # [[batch, rate], ...], batches rising: each decode past `batch` in a step costs `rate` (not per_decode)
    decode_bends: list[list[float]] = field(default_factory=list)
    # [[tokens, rate], ...], the same for the step's prompt tokens (not per_prefill_token)
    prefill_bends: list[list[float]] = field(default_factory=list)

    def seconds(self, prefill_tokens: int, prefill_attention: int, decodes: int, decode_context: int) -> float:
        return (self.fixed + self.prompt_seconds(prefill_tokens, prefill_attention)
                + self.decodes_seconds(decodes) + decode_context * self.per_decode_context
                + (decodes * self.per_mixed_decode if prefill_tokens else 0.0))  # fmt: skip

    def co_run_seconds(self, prefill_tokens: int, prefill_attention: int, decodes: int, decode_context: int,
                       busy: float, busy_prompt: float = 0.0) -> float:  # fmt: skip
        """seconds(), with a share `busy` of the box's other workers stepping meanwhile, `busy_prompt`
        of it on their prompt tokens."""
        alone = self.seconds(prefill_tokens, prefill_attention, decodes, decode_context)
        if not busy:
            return alone
        prompt = self.prompt_seconds(prefill_tokens, prefill_attention)
        rest_by_rest, rest_by_prompts, prompt_by_rest, prompt_by_prompts = self.co_factors()
        # written so that equal factors give what one factor times `busy` gives, to the last bit
        return ((alone - prompt) * (1 + rest_by_rest * busy + (rest_by_prompts - rest_by_rest) * busy_prompt)
                + prompt * (1 + prompt_by_rest * busy + (prompt_by_prompts - prompt_by_rest) * busy_prompt))  # fmt: skip

    def prompt_seconds(self, prefill_tokens: int, prefill_attention: int) -> float:
        """The prompt tokens' part of a step (bound by arithmetic; the rest is bound by memory)."""
        return _piecewise(prefill_tokens, self.per_prefill_token, self.prefill_bends) + prefill_attention * self.per_attention_pair

    def co_factors(self) -> tuple[float, float, float, float]:
        """(the rest beside the rest, the rest beside prompts, prompts beside the rest, prompts beside
        prompts), each None resolved to the factor it stands beside."""
        rest_by_prompts = self.co_runner if self.co_runner_by_prompts is None else self.co_runner_by_prompts
        prompt_by_rest = self.co_runner if self.co_runner_prompt is None else self.co_runner_prompt
        prompt_by_prompts = prompt_by_rest if self.co_runner_prompt_by_prompts is None else self.co_runner_prompt_by_prompts
        return self.co_runner, rest_by_prompts, prompt_by_rest, prompt_by_prompts

    def co_runner_text(self) -> str:
        """How co-runners slow a step, in words: 'x (1 + 0.26 x the share of co-located workers
        stepping)', with the factors that differ by what is slowed and what slows it."""
        rr, rp, pr, pp = (f"{k:.2f}" for k in self.co_factors())
        if rr == rp == pr == pp:
            return f"x (1 + {rr} x the share of co-located workers stepping)"
        if rr == rp and pr == pp:
            return f"x (1 + {rr} x the share of co-located workers stepping; prompt tokens {pr} x)"
        return (f"x (1 + {rr} x the share of co-located workers stepping past their prompt tokens + {rp} x the "
                f"share on prompt tokens; prompt tokens {pr} x and {pp} x)")  # fmt: skip

    def slowed_by_co_runners(self) -> bool:
        return any(self.co_factors())

    def decodes_seconds(self, decodes: int) -> float:
        """What the step's `decodes` cost on their own (not their context): per_decode each up to the
        first bend, then each bend's rate up to the next."""
        return _piecewise(decodes, self.per_decode, self.decode_bends)

    def bends_text(self, per: str = "/") -> str:
        """' (3.000 ms/decode past 4 in a step, 2.500 past 16)', or '' without bends."""
        return _bends_text(self.decode_bends, lambda rate: f"{rate * 1e3:.3f}", f" ms{per}decode")

    def prompt_bends_text(self, per: str = "/") -> str:
        """' (2.30 us/prompt token past 1024 in a step)', or '' without prompt bends."""
        return _bends_text(self.prefill_bends, lambda rate: f"{rate * 1e6:.2f}", f" us{per}prompt token")

    def decode_run_seconds(self, decodes: int, context: int, steps: int) -> list[float]:
        """seconds(0, 0, decodes, context + i * decodes) for i in range(steps), each the same float:
        a run of decode steps, each reply one token longer than at the step before."""
        base, per_context = self.fixed + self.decodes_seconds(decodes), self.per_decode_context
        return [base + (context + i * decodes) * per_context for i in range(steps)]

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return self.seconds(prompt_tokens, prompt_tokens * (prompt_tokens + 1) // 2, 0, 0)

    def decode_seconds(self, batch: int, context: float) -> float:
        return self.seconds(0, 0, batch, int(batch * context))


def _bends_text(bends: list[list[float]], number, unit: str) -> str:
    parts = [f"{number(rate)}{unit} past {edge:g} in a step" if i == 0 else f"{number(rate)} past {edge:g}"
             for i, (edge, rate) in enumerate(bends)]  # fmt: skip
    return f" ({', '.join(parts)})" if parts else ""


def _piecewise(count: int, rate: float, bends: list[list[float]]) -> float:
    """`count` things at `rate` each up to the first bend, then each bend's rate up to the next."""
    total, at = 0.0, 0
    for edge, next_rate in bends:
        if count <= edge:
            break
        total += (edge - at) * rate
        at, rate = edge, next_rate
    return total + (count - at) * rate


@dataclass(slots=True)
class Link:
    """One KV transfer: latency + bytes / bytes_per_s. blocks_writer: the writer's loop does the copy
    (shm writes in place), so its next step waits for it."""

    latency_s: float
    bytes_per_s: float
    blocks_writer: bool = False

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(slots=True)
class WorkerShape:
    num_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    kv_bytes_per_token: int = 0
    decode_headroom_tokens: int = 512  # booked in a decode seat (the dispatcher's default)
    workers_per_box: int = 1  # workers that share one machine's cores and memory (step.co_runner applies among them)


@dataclass(slots=True)
class Host:
    dispatch_s: float = 0.0  # request sent -> on its worker (HTTP, router, placing)
    token_s: float = 0.0  # a step's end -> its token at the client (relay, detokenizer, HTTP)
    token_quantiles: list[float] = field(default_factory=list)  # its measured spread ([]: always token_s)


@dataclass(slots=True)
class Profile:
    step: StepCost
    worker: WorkerShape
    links: dict[str, Link]
    host: Host
    source: str = "measured"  # or "estimate (roofline ...)": said in every output made from it
    about: dict = field(default_factory=dict)  # the machine, model, dtype, threads, fit quality, date
    points: dict = field(default_factory=dict)  # what the fits came from

    @property
    def is_estimate(self) -> bool:
        return self.source != "measured"

    def link(self, transport: str, gbps: float | None = None, latency_ms: float | None = None) -> Link:
        """The transport's measured link, or an emulated one (tcp at `gbps`, as serve's --kv-link-gbps)."""
        base = self.links.get(transport) or next(iter(self.links.values()), Link(0.0, math.inf))
        if gbps is None:
            return base
        latency = base.latency_s if latency_ms is None else latency_ms / 1e3
        return Link(latency, min(base.bytes_per_s, gbps * 1e9 / 8), blocks_writer=False)  # paced in the background

    def to_dict(self) -> dict:
        return {"minipd_profile": FORMAT, "source": self.source, "about": self.about, "step": asdict(self.step),
                "worker": asdict(self.worker), "links": {k: asdict(v) for k, v in self.links.items()},
                "host": asdict(self.host), "points": self.points}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if not isinstance(d, dict) or d.get("minipd_profile") != FORMAT:
            raise ValueError(f"not a minipd profile (format {FORMAT})")
        if not isinstance(d.get("links"), dict):
            raise ValueError("a profile needs a 'links' object")
        if isinstance(d.get("step"), dict):
            d = {**d, "step": _bends_from_knee(d["step"])}
        for where, part in (("step", StepCost), ("worker", WorkerShape), ("host", Host)):
            _check_fields(where, d.get(where), part)
        for name, link in d["links"].items():
            _check_fields(f"links.{name}", link, Link)
        profile = cls(StepCost(**d["step"]), WorkerShape(**d["worker"]),
                      {k: Link(**v) for k, v in d["links"].items()}, Host(**d["host"]), d.get("source", "measured"),
                      d.get("about", {}), d.get("points", {}))  # fmt: skip
        profile.check()
        return profile

    def check(self) -> None:
        """ValueError naming the first figure that no measurement could give (a negative time, NaN, no blocks)."""
        def number(where: str, value, low: float = 0.0, strict: bool = False) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low or (strict and value <= low):  # fmt: skip
                raise ValueError(f"{where} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")

        for name in (*TERMS, "gap", "co_runner"):
            number(f"step.{name}", getattr(self.step, name))
        for name in ("co_runner_prompt", "co_runner_by_prompts", "co_runner_prompt_by_prompts"):
            if getattr(self.step, name) is not None:
                number(f"step.{name}", getattr(self.step, name))
        for name, unit in (("decode_bends", "decode"), ("prefill_bends", "prompt token")):
            bends = getattr(self.step, name)
            if not isinstance(bends, list) or not all(isinstance(b, (list, tuple)) and len(b) == 2 for b in bends):
                raise ValueError(f"step.{name} must be a list of [{unit}s in a step, seconds per {unit}], got {bends!r}")
            for i, (edge, rate) in enumerate(bends):
                number(f"step.{name}[{i}] {unit}s", edge, 1)
                number(f"step.{name}[{i}] rate", rate)
                if edge != int(edge) or (i and edge <= bends[i - 1][0]):
                    raise ValueError(f"step.{name}' edges must be whole numbers of {unit}s, rising; got {edge!r}")
        for q in self.step.noise:
            number("step.noise", q, strict=True)
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            number(f"worker.{name}", getattr(self.worker, name), 1)
        for name in ("kv_bytes_per_token", "decode_headroom_tokens", "workers_per_box"):
            number(f"worker.{name}", getattr(self.worker, name))
        for name, link in self.links.items():
            number(f"links.{name}.latency_s", link.latency_s)
            if link.bytes_per_s != math.inf:
                number(f"links.{name}.bytes_per_s", link.bytes_per_s, strict=True)
        for name in ("dispatch_s", "token_s", "token_quantiles"):
            for value in getattr(self.host, name) if name == "token_quantiles" else [getattr(self.host, name)]:
                number(f"host.{name}", value)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _bends_from_knee(step: dict) -> dict:
    """A profile written before the bends had one knee: decodes past `decode_knee` cost
    `per_decode_past_knee` more each."""
    if "decode_knee" not in step and "per_decode_past_knee" not in step:
        return step
    step = dict(step)
    knee, extra = step.pop("decode_knee", 0), step.pop("per_decode_past_knee", 0.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (knee, extra, step.get("per_decode", 0.0))):
        return {**step, "decode_knee": knee, "per_decode_past_knee": extra}  # refused by the checks, in words
    if knee and extra:
        step["decode_bends"] = [[knee, step.get("per_decode", 0.0) + extra]]
    return step


def _check_fields(where: str, section, part) -> None:
    """ValueError unless `section` is an object with only `part`'s fields and every one it needs."""
    if not isinstance(section, dict):
        raise ValueError(f"a profile needs a '{where}' object")
    known = {f.name: f for f in fields(part)}
    if unknown := sorted(set(section) - set(known)):
        raise ValueError(f"{where} has field(s) this version does not know: {', '.join(map(str, unknown))}")
    needed = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    if missing := [n for n in needed if n not in section]:
        raise ValueError(f"{where} lacks {', '.join(missing)}")


def fit_steps(steps: list[dict]) -> tuple[StepCost, dict]:
    """Fit the step model on step events ({prefill_tokens, prefill_attention, decodes, decode_context,
    time, end}, and `co_busy`: the share of the box's other workers stepping meanwhile, 0 if absent).
    The linear terms come from steps that ran alone (co_busy < 0.1), the co-runner slowdowns from the
    others (what of their time went on prompt tokens told from the rest by the linear terms, which
    needs each step's `worker`); returns the model and its quality (relative errors on the steps it
    was fitted on)."""
    ys = np.array([s["end"] - s["time"] for s in steps])
    busy = np.array([s.get("co_busy", 0.0) for s in steps])
    keep = ys > 0
    steps, ys, busy = [s for s, k in zip(steps, keep) if k], ys[keep], busy[keep]
    alone = busy < 0.1
    bends = bends_to_fit([s["decodes"] for s, a in zip(steps, alone) if a])
    prompt_bends = prompt_bends_to_fit([s["prefill_tokens"] for s, a in zip(steps, alone) if a and not s["decodes"]])
    terms = len(TERMS) + len(bends) + len(prompt_bends)
    if alone.sum() < terms:
        raise ValueError(f"{int(alone.sum())} steps ran alone: too few to fit a step model of {terms} terms")
    xs = np.array([features(s["prefill_tokens"], s["prefill_attention"], s["decodes"], s["decode_context"], bends,
                            prompt_bends) for s in steps])  # fmt: skip
    coef = nonnegative_lstsq(xs[alone] / ys[alone, None], np.ones(int(alone.sum())))
    base = xs @ coef
    prompt_terms = [TERMS.index("per_prefill_token"), TERMS.index("per_attention_pair"),
                    *range(len(TERMS) + len(bends), terms)]  # fmt: skip
    prompt = xs[:, prompt_terms] @ coef[prompt_terms]  # the prompt tokens' share of each step
    busy_prompt = np.zeros(len(steps))
    if busy.any() and all("worker" in s for s in steps):
        share = np.divide(prompt, base, out=np.zeros(len(steps)), where=base > 0)
        busy_prompt = np.minimum(busy, co_overlap(steps, share))
    factors = fit_co_runners(ys, base, prompt, busy, busy_prompt, alone)
    rates = [float(c) for c in coef[len(TERMS):len(TERMS) + len(bends)]]
    per_token = float(coef[TERMS.index("per_prefill_token")])
    prompt_rates = [float(r) for r in per_token + np.cumsum(coef[len(TERMS) + len(bends):])]  # fitted as what each bend adds
    cost = StepCost(**dict(zip(TERMS, map(float, coef[:len(TERMS)]))), **factors,
                    decode_bends=_merge_bends(float(coef[TERMS.index("per_decode")]), bends, rates),
                    prefill_bends=_merge_bends(per_token, prompt_bends, prompt_rates))  # fmt: skip
    predicted = np.array([cost.co_run_seconds(s["prefill_tokens"], s["prefill_attention"], s["decodes"],
                                              s["decode_context"], u, p) for s, u, p in zip(steps, busy, busy_prompt)])  # fmt: skip
    rel = np.abs(predicted - ys) / ys
    quality = {"steps": int(len(ys)), "alone": int(alone.sum()), "median_abs_rel_error": float(np.median(rel)),
               "p90_abs_rel_error": float(np.percentile(rel, 90))}  # fmt: skip
    cost.noise = quantiles(ys / np.maximum(predicted, 1e-9)) if np.all(predicted > 0) else []
    return cost, quality


CO_EVIDENCE = 3  # steps in which a co-runner factor's term is most of the slowdown, before it is fitted apart


def fit_co_runners(ys, base, prompt, busy, busy_prompt, alone) -> dict:
    """StepCost's co-runner factors by least squares of y / base - 1 = the four factors, each times
    its part of the step (the rest or the prompt tokens, as a share of base) and the co-runners' busy
    share (past their prompt tokens, or on them). A factor is fitted apart only where at least
    CO_EVIDENCE steps are of its kind (mostly prompt or mostly the rest, beside mates mostly on
    prompts or mostly past them); else it is the one it stands beside: the rest's two factors as one,
    the prompt's two as one, and all four as one where either kind of step never ran beside another
    (a review found decode steps slowed 20x by a fit that guessed them)."""
    shared = ~alone & (base > 0)
    out = {"co_runner": 0.0, "co_runner_prompt": None, "co_runner_by_prompts": None, "co_runner_prompt_by_prompts": None}
    if shared.sum() < 5:
        return out
    b, bp, r = busy[shared], busy_prompt[shared], ys[shared] / base[shared] - 1
    rest_part, prompt_part = (base - prompt)[shared] / base[shared], prompt[shared] / base[shared]
    terms = np.column_stack([rest_part * (b - bp), rest_part * bp, prompt_part * (b - bp), prompt_part * bp])
    mostly_prompt, beside_prompts = prompt_part >= 0.5, bp >= 0.5 * b
    kinds = [~mostly_prompt & ~beside_prompts, ~mostly_prompt & beside_prompts, mostly_prompt & ~beside_prompts,
             mostly_prompt & beside_prompts]  # fmt: skip
    has = [int(k.sum()) >= CO_EVIDENCE for k in kinds]
    if not (has[0] or has[1]) or not (has[2] or has[3]):
        groups = [[0, 1, 2, 3]]
    else:
        groups = [[0, 1]] if not (has[0] and has[1]) else [[0], [1]]
        groups += [[2, 3]] if not (has[2] and has[3]) else [[2], [3]]
    k = nonnegative_lstsq(np.column_stack([terms[:, g].sum(axis=1) for g in groups]), r)
    factor = {i: float(k[j]) for j, g in enumerate(groups) for i in g}
    out["co_runner"] = factor[0]
    if len(groups) > 1:
        out["co_runner_prompt"] = factor[2]
        if len(groups[0]) == 1:
            out["co_runner_by_prompts"] = factor[1]
        if len(groups[-1]) == 1:
            out["co_runner_prompt_by_prompts"] = factor[3]
    return out


def bends_to_fit(decodes: list[int]) -> list[int]:
    """Where the decode term may bend: batch sizes measured (in at least BEND_MIN_STEPS steps), each
    at least BEND_SPACING times the one before and with sizes that far beyond it measured too (a
    stretch needs steps along it to be measured); at most MAX_BENDS, spread over the range."""
    sizes = sorted(d for d, n in Counter(decodes).items() if d > 0 and n >= BEND_MIN_STEPS)
    bends, last = [], sizes[0] if sizes else 0
    for d in sizes[1:-1]:
        if d >= BEND_SPACING * last and sizes[-1] >= BEND_SPACING * d:
            bends.append(d)
            last = d
    if len(bends) > MAX_BENDS:
        bends = [bends[round(i * (len(bends) - 1) / (MAX_BENDS - 1))] for i in range(MAX_BENDS)]
    return bends


def prompt_bends_to_fit(prompt_tokens: list[int]) -> list[int]:
    """Where the prompt term may bend: the largest step size (in prompt tokens) measured in at least
    BEND_MIN_STEPS steps with at least PROMPT_BEND_PAST steps of BEND_SPACING times as many tokens
    measured too; none if no size is."""
    counts = Counter(t for t in prompt_tokens if t > 0)
    for size in sorted(counts, reverse=True):
        if counts[size] >= BEND_MIN_STEPS and sum(n for t, n in counts.items() if t >= BEND_SPACING * size) >= PROMPT_BEND_PAST:
            return [size]
    return []


def _merge_bends(first: float, bends: list[int], rates: list[float]) -> list[list[float]]:
    """[[batch, rate], ...] without the bends where the rate does not change (beyond rounding)."""
    out, rate = [], first
    for batch, r in zip(bends, rates):
        if not math.isclose(r, rate, rel_tol=1e-6, abs_tol=1e-12):
            out.append([batch, r])
            rate = r
    return out


def co_busy(steps: list[dict]) -> None:
    """Mark each step event with `co_busy`: how much of its time the other workers (of one box) spent
    stepping, averaged over them (0: it ran alone; 1: every other worker stepped all along)."""
    for s, busy in zip(steps, co_overlap(steps, [1.0] * len(steps))):
        s["co_busy"] = busy


def co_overlap(steps: list[dict], weights) -> list[float]:
    """For each step, the other workers' (of one box) time stepping meanwhile, each of their steps
    counted at its weight (1: all of it), as a share of the step's time, averaged over them."""
    by_worker: dict = {}
    for s, weight in zip(steps, weights):
        by_worker.setdefault(s["worker"], []).append((s["time"], s["end"], weight))
    for spans in by_worker.values():
        spans.sort()
    others = len(by_worker) - 1
    longest = max((b - a for spans in by_worker.values() for a, b, _ in spans), default=0.0)
    out = []
    for s in steps:
        if others <= 0 or s["end"] <= s["time"]:
            out.append(0.0)
            continue
        total = 0.0
        for w, spans in by_worker.items():
            if w == s["worker"]:
                continue
            i = bisect.bisect_left(spans, (s["time"] - longest, 0.0, 0.0))
            for a, b, weight in spans[i:]:
                if a >= s["end"]:
                    break
                total += weight * max(0.0, min(b, s["end"]) - max(a, s["time"]))
        out.append(total / (others * (s["end"] - s["time"])))
    return out


def loop_gap(steps: list[dict], cap_s: float = GAP_CAP_S) -> float:
    """The median time between a worker's two steps when they ran back to back (closer than cap_s:
    the worker had work, so the gap is its own loop: messages, sending tokens)."""
    by_worker: dict = {}
    for s in steps:
        by_worker.setdefault(s["worker"], []).append((s["time"], s["end"]))
    gaps = []
    for spans in by_worker.values():
        spans.sort()
        gaps += [b[0] - a[1] for a, b in zip(spans, spans[1:]) if 0 <= b[0] - a[1] < cap_s]
    return float(np.median(gaps)) if gaps else 0.0


def quantiles(values, n: int = 21) -> list[float]:
    """n evenly spaced quantiles (0%, 5%, ..., 100% for 21): a distribution small enough to keep."""
    return [float(q) for q in np.percentile(np.asarray(values, dtype=float), np.linspace(0, 100, n))]


def draw(qs: list[float], u: float) -> float:
    """The value at uniform u in [0, 1) of the distribution whose quantiles are qs (linear between them)."""
    x = u * (len(qs) - 1)
    i = int(x)
    return qs[i] + (qs[i + 1] - qs[i]) * (x - i) if i + 1 < len(qs) else qs[-1]


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0, exactly, by trying every set of free terms, fewest first: where
    terms stand in for each other (a decode's context grows with the batch), the fit with fewer wins."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b * b))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = x
            res = float(np.sum((a @ full - b) ** 2))
            if res < best_res - 1e-15:
                best, best_res = full, res
    return best


def fit_link(points: list[tuple[int, float]], blocks_writer: bool) -> Link:
    """latency + bytes / bandwidth from (bytes, seconds) of measured transfers."""
    xs = np.array([float(b) for b, _ in points])
    ys = np.array([s for _, s in points])
    if len(points) >= 2 and np.ptp(xs) > 0:
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope > 0 and intercept >= 0:
            return Link(float(intercept), float(1 / slope), blocks_writer)
    return Link(0.0, float(np.sum(xs) / np.sum(ys)), blocks_writer)


# ---- estimates from published figures -------------------------------------------------------------


@dataclass(slots=True)
class Accelerator:
    """An accelerator's published figures and the efficiencies assumed (stated in every output)."""

    name: str
    memory_gb_s: float  # memory bandwidth
    tflops: float  # dense FLOP/s at the serving dtype
    link_gbps: float  # KV link between workers (Gb/s)
    memory_efficiency: float = 0.7
    compute_efficiency: float = 0.5
    link_efficiency: float = 0.8
    step_overhead_s: float = 2e-3  # launch and host work per step
    link_latency_s: float = 50e-6


ACCELERATORS = {
    "h100": Accelerator("H100 SXM (bf16)", 3350, 989, 400),
    "h200": Accelerator("H200 SXM (bf16)", 4800, 989, 400),
    "a100": Accelerator("A100 80GB SXM (bf16)", 2039, 312, 200),
    "l4": Accelerator("L4 (bf16)", 300, 121, 100),
}


def roofline(acc: Accelerator, params: float, kv_bytes_per_token: int, weight_bytes: float,
             worker: WorkerShape, host: Host | None = None) -> Profile:  # fmt: skip
    """A step costs the larger of reading the weights and KV (memory) and its FLOPs (compute):
    2 * params FLOPs per token, plus attention (2 * kv_bytes_per_token / bytes-per-value... folded
    into per_attention_pair); both at the stated efficiencies. An estimate, and labelled as one."""
    mem = acc.memory_gb_s * 1e9 * acc.memory_efficiency
    flops = acc.tflops * 1e12 * acc.compute_efficiency
    per_token_flops = 2 * params / flops
    # attention: for each (query, key) pair, q.k and p.v over every layer's heads ~ the KV bytes' worth of MACs
    per_pair = 2 * kv_bytes_per_token / 2 / flops
    step = StepCost(fixed=weight_bytes / mem + acc.step_overhead_s, per_prefill_token=per_token_flops,
                    per_attention_pair=per_pair, per_decode=per_token_flops, per_decode_context=kv_bytes_per_token / mem,
                    gap=0.0)  # fmt: skip
    link = Link(acc.link_latency_s, acc.link_gbps * 1e9 / 8 * acc.link_efficiency, blocks_writer=False)
    about = {"accelerator": asdict(acc), "params": params, "weight_bytes": weight_bytes,
             "note": "roofline estimate: max(memory, compute) approximated by their sum's dominant terms at the "
                     "stated efficiencies; not measured"}  # fmt: skip
    return Profile(step, worker, {"nvlink": link, "tcp": link, "shm": link}, host or Host(),
                   f"estimate (roofline, {acc.name})", about)  # fmt: skip
