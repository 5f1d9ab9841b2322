"""The advisor's simulator-backed model: the workers' own steps of the last minutes, fitted into a
step profile (sim/profile.py), and the traffic the router saw, replayed request by request through
the simulator (sim/cluster.py, minipd's own scheduler and block manager) under every candidate
mode. A mode's predicted goodput is the share of the replayed requests that meet both SLOs, per
second: what the planner's mean-value model cannot see (a reply stalled behind a long prompt read
on its worker, a queue that builds within the window) the replay does.

Plain functions on plain data: the advisor takes a snapshot on the event loop and runs these in a
thread."""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

from minipd.bench.metrics import RequestRecord
from minipd.bench.workloads import BenchRequest
from minipd.server.modes import Mode
from minipd.sim.cluster import Options, simulate
from minipd.sim.profile import Host, Link, Profile, WorkerShape, fit_link, fit_steps, loop_gap

MIN_STEPS = 3  # of each kind (steps that read prompt tokens; steps that only decode) before a fit
MAX_REPLAYED = 400  # requests replayed per candidate (the latest ones): bounds a decision's cost


@dataclass(slots=True)
class Arrival:
    time: float  # wall clock (time.time())
    prompt_tokens: int
    max_tokens: int | None
    output_tokens: int | None = None  # known once it finished
    key: str | None = None
    generated: int = 0  # tokens made so far, while it runs


def live_profile(steps: list[dict], transfers: list[tuple[int, float]], shape: WorkerShape, transport: str,
                 gap: float | None = None) -> tuple[Profile, dict] | None:  # fmt: skip
    """A profile from live step events ({worker, time, end, prefill_tokens, prefill_attention,
    decodes, decode_context}). Under live traffic the workers seldom step alone, and the steps that
    do are not a fair sample (a prompt read alone is rare), so the co-runner split of `fit_steps`
    does not hold: the terms are fitted on every step as it ran, and carry the co-runners' average
    slowdown themselves (co_runner 0). None until both kinds of step were seen."""
    reading = sum(1 for s in steps if s["prefill_tokens"])
    decoding = sum(1 for s in steps if s["decodes"] and not s["prefill_tokens"])
    if reading < MIN_STEPS or decoding < MIN_STEPS:
        return None
    cost, quality = fit_steps([dict(s, co_busy=0.0) for s in steps])
    cost.gap = loop_gap(steps) if gap is None else gap  # `steps` may be a sample, not steps back to back
    links = {transport: fit_link(transfers, blocks_writer=transport == "shm")} if transfers else {}
    if not links:  # no handoff measured yet: moving KV is taken as free
        links = {transport: Link(0.0, float("inf"))}
    return Profile(cost, shape, links, Host(), "measured (live steps)", {"step_fit": quality}), quality


def replay(profile: Profile, arrivals: list[Arrival], mode: Mode, num_workers: int, since: float,
           slo_ttft_s: float, slo_tpot_s: float, window_s: float, transport: str) -> dict:  # fmt: skip
    """Replay `arrivals` under `mode`; score those that arrived after `since` (the ones before it
    are there for the load they left). Returns mean TTFT and TPOT, their p90, SLO attainment and
    goodput (requests within both SLOs per second of the window)."""
    room = min(profile.worker.num_blocks * profile.worker.block_size, profile.worker.max_model_len)
    arrivals = [a for a in arrivals if a.prompt_tokens < room][-MAX_REPLAYED:]  # the others were refused at the door
    if not arrivals:
        return score([], slo_ttft_s, slo_tpot_s, window_s)
    t0 = arrivals[0].time
    done = sorted(a.output_tokens for a in arrivals if a.output_tokens is not None)
    fill = reply_fill(arrivals)
    requests = [BenchRequest(i, a.prompt_tokens, _reply_tokens(a, done, fill), a.time - t0, max_tokens=a.max_tokens)
                for i, a in enumerate(arrivals)]  # fmt: skip
    records, _ = simulate(profile, requests, mode, num_workers, Options(transport=transport, seed=0))
    scored = [r for r, a in zip(records, arrivals) if a.time >= since]
    return score(scored, slo_ttft_s, slo_tpot_s, window_s)


def score(records: list[RequestRecord], slo_ttft_s: float, slo_tpot_s: float, window_s: float) -> dict:
    ttfts = sorted(r.ttft for r in records if r.ttft is not None)
    tpots = sorted(r.tpot for r in records if r.tpot is not None)
    good = sum(r.meets(slo_ttft_s * 1e3, slo_tpot_s * 1e3) for r in records)
    return {"ttft_s": _mean(ttfts), "tpot_s": _mean(tpots), "ttft_p90_s": _p90(ttfts), "tpot_p90_s": _p90(tpots),
            "slo_attainment": good / len(records) if records else None, "goodput": good / window_s}  # fmt: skip


def reply_fill(arrivals: list[Arrival]) -> float | None:
    """How far the finished replies went into their max_tokens (the median share): 1.0 where
    replies run to their cap (a client that knows its lengths, as bench does), lower where
    max_tokens is a loose cap. None where no finished reply had one."""
    shares = sorted(a.output_tokens / a.max_tokens for a in arrivals if a.output_tokens is not None and a.max_tokens)
    return shares[len(shares) // 2] if shares else None


def _reply_tokens(a: Arrival, done: list[int], fill: float | None = None) -> int:
    """What the reply made, or for one still running (`generated` tokens so far): its max_tokens
    times the finished replies' `fill`, while it has made less than that; else the median of the
    finished replies longer than it, at most its max_tokens (a cap, often far above what a reply
    makes). A reply longer than every finished one is taken to go on as long again."""
    if a.output_tokens is not None:
        return max(1, a.output_tokens)
    if fill is not None and a.max_tokens and (expected := min(a.max_tokens, round(fill * a.max_tokens))) > a.generated:
        return max(1, expected)
    longer = done[bisect.bisect_right(done, a.generated):]  # `done` is sorted
    typical = longer[len(longer) // 2] if longer else (2 * a.generated if a.generated else 256)
    return max(1, a.generated + 1, min(typical, a.max_tokens or typical))


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _p90(xs: list[float]) -> float | None:
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None
