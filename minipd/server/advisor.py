"""`--mode auto`: every window the advisor takes the traffic it measured (arrival rate, prompt and
reply lengths) and the step times the workers reported, predicts each candidate mode's TTFT and
TPOT with the planner's queueing model (bench/plan.py), and switches live when the predicted
goodput of the best candidate beats the current mode's by more than `min_gain`, and was the best
the window before as well (hysteresis: a single noisy window does not flip the mode).

Every decision is kept with its prediction; one window later the measured outcome of that window
(TTFT, TPOT, SLO attainment, goodput) is put beside it, so the advisor can be judged by what it
did. The model's limits are the planner's: mean values (no tail), decode step time without its
context term (steps do not report context). Predicted goodput is DistServe's: the highest rate, up
to the one offered, at which the model meets both SLOs (so an overloaded server still picks the
mode that carries the most within its SLOs)."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace

from minipd.bench.plan import Profile, Traffic, _fit, colocated, decode_tpot, prefill_ttft
from minipd.server.modes import Mode

log = logging.getLogger("minipd.advisor")
KEPT_STEPS = 400  # per kind: the fits use the last ones (a quiet window keeps the older ones)
KEPT_ENTRIES = 500
CHUNK_CANDIDATES = (256, 512)


@dataclass(slots=True)
class AdvisorConfig:
    window_s: float = 30.0
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    min_gain: float = 0.1  # relative predicted-goodput gain a switch must promise
    min_requests: int = 5  # fewer arrived in a window: no decision


@dataclass(slots=True)
class Finished:
    arrival: float
    end: float
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None


class Advisor:
    def __init__(self, router, config: AdvisorConfig | None = None):
        self.router = router
        self.config = config or AdvisorConfig()
        self.enabled = False
        self.prefill_steps: deque[tuple[int, float]] = deque(maxlen=KEPT_STEPS)  # (prompt tokens, seconds)
        self.decode_steps: deque[tuple[int, float]] = deque(maxlen=KEPT_STEPS)  # (batch, seconds)
        self.transfers: deque[tuple[int, float]] = deque(maxlen=KEPT_STEPS)  # (bytes, seconds)
        self.finished: deque[Finished] = deque()
        self.arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, max_tokens)
        self.outputs: deque[int] = deque(maxlen=KEPT_STEPS)  # reply lengths of the requests that finished
        self.entries: deque[dict] = deque(maxlen=KEPT_ENTRIES)
        self.last_best: str | None = None
        self.task: asyncio.Task | None = None

    # ---- what the router reports ----------------------------------------------------------------
    def on_arrival(self, t: float, prompt_tokens: int, max_tokens: int) -> None:
        self.arrivals.append((t, prompt_tokens, max_tokens))

    def on_step(self, prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        if prefill_tokens and not num_decodes:
            self.prefill_steps.append((prefill_tokens, seconds))
        elif num_decodes and not prefill_tokens:
            self.decode_steps.append((num_decodes, seconds))

    def on_transfer(self, num_bytes: int, seconds: float | None) -> None:
        if num_bytes and seconds:
            self.transfers.append((num_bytes, seconds))

    def on_finished(self, timeline: dict) -> None:
        if timeline["finish_reason"] in ("error", "abort"):
            return
        self.outputs.append(timeline["output_tokens"])
        self.finished.append(Finished(timeline["arrival"], timeline["events"].get("finish", time.time()),
                                      timeline["prompt_tokens"], timeline["output_tokens"], timeline["ttft"],
                                      timeline["tpot"]))  # fmt: skip

    # ---- the loop -------------------------------------------------------------------------------
    def enable(self, on: bool = True) -> None:
        self.enabled = on
        if on and self.task is None:
            self.task = self.router.spawn(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.window_s)
            if not self.enabled:
                continue
            try:
                entry = self.decide(time.time())
                if entry.get("switch_to") is not None:
                    outcome = await self.router.set_mode(Mode(**entry["switch_to"]))
                    entry["switch"] = {k: outcome.get(k) for k in ("seconds", "moved", "bytes", "changed")}
            except Exception:
                log.exception("the advisor's window failed")

    # ---- one decision -------------------------------------------------------------------------
    def decide(self, now: float) -> dict:
        cfg = self.config
        start = now - cfg.window_s
        while self.arrivals and self.arrivals[0][0] < start:
            self.arrivals.popleft()
        window = [f for f in self.finished if f.end >= start]
        self.finished = deque(window)
        measured = self._measured(window)
        if self.entries and "measured_next" not in self.entries[-1]:
            self.entries[-1]["measured_next"] = measured  # what the last decision led to
        current = self.router.mode
        entry = {"time": now, "window_s": cfg.window_s, "current": current.as_dict(), "measured": measured,
                 "switch_to": None}  # fmt: skip
        profile = self.profile()
        if len(self.arrivals) < cfg.min_requests or profile is None:
            entry["decision"] = "wait: too little traffic or too few steps measured to predict"
            return self._publish(entry)
        prompts = sorted(a[1] for a in self.arrivals)
        replies = self.outputs or [a[2] for a in self.arrivals]  # no reply finished yet: their max_tokens
        traffic = Traffic(len(self.arrivals) / cfg.window_s, statistics.fmean(prompts), statistics.fmean(replies))
        candidates = self.predict(profile, traffic, prompts)
        entry["traffic"] = {"rate": traffic.rate, "prompt_tokens": traffic.prompt_tokens,
                            "output_tokens": traffic.output_tokens}  # fmt: skip
        entry["profile"] = {k: v for k, v in profile.as_dict().items() if k != "points"}
        entry["predictions"] = candidates
        best = max(candidates, key=lambda c: (c["goodput"], c["slo_margin"] or 0.0))
        here = candidates[0]  # the current mode
        gain = (best["goodput"] - here["goodput"]) / max(here["goodput"], 1e-3 * traffic.rate)
        entry.update(best=best["label"], predicted_gain=gain)
        steady = self.last_best == best["label"]
        self.last_best = best["label"]
        if best["label"] == here["label"]:
            entry["decision"] = f"stay: {here['label']} is predicted best"
        elif gain <= cfg.min_gain:
            entry["decision"] = f"stay: {best['label']} is predicted only {gain:+.0%} (threshold {cfg.min_gain:.0%})"
        elif not steady:
            entry["decision"] = f"wait: {best['label']} is predicted {gain:+.0%}; switching if it is best again"
        else:
            entry["decision"] = f"switch to {best['label']}: predicted goodput {gain:+.0%}"
            entry["switch_to"] = best["mode"]
        return self._publish(entry)

    def _publish(self, entry: dict) -> dict:
        self.entries.append(entry)
        self.router.events.publish({"type": "advisor", **{k: v for k, v in entry.items() if k != "predictions"}})
        return entry

    def _measured(self, window: list[Finished]) -> dict:
        cfg = self.config
        good = [
            f for f in window if f.ttft is not None and f.ttft <= cfg.slo_ttft_s and (f.tpot or 0.0) <= cfg.slo_tpot_s
        ]
        ttfts = [f.ttft for f in window if f.ttft is not None]
        tpots = [f.tpot for f in window if f.tpot is not None]
        return {"requests": len(window), "goodput": len(good) / cfg.window_s,
                "slo_attainment": len(good) / len(window) if window else None,
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                "tpot_mean_s": statistics.fmean(tpots) if tpots else None}  # fmt: skip

    # ---- the model ------------------------------------------------------------------------------
    def profile(self) -> Profile | None:
        if len(self.prefill_steps) < 3 or len(self.decode_steps) < 3:
            return None
        a, b = _fit(*map(list, zip(*self.prefill_steps)))
        c0, c1 = _fit(*map(list, zip(*self.decode_steps)))
        moved, took = sum(x for x, _ in self.transfers), sum(s for _, s in self.transfers)
        bandwidth = moved / took if took else float("inf")  # no handoff measured yet: taken as free
        info = next((w.info for w in self.router.pool.workers if w.info is not None), None)
        return Profile(a, b, c0, c1, 0.0, b, info.kv_bytes_per_token if info else 0, bandwidth,
                       {"prefill_steps": len(self.prefill_steps), "decode_steps": len(self.decode_steps),
                        "transfers": len(self.transfers)})  # fmt: skip

    def predict(self, p: Profile, t: Traffic, prompts: list[int]) -> list[dict]:
        """The current mode and each candidate: mean TTFT and TPOT, SLO margin, predicted goodput."""
        n = len(self.router.pool.workers)
        cur = self.router.mode
        base = replace(cur, local_prefill_tokens=0, workers=None)
        modes = [cur, replace(base, name="colocated")]
        modes += [replace(base, name="chunked", chunk_tokens=c) for c in CHUNK_CANDIDATES]
        for prefill in range(1, n):
            split = replace(base, name="disagg", prefill_workers=prefill, decode_workers=n - prefill)
            modes.append(split)
            modes += [replace(split, local_prefill_tokens=q) for q in sorted({_quantile(prompts, 0.5), _quantile(prompts, 0.9)})
                      if q > prompts[0]]  # fmt: skip
        out = []
        for mode in modes:
            if all(Mode(**row["mode"]) != mode for row in out):
                out.append(self._row(mode, p, t, prompts, n))
        return out

    def _row(self, mode: Mode, p: Profile, t: Traffic, prompts: list[int], n: int) -> dict:
        ttft, tpot = _predict(p, t, prompts, mode, n)
        margin = self._margin(ttft, tpot)
        goodput = t.rate
        if margin < 1:  # the highest rate that meets both SLOs
            lo, hi = 0.0, t.rate
            for _ in range(20):
                mid = (lo + hi) / 2
                lo, hi = (
                    (mid, hi) if self._margin(*_predict(p, replace(t, rate=mid), prompts, mode, n)) >= 1 else (lo, mid)
                )
            goodput = lo
        return {"label": _label(mode), "mode": _mode_fields(mode), "ttft_s": _finite(ttft), "tpot_s": _finite(tpot),
                "slo_margin": _finite(margin), "goodput": goodput}  # fmt: skip

    def _margin(self, ttft: float, tpot: float) -> float:
        cfg = self.config
        return min(cfg.slo_ttft_s / ttft if ttft else float("inf"), cfg.slo_tpot_s / tpot if tpot else float("inf"))


def _predict(p: Profile, t: Traffic, prompts: list[int], mode: Mode, n: int) -> tuple[float, float]:
    """(mean TTFT, TPOT) of a mode, by the planner's model."""
    if mode.name == "colocated":
        return colocated(p, t, mode.workers or n)
    if mode.name == "chunked":
        return _chunked(p, t, mode.workers or n, mode.chunk_tokens)
    if mode.local_prefill_tokens:
        return _local_prefill(p, t, prompts, mode.local_prefill_tokens, mode.prefill_workers, mode.decode_workers)
    return prefill_ttft(p, t, mode.prefill_workers), decode_tpot(p, t, mode.decode_workers)[0]


def _label(mode: Mode) -> str:
    if mode.name == "chunked":
        return f"chunked:{mode.chunk_tokens}" + (f" on {mode.workers}" if mode.workers else "")
    if mode.name == "disagg":
        local = f" local<{mode.local_prefill_tokens}" if mode.local_prefill_tokens else ""
        return f"disagg:{mode.prefill_workers}p{mode.decode_workers}d{local}"
    return "colocated" + (f" on {mode.workers}" if mode.workers else "")


def _chunked(p: Profile, t: Traffic, workers: int, chunk: int) -> tuple[float, float]:
    """Every step carries the decodes and up to `chunk` prompt tokens: TPOT is a decode step plus
    the prompt tokens a step reads; TTFT is the prompt's chunks, each one such step, at least."""
    tpot0, _ = decode_tpot(p, t, workers)
    load = t.rate / workers * t.prompt_tokens  # prompt tokens per second per worker
    if tpot0 == float("inf") or p.prefill_per_token_s * load >= 1:
        return float("inf"), float("inf")
    step = tpot0 / (1 - p.prefill_per_token_s * load)
    if load * step > chunk:
        step = tpot0 + p.prefill_fixed_s + p.prefill_per_token_s * chunk
    ttft = max(-(-t.prompt_tokens // chunk) * step, prefill_ttft(p, t, workers, link_bytes_s=float("inf")))
    return ttft, step


def _local_prefill(p: Profile, t: Traffic, prompts: list[int], threshold: int, prefill: int, decode: int):
    """Prompts under `threshold` are read by their decode worker (co-located there); the rest go to
    the prefill workers. Returns (mean TTFT, TPOT)."""
    short = [x for x in prompts if x < threshold]
    long = [x for x in prompts if x >= threshold]
    share = len(short) / len(prompts)
    ttft = 0.0
    if long:
        ttft += (1 - share) * prefill_ttft(
            p, Traffic(t.rate * (1 - share), statistics.fmean(long), t.output_tokens), prefill
        )
    rho = 0.0
    if short:
        local = Traffic(t.rate * share, statistics.fmean(short), t.output_tokens)
        ttft += share * prefill_ttft(p, local, decode, link_bytes_s=float("inf"))
        rho = local.rate / decode * (p.prefill_fixed_s + p.prefill_per_token_s * local.prompt_tokens)
    tpot, _ = decode_tpot(p, t, decode)
    return ttft, (tpot / (1 - rho) if rho < 1 else float("inf"))


def _quantile(xs: list[int], q: float) -> int:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _finite(x: float) -> float | None:
    return x if x == x and x != float("inf") else None


def _mode_fields(mode: Mode) -> dict:
    return {"name": mode.name, "prefill_workers": mode.prefill_workers, "decode_workers": mode.decode_workers,
            "chunk_tokens": mode.chunk_tokens, "workers": mode.workers, "kv_link_gbps": mode.kv_link_gbps,
            "kv_link_latency_ms": mode.kv_link_latency_ms, "local_prefill_tokens": mode.local_prefill_tokens}  # fmt: skip
