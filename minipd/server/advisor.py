"""`--mode auto`: every window (or earlier, see Advisor.decision_due) the advisor takes the traffic it measured (each request's arrival,
prompt and reply length) and the step times the workers reported, predicts each candidate mode's
goodput under the configured SLOs, and switches live to the best candidate when it beats the
current mode by more than `min_gain` and the current mode was predicted behind by that much the
window before as well (hysteresis: a single noisy window does not flip the mode), or at once when
the gain passes `decisive_gain` (the current mode predicted to do less than half as well), or
`credited_decisive_gain` where the current mode is judged by what it measured (its own measurement,
not only the replay, says it falls short).

Two models predict (`model`):
- "sim" (the default): the workers' own steps fitted into a step profile, and the window's requests
  replayed through the simulator under each candidate (server/advisor_sim.py). It sees tails: a
  reply stalled behind a long prompt read on its worker, a queue that builds.
- "planner": the planner's mean-value queueing model (bench/plan.py). Cheap, but blind to tails
  (mean TPOT, no stall); kept to compare.

The current mode is also judged by what it measured (its own finished and running requests), and
a candidate that ran recently and measured below its prediction is discounted by that share (see
_measured_credit and _discount); a switch still needs the replay to rank the candidate ahead of the
current mode's own prediction.

Every decision is kept with its prediction; one window later the measured outcome of that window
(TTFT, TPOT, SLO attainment, goodput) is put beside it, so the advisor can be judged by what it
did. Predicted goodput: "sim", requests within both SLOs per second; "planner", DistServe's, the
highest rate up to the one offered at which the model meets both SLOs."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace

from minipd.bench.plan import Profile, Traffic, _fit, colocated, decode_tpot, prefill_ttft
from minipd.server import advisor_sim
from minipd.server.advisor_sim import Arrival
from minipd.server.errors import ServeError
from minipd.server.modes import Mode
from minipd.server.step_sample import StepSample
from minipd.sim.profile import Profile as StepProfile
from minipd.sim.profile import WorkerShape, loop_gap

log = logging.getLogger("minipd.advisor")
KEPT_STEPS = 800  # transfers, reply lengths and step spans for the loop's gap: the last ones (a quiet window keeps older ones)
KEPT_ENTRIES = 500
EARLY_CHECK_S = 1.0  # how often the loop looks whether a decision is due early (decision_due)
MIN_TOKENS_TO_JUDGE = 8  # a running reply's TPOT so far counts from this many tokens
CHUNK_CANDIDATES = (256, 512)
GOODPUT_MEANING = {"sim": "predicted: the window's requests replayed in the simulator, those within both SLOs per second",
                   "planner": "predicted: the highest rate up to the offered one at which the model meets both SLOs"}  # fmt: skip


@dataclass(slots=True)
class AdvisorConfig:
    window_s: float = 30.0
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    min_gain: float = 0.1  # relative predicted-goodput gain a switch must promise
    decisive_gain: float = 1.0  # a gain above this switches after one window instead of two
    credited_decisive_gain: float = 0.5  # the same where the current mode is judged by what it measured
    min_requests: int = 5  # fewer arrived in a window: no decision
    model: str = "sim"  # or "planner" (see the module's docstring)
    profile: StepProfile | None = None  # "sim": a measured profile (`minipd profile`) instead of the live fit
    history_s: float = 60.0  # "sim": arrivals before the window replayed too, for the load they left (a backlog)
    credit_measured: bool = True  # judge the current mode by its measured SLO attainment where it is worse
    credited_min_gain: float = 0.3  # the gain a switch must promise over a current mode judged so


@dataclass(slots=True)
class Finished:
    arrival: float
    end: float
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None


@dataclass(slots=True)
class Snapshot:
    """What one decision reads, copied on the event loop (the prediction runs in a thread)."""

    now: float
    arrivals: list[Arrival]  # the window's and history_s before it (for the load they left)
    steps: list[dict]
    transfers: list[tuple[int, float]]
    outputs: list[int]
    current: Mode
    num_workers: int
    shape: WorkerShape
    transport: str
    gap: float  # a worker's own loop between two steps back to back (seconds)


class Advisor:
    def __init__(self, router, config: AdvisorConfig | None = None):
        self.router = router
        self.config = config or AdvisorConfig()
        self.enabled = False
        self.steps = StepSample()  # step events (worker, time, end and the step's shape): the fits' sample
        self.recent_steps: deque[dict] = deque(maxlen=KEPT_STEPS)  # the same step events, back to back: the loop's gap
        self.transfers: deque[tuple[int, float]] = deque(maxlen=KEPT_STEPS)  # (bytes, seconds)
        self.finished: deque[Finished] = deque()
        self.arrivals: deque[Arrival] = deque()
        self.by_key: dict[str, Arrival] = {}
        self.outputs: deque[int] = deque(maxlen=KEPT_STEPS)  # reply lengths of the requests that finished
        self.entries: deque[dict] = deque(maxlen=KEPT_ENTRIES)
        self.mode_since = 0.0  # when the mode last changed, as far as the advisor saw
        self.inherited_until = 0.0  # when the last request admitted before mode_since ended
        self.last_mode: dict | None = None
        self.behind = 0  # windows in a row in which the current mode was predicted behind by > min_gain
        self.last_decision = 0.0  # when the loop's last decision (and its switch) ended (time.time())
        self.measured_share: dict[str, tuple[float, float]] = {}  # mode family -> (when, measured / predicted goodput)
        self.task: asyncio.Task | None = None

    # ---- what the router reports ----------------------------------------------------------------
    def on_arrival(self, t: float, prompt_tokens: int, max_tokens: int | None, key: str | None = None) -> None:
        a = Arrival(t, prompt_tokens, max_tokens, key=key)
        self.arrivals.append(a)
        if key is not None:
            self.by_key[key] = a
        self._forget(t)

    def on_step(self, worker: int, start: float, end: float, prefill_tokens: int, decodes: int,
                prefill_attention: int | None = None, decode_context: int = 0) -> None:  # fmt: skip
        if prefill_attention is None:  # a worker that does not report it: as if each prompt were read whole
            prefill_attention = prefill_tokens * (prefill_tokens + 1) // 2
        step = {"worker": worker, "time": start, "end": end, "prefill_tokens": prefill_tokens,
                "prefill_attention": prefill_attention, "decodes": decodes, "decode_context": decode_context}
        self.steps.add(step)
        self.recent_steps.append(step)

    def on_transfer(self, num_bytes: int, seconds: float | None) -> None:
        if num_bytes and seconds:
            self.transfers.append((num_bytes, seconds))

    def on_finished(self, timeline: dict) -> None:
        a = self.by_key.pop(timeline.get("request_id"), None)
        if timeline["finish_reason"] in ("error", "abort"):
            return
        if a is not None:
            a.output_tokens = timeline["output_tokens"]
        end = timeline["events"].get("finish", time.time())
        if timeline["arrival"] < self.mode_since:
            self.inherited_until = max(self.inherited_until, end)
        self.outputs.append(timeline["output_tokens"])
        self.finished.append(Finished(timeline["arrival"], end, timeline["prompt_tokens"], timeline["output_tokens"],
                                      timeline["ttft"], timeline["tpot"]))  # fmt: skip
        self._forget(self.finished[-1].end)

    def _forget(self, now: float) -> None:
        """Keep a window and its history of arrivals, and a window of finished requests (bounded whether
        auto is on or not)."""
        cutoff = now - self.config.window_s - self.config.history_s
        while self.arrivals and self.arrivals[0].time < cutoff:
            self.by_key.pop(self.arrivals.popleft().key, None)
        while self.finished and self.finished[0].end < now - self.config.window_s:
            self.finished.popleft()

    # ---- the loop -------------------------------------------------------------------------------
    def enable(self, on: bool = True) -> None:
        if on and not self.enabled:  # afresh: what was counted when auto was last on is stale
            self.behind, self.last_decision = 0, time.time()
        self.enabled = on
        if on and self.task is None:
            self.task = self.router.spawn(self._run())

    def decision_due(self, now: float) -> str | None:
        """"window" at the window's end; "early" from half a window after the last decision when
        most of the current mode's own running replies (at least min_requests) are already past an
        SLO: a mode failing at a phase's turn is seen then, not up to a window later. An early decision
        measures the requests since its failing replies began (_early_span): a few seconds chosen
        because they fail, so it switches only on a decisive lead and is not a window (_close)."""
        since = now - self.last_decision
        if since >= self.config.window_s:
            return "window"
        if since < self.config.window_s / 2:
            return None
        running = self._running_so_far(now, self._own_requests_since(now))
        if len(running) >= self.config.min_requests and 2 * sum(running) < len(running):
            return "early"
        return None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(EARLY_CHECK_S, self.config.window_s / 4))
            if not self.enabled:  # enable() restarts the window when auto comes back on
                continue
            now, due = time.time(), None
            try:
                due = self.decision_due(now)
                if due is None:
                    continue
                snap, entry = self._open(now, due)
                if snap is not None:  # the replays take a fraction of a second: off the event loop
                    entry = await asyncio.to_thread(self._predict, snap, entry)
                entry = self._close(entry)
                if entry.get("switch_to") is not None and self.enabled:
                    try:
                        outcome = await self.router.set_mode(Mode(**entry["switch_to"]))
                    except ServeError as err:  # e.g. a worker drained by hand holds a role it would need
                        entry["switch"] = {"changed": False, "error": str(err)}
                        continue
                    self.mode_since, self.last_mode = time.time(), self.router.mode.as_dict()
                    entry["switch"] = {k: outcome.get(k) for k in ("seconds", "moved", "bytes", "changed")}
            except Exception:
                log.exception("the advisor's window failed")
            finally:
                if due is not None:  # the next window counts from the end of this decision and its switch
                    self.last_decision = time.time()

    # ---- one decision -------------------------------------------------------------------------
    def decide(self, now: float, due: str = "window") -> dict:
        """One decision, all on the caller's thread."""
        snap, entry = self._open(now, due)
        return self._close(self._predict(snap, entry) if snap is not None else entry)

    def _open(self, now: float, due: str = "window") -> tuple[Snapshot | None, dict]:
        """Measure the window that ended, and copy what the prediction needs (None: too little). An
        early decision measures and replays the requests that arrived since its failing replies
        began (_early_span): the turn that made it early, not the phase before it."""
        cfg = self.config
        self._forget(now)
        if self.entries and "measured_next" not in self.entries[-1]:  # what the last decision led to: a window
            self.entries[-1]["measured_next"] = self._measured([f for f in self.finished if f.end >= now - cfg.window_s])
        current = self.router.mode
        if self.last_mode is not None and current.as_dict() != self.last_mode:
            self.mode_since = max(self.mode_since, now - cfg.window_s / 2)  # switched by hand within the window
        self.last_mode = current.as_dict()
        own = self._own_requests_since(now)
        early = due == "early"
        span = self._early_span(now, own) if early else cfg.window_s
        start = now - span
        window = [f for f in self.finished if f.end >= start and (not early or f.arrival >= start)]
        measured = self._measured(window, span=span)
        running = self._running_so_far(now, max(own, start) if early else own)
        entry = {"time": now, "window_s": span, "due": due, "model": cfg.model, "current": current.as_dict(),
                 "measured": measured, "switch_to": None,
                 "measured_current": self._measured([f for f in window if f.arrival >= own], running, span)}  # fmt: skip
        arrived = [a for a in self.arrivals if a.time >= start]
        if len(arrived) < cfg.min_requests:
            entry["decision"] = "wait: too little traffic to predict"
            return None, entry
        arrivals = [replace(a) for a in self.arrivals]
        for a in arrivals:
            state = self.router.requests.get(a.key) if a.output_tokens is None else None
            if state is not None:
                a.generated = len(state.output_token_ids)
        snap = Snapshot(now, arrivals, self.steps.steps(now), list(self.transfers), list(self.outputs), current,
                        len(self.router.pool.workers), self._shape(), getattr(self.router, "kv_transport", "shm"),
                        loop_gap(list(self.recent_steps)))  # fmt: skip
        return snap, entry

    def _predict(self, snap: Snapshot, entry: dict) -> dict:
        """Every candidate's prediction (runs in a thread: it reads only the snapshot), with what it cost:
        wall seconds, and CPU seconds of this thread (taken from the workers on a machine without a
        core to spare, and holding the main process's GIL, which streams the replies, meanwhile)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._predict_all(snap, entry)
        finally:
            entry["predict_seconds"] = time.perf_counter() - wall
            entry["predict_cpu_seconds"] = time.thread_time() - cpu

    def _predict_all(self, snap: Snapshot, entry: dict) -> dict:
        cfg = self.config
        span = entry["window_s"]
        arrived = [a for a in snap.arrivals if a.time >= snap.now - span]
        prompts = sorted(a.prompt_tokens for a in arrived)
        replies = snap.outputs or [a.max_tokens or 256 for a in arrived]  # none finished yet: their max_tokens
        traffic = Traffic(len(arrived) / span, statistics.fmean(prompts), statistics.fmean(replies))
        entry["traffic"] = {"rate": traffic.rate, "prompt_tokens": traffic.prompt_tokens,
                            "output_tokens": traffic.output_tokens}  # fmt: skip
        modes = candidates(snap.current, snap.num_workers, prompts)
        if cfg.model == "sim":
            fitted = (cfg.profile, {"source": "the profile given"}) if cfg.profile else advisor_sim.live_profile(
                snap.steps, snap.transfers, snap.shape, snap.transport, snap.gap)
            if fitted is None:
                entry["decision"] = "wait: too few steps measured to predict"
                return entry
            profile, quality = fitted
            entry["profile"] = {"step": {k: getattr(profile.step, k) for k in ("fixed", "per_prefill_token",
                                "per_attention_pair", "per_decode", "per_decode_context", "per_mixed_decode",
                                "decode_bends", "prefill_bends", "co_runner", "co_runner_prompt", "co_runner_by_prompts",
                                "co_runner_prompt_by_prompts")}, "fit": quality}  # fmt: skip
            rows = [self._sim_row(m, profile, snap, span) for m in modes]
        else:
            profile = self.planner_profile(snap)
            if profile is None:
                entry["decision"] = "wait: too few steps measured to predict"
                return entry
            entry["profile"] = {k: v for k, v in profile.as_dict().items() if k != "points"}
            rows = [self._row(m, profile, traffic, prompts, snap.num_workers) for m in modes]
        entry["predictions"] = rows
        return entry

    def _close(self, entry: dict) -> dict:
        """The decision from the predictions (hysteresis), published."""
        cfg = self.config
        rows = entry.get("predictions")
        if not rows:
            return self._publish(entry)
        here = rows[0]  # the current mode
        here_goodput = here["goodput"]
        if (credited := self._measured_credit(entry, here)) is not None:
            here_goodput = entry["current_credited"] = credited
            self.measured_share[_family(here["label"])] = (entry["time"], credited / max(here["goodput"], 1e-9))
        for c in rows[1:]:
            self._discount(c, entry["time"])
        best = max(rows[1:] or rows, key=lambda c: (c["goodput"], c["slo_margin"] or 0.0))
        rate = entry["traffic"]["rate"]
        gain = (best["goodput"] - here_goodput) / max(here_goodput, 1e-3 * rate)
        beats_judged = best["goodput"] > here_goodput and best["label"] != here["label"]
        leads = beats_judged and best["goodput"] > here["goodput"]  # and beats the replay's figure for it too
        entry.update(best=best["label"] if leads else here["label"], predicted_gain=gain if leads else 0.0)
        said = "measured" if credited is not None else "predicted"
        change = f"{here_goodput:.2f} ({said}) -> {best['goodput']:.2f} req/s" + (f", {gain:+.0%}" if here_goodput > 0 else "")
        # measured against predicted is not like for like (the replay is optimistic): a wider margin
        margin = cfg.credited_min_gain if credited is not None else cfg.min_gain
        # and a gain of a share of the traffic, not only a ratio (over a base near 0 any gain is large),
        # and the replay ranking the candidate ahead of its own prediction for the current mode: a mode
        # that measures badly says nothing of a mode predicted alike, which faces the same traffic
        ahead = best["goodput"] > here["goodput"] * (1 + cfg.min_gain)
        behind = leads and ahead and gain > margin and best["goodput"] - here_goodput > cfg.min_gain * rate
        # hysteresis on the current mode being behind, not on which mode leads: near-equal candidates
        # (colocated and chunked; local-prefill thresholds, quantiles of each window's prompts) trade the lead
        early = entry.get("due") == "early"  # a few seconds chosen because they fail: not a window of its own
        decisive = cfg.decisive_gain if credited is None else cfg.credited_decisive_gain
        self.behind = 0 if not behind else self.behind + (0 if early else 1)
        if beats_judged and not leads:
            entry["decision"] = (f"stay: the replay ranks {here['label']} ahead ({here['goodput']:.2f} against "
                                 f"{best['label']}'s {best['goodput']:.2f} req/s), though it {said} "
                                 f"{here_goodput:.2f}: the same traffic would hold {best['label']} back too")  # fmt: skip
        elif not leads:
            entry["decision"] = f"stay: {here['label']} is predicted best"
        elif not behind and (not ahead or gain <= margin):
            entry["decision"] = (f"stay: {best['label']} is predicted only {change} (threshold {margin:.0%}"
                                 + (f" over {here['label']}'s {said} figure" if ahead else
                                    f" over the replay's {here['goodput']:.2f} for {here['label']}") + ")")  # fmt: skip
        elif not behind:
            entry["decision"] = (f"stay: {best['label']} is predicted {change}, less than {cfg.min_gain:.0%} "
                                 f"of the {rate:.2f} req/s offered")  # fmt: skip
        elif (self.behind < 2 or early) and gain <= decisive:
            entry["decision"] = (f"wait: {best['label']} is predicted {change}; switching if {here['label']} is "
                                 "predicted behind again")  # fmt: skip
        else:
            entry["decision"] = f"switch to {best['label']}: predicted goodput {change}" + (
                "" if self.behind >= 2 else f" (above {decisive:.0%}: after one window)")
            entry["switch_to"] = best["mode"]
            self.behind = 0
        return self._publish(entry)

    def _discount(self, row: dict, now: float) -> None:
        """A candidate that ran within history_s and measured below what the replay predicted for
        it then is taken at that share of its prediction now: where the replay is blind to what
        fails (every mode predicted within the SLOs, each measured far below), the advisor does not
        switch back and forth between modes it has seen fail."""
        seen = self.measured_share.get(_family(row["label"]))
        if seen is not None and now - seen[0] <= self.config.history_s and seen[1] < 1.0:
            row["measured_share"] = seen[1]
            row["predicted_goodput"], row["goodput"] = row["goodput"], row["goodput"] * seen[1]

    def _measured_credit(self, entry: dict, here: dict) -> float | None:
        """The current mode judged by what it did rather than by what the replay says it does: its
        predicted goodput scaled by measured over predicted SLO attainment. Down: the live fit is
        optimistic once queues build. Up: a mode measured within the SLOs is not left for a
        prediction that it does worse. Measured are the requests that finished in the window and
        those still running, as far as they went. None where the window is too thin. Only
        requests that arrived after the last switch count (the others ran partly under another
        mode)."""
        cfg, m = self.config, entry["measured_current"]
        predicted = here.get("slo_attainment")
        if not cfg.credit_measured or predicted is None or m["slo_attainment"] is None:
            return None
        if m["requests"] < cfg.min_requests:
            return None
        if predicted <= 0:  # predicted at nothing: the goodput it would have at the measured attainment
            return entry["traffic"]["rate"] * m["slo_attainment"]
        return here["goodput"] * m["slo_attainment"] / predicted

    def _publish(self, entry: dict) -> dict:
        self.entries.append(entry)
        self.router.events.publish({"type": "advisor", **{k: v for k, v in entry.items() if k != "predictions"}})
        return entry

    def _own_requests_since(self, now: float) -> float:
        """Requests that arrived from this time on are the current mode's own: they arrived under it
        and after every reply admitted before it had ended (those shared the workers, with the
        backlog of the mode before). `now` while such a reply still runs: none is its own yet."""
        if any(state.arrival < self.mode_since for state in list(self.router.requests.values())):
            return now
        return max(self.mode_since, self.inherited_until)

    def _running_so_far(self, now: float, since: float) -> list[bool]:
        """For each request still running that is the current mode's own (arrived from `since`) and can
        be judged yet: whether it is within both SLOs so far. A long reply finishes windows after it
        arrived; one already past an SLO tells at once what its mode does to it."""
        return [ok for _, ok in self._judged_running(now, since)]

    def _judged_running(self, now: float, since: float) -> list[tuple[float, bool]]:
        out = []
        for state in list(self.router.requests.values()):
            if state.arrival < since:
                continue
            t = state.token_times
            if not t:
                if now - state.arrival > self.config.slo_ttft_s:
                    out.append((state.arrival, False))
            elif len(t) >= MIN_TOKENS_TO_JUDGE or t[0] - state.arrival > self.config.slo_ttft_s:
                out.append((state.arrival, self._meets(t[0] - state.arrival, (t[-1] - t[0]) / max(1, len(t) - 1))))
        return out

    def _early_span(self, now: float, own: float) -> float:
        """An early decision's window: from the arrival of the first of the current mode's own
        running replies that fail (the turn that made it early), or further back where that holds
        fewer than min_requests arrivals to predict from; a quarter of a window at least and a
        window at most."""
        cfg = self.config
        failing = [arrival for arrival, ok in self._judged_running(now, own) if not ok]
        start = min(failing, default=now - cfg.window_s)
        if len(self.arrivals) >= cfg.min_requests:  # in order of arrival, as _forget relies on too
            start = min(start, self.arrivals[-cfg.min_requests].time)
        return min(cfg.window_s, max(cfg.window_s / 4, now - start))

    def _meets(self, ttft: float, tpot: float) -> bool:
        return ttft <= self.config.slo_ttft_s and tpot <= self.config.slo_tpot_s

    def _measured(self, window: list[Finished], running: list[bool] = (), span: float | None = None) -> dict:
        """The window's finished requests, and `running` (each one's status so far) beside them;
        goodput per second of `span` (the window's length)."""
        cfg = self.config
        good = [f for f in window if f.ttft is not None and self._meets(f.ttft, f.tpot or 0.0)]
        ttfts = [f.ttft for f in window if f.ttft is not None]
        tpots = [f.tpot for f in window if f.tpot is not None]
        judged = len(window) + len(running)
        return {"requests": judged, "running": len(running), "goodput": len(good) / (span or cfg.window_s),
                "slo_attainment": (len(good) + sum(running)) / judged if judged else None,
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                "tpot_mean_s": statistics.fmean(tpots) if tpots else None}  # fmt: skip

    def _shape(self) -> WorkerShape:
        info = next((w.info for w in self.router.pool.workers if getattr(w, "info", None) is not None), None)
        limits = getattr(self.router, "limits", None)
        shape = WorkerShape(max_num_seqs=limits.max_running_per_worker if limits else 64,
                            decode_headroom_tokens=limits.decode_headroom_tokens if limits else 512,
                            workers_per_box=len(self.router.pool.workers))  # fmt: skip
        if info is not None:
            shape.num_blocks, shape.block_size, shape.kv_bytes_per_token = (info.num_blocks, info.block_size,
                                                                            info.kv_bytes_per_token)  # fmt: skip
        return shape

    # ---- the models -----------------------------------------------------------------------------
    def _sim_row(self, mode: Mode, profile: StepProfile, snap: Snapshot, span: float) -> dict:
        cfg = self.config
        try:
            got = advisor_sim.replay(profile, snap.arrivals, mode, snap.num_workers, snap.now - span,
                                     cfg.slo_ttft_s, cfg.slo_tpot_s, span, snap.transport)  # fmt: skip
        except Exception as err:  # a replay the simulator cannot run scores nothing; the others still decide
            log.warning("the advisor's replay of %s failed: %r", _label(mode), err)
            return {"label": _label(mode), "mode": _mode_fields(mode), "goodput": 0.0, "slo_attainment": 0.0,
                    "slo_margin": None, "error": f"{type(err).__name__}: {err}"}  # fmt: skip
        margin = self._margin(got["ttft_p90_s"] or 0.0, got["tpot_p90_s"] or 0.0)
        return {"label": _label(mode), "mode": _mode_fields(mode), **got, "slo_margin": _finite(margin)}

    def planner_profile(self, snap: Snapshot) -> Profile | None:
        prefill = [(s["prefill_tokens"], s["end"] - s["time"]) for s in snap.steps
                   if s["prefill_tokens"] and not s["decodes"]]  # fmt: skip
        decode = [(s["decodes"], s["end"] - s["time"]) for s in snap.steps if s["decodes"] and not s["prefill_tokens"]]
        if len(prefill) < 3 or len(decode) < 3:
            return None
        a, b = _fit(*map(list, zip(*prefill)))
        c0, c1 = _fit(*map(list, zip(*decode)))
        moved, took = sum(x for x, _ in snap.transfers), sum(s for _, s in snap.transfers)
        bandwidth = moved / took if took else float("inf")  # no handoff measured yet: taken as free
        return Profile(a, b, c0, c1, 0.0, b, snap.shape.kv_bytes_per_token, bandwidth,
                       {"prefill_steps": len(prefill), "decode_steps": len(decode),
                        "transfers": len(snap.transfers)})  # fmt: skip

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


def candidates(cur: Mode, n: int, prompts: list[int]) -> list[Mode]:
    """The current mode first, then colocated, chunked budgets, every xPyD split of n workers, each
    with a local-prefill threshold at the median and 90th-percentile prompt."""
    base = replace(cur, local_prefill_tokens=0, workers=None)
    modes = [cur, replace(base, name="colocated")]
    modes += [replace(base, name="chunked", chunk_tokens=c) for c in CHUNK_CANDIDATES]
    for prefill in range(1, n):
        split = replace(base, name="disagg", prefill_workers=prefill, decode_workers=n - prefill)
        modes.append(split)
        modes += [replace(split, local_prefill_tokens=q) for q in sorted({_quantile(prompts, 0.5), _quantile(prompts, 0.9)})
                  if q > prompts[0]]  # fmt: skip
    out: list[Mode] = []
    for mode in modes:
        if mode not in out:
            out.append(mode)
    return out


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


def _family(label: str) -> str:
    """A mode's label without its local-prefill threshold (a quantile of each window's prompts)."""
    head, local, _ = label.partition(" local<")
    return head + (" local" if local else "")


def _quantile(xs: list[int], q: float) -> int:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _finite(x: float) -> float | None:
    return x if x == x and x != float("inf") else None


def _mode_fields(mode: Mode) -> dict:
    return {"name": mode.name, "prefill_workers": mode.prefill_workers, "decode_workers": mode.decode_workers,
            "chunk_tokens": mode.chunk_tokens, "workers": mode.workers, "kv_link_gbps": mode.kv_link_gbps,
            "kv_link_latency_ms": mode.kv_link_latency_ms, "local_prefill_tokens": mode.local_prefill_tokens}  # fmt: skip
