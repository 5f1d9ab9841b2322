"""Serving metrics with vLLM's `benchmark_serving` definitions, and DistServe's goodput (a rate search).

- TTFT: request sent -> first token at the client. E2E: request sent -> end of the stream.
- TPOT: (E2E - TTFT) / (output tokens - 1); undefined (None) for a one-token reply and left out of
  the TPOT statistics; such a request meets any TPOT SLO (vLLM counts its TPOT as 0).
- ITL: the gaps between consecutive streamed chunks of one request.
- Goodput (vLLM): completed requests that meet every given SLO, per second of the run.
- SLO attainment: the fraction of all requests that meet every given SLO (a failure is a miss).
- Goodput (DistServe): the highest request rate at which >= 90% of requests meet both the TTFT and
  the TPOT SLO, divided by the number of workers (GPUs in the paper).
Percentiles interpolate linearly between samples, as numpy's default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

STATS = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_len: int
    output_len_wanted: int
    send_time: float  # time.time() when the request was sent
    token_times: list[float] = field(default_factory=list)  # time.time() of each streamed token chunk
    output_tokens: int = 0
    error: str | None = None
    server_timeline: dict | None = None  # minipd's `timeline` extension, when the server sends one
    end_time: float | None = None  # time.time() when the stream ended ([DONE] or an error)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        end = self.end_time if self.end_time is not None else (self.token_times[-1] if self.token_times else None)
        return None if end is None else end - self.send_time

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens <= 1:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def kv_transfer_seconds(self) -> float | None:
        kv = (self.server_timeline or {}).get("kv_transfer") or {}
        return kv.get("seconds")

    def meets(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2e_ms: float | None = None) -> bool:  # fmt: skip
        """Completed and within every given SLO."""
        if not self.ok or self.ttft is None:
            return False
        checks = ((slo_ttft_ms, self.ttft), (slo_tpot_ms, self.tpot), (slo_e2e_ms, self.e2e))
        return all(slo is None or value is None or value * 1000 <= slo for slo, value in checks)


def percentile(values: Iterable[float], q: float) -> float | None:
    v = list(values)
    return float(np.percentile(v, q)) if v else None


def describe(values: Iterable[float], name: str, scale: float = 1000.0) -> dict[str, float | None]:
    """mean/median/p90/p99 of `values` (seconds, reported x scale) as {"mean_<name>": ...}."""
    v = np.asarray(list(values), dtype=float) * scale
    out: dict[str, float | None] = {}
    for stat, q in STATS:
        out[f"{stat}_{name}"] = None if v.size == 0 else float(v.mean() if q is None else np.percentile(v, q))
    return out


def latency_samples(done: list[RequestRecord]) -> dict[str, list[float]]:
    """The completed requests' TTFT, TPOT and ITL samples (seconds) that a run's percentiles are taken from."""
    return {"ttft": [r.ttft for r in done if r.ttft is not None], "tpot": [r.tpot for r in done if r.tpot is not None],
            "itl": [gap for r in done for gap in r.itls]}  # fmt: skip


def summarize(
    records: list[RequestRecord],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
) -> dict:
    """One run's numbers, with vLLM's names and units (ms, requests/s, tokens/s)."""
    done = [r for r in records if r.ok]
    has_slo = any(s is not None for s in (slo_ttft_ms, slo_tpot_ms, slo_e2e_ms))
    good = sum(r.meets(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms) for r in records) if has_slo else None
    in_tokens = sum(r.prompt_len for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else float("nan")
    out: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": out_tokens * per_s,
        "total_token_throughput": (in_tokens + out_tokens) * per_s,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_e2e_ms": slo_e2e_ms,
        "goodput": None if good is None else good * per_s,
        "slo_attainment": None if good is None or not records else good / len(records),
    }
    for name, values in latency_samples(done).items():
        out |= describe(values, f"{name}_ms")
    out |= describe((r.e2e for r in done if r.e2e is not None), "e2e_ms")
    kv = [(r.kv_transfer_seconds, r.ttft) for r in done if r.kv_transfer_seconds is not None]
    if kv:
        out["kv_transfer_count"] = len(kv)
        out |= describe((s for s, _ in kv), "kv_transfer_ms")
        out |= describe((s / t for s, t in kv if t), "kv_transfer_share_of_ttft", scale=1.0)
    return out


def at_least(search: dict, target: float = 0.9) -> str:
    """">= " when no probe of a goodput search failed: its goodput is then only a lower bound (the search's
    ceiling, or where it ran out of probes)."""
    return ">= " if all(a >= target for _, a in search["probes"]) else ""


def distserve_goodput(
    attainment_at_rate: Callable[[float], float],
    *,
    lo: float,
    hi: float,
    target: float = 0.9,
    tolerance: float = 0.1,
    max_runs: int = 12,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate in [lo/2^k, hi] whose SLO attainment is >= target, and every (rate, attainment) probed.

    Doubles the rate from `lo` until a probe fails (or halves it while `lo` fails), then bisects until
    the passing and failing rates are within `tolerance` (requests/s) or `max_runs` probes were made.
    Assumes attainment falls with rate. Returns 0.0 when no probed rate passed.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo}, hi={hi}")
    runs: list[tuple[float, float]] = []

    def passes(rate: float) -> bool:
        a = attainment_at_rate(rate)
        runs.append((rate, a))
        return a >= target

    good, bad = 0.0, None
    rate = lo
    if passes(rate):
        good = rate
        while len(runs) < max_runs and good < hi:
            rate = min(good * 2, hi)
            if not passes(rate):
                bad = rate
                break
            good = rate
        if bad is None:
            return good, runs
    else:
        bad = rate
        while len(runs) < max_runs:
            rate = bad / 2
            if passes(rate):
                good = rate
                break
            bad = rate
        if good == 0.0:
            return 0.0, runs
    while len(runs) < max_runs and bad - good > tolerance:
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    return good, runs


def per_worker(rate: float, num_workers: int) -> float:
    """DistServe reports goodput per GPU: the sustained rate divided by the workers serving it."""
    return rate / max(1, num_workers)
