"""The experiments of `python -m minipd bench`: the same requests (same order, same arrival times)
through each mode on the same workers; DistServe's goodput by a rate search; the KV-link study;
and a probe showing whether admission (seating disaggregated requests) limits the rate."""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass

from minipd.bench import phases as ph
from minipd.bench.client import load_or_interrupt, run_interruptible, run_load
from minipd.bench.metrics import RequestRecord, distserve_goodput, per_worker, summarize
from minipd.bench.switching import analyse, switch_on_schedule
from minipd.bench.target import Target
from minipd.bench.workloads import PHASES, BenchRequest, make_workload, phase_spans
from minipd.server.modes import DEFAULT_CHUNK_TOKENS

AUTO = {"mode": "auto"}  # POST /admin/mode: the server's advisor chooses the mode from now on
AUTO_STARTS_IN = {"mode": "colocated", "workers": None}  # as `serve --mode auto` starts


@dataclass(slots=True)
class Settings:
    num_prompts: int | None
    duration: float | None
    burstiness: float
    seed: int
    quick: bool
    input_len: int | None
    output_len: int | None
    max_concurrency: int | None
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    progress: bool = True
    phases: tuple[str, ...] = PHASES  # the phases workload's


# Every /admin/mode setting of each mode, at its default (the emulated link applies in all: moves cross
# it). A body bench sends spells them all out: the server keeps an omitted one from the mode before.
MODE_DEFAULTS = {"colocated": {"workers": None}, "chunked": {"chunk_tokens": DEFAULT_CHUNK_TOKENS, "workers": None},
                 "disagg": {"prefill_workers": 1, "decode_workers": 1, "chunk_tokens": DEFAULT_CHUNK_TOKENS,
                            "local_prefill_tokens": 0}}  # fmt: skip
LINK_DEFAULTS = {"kv_link_gbps": None, "kv_link_latency_ms": 0}


def mode_body(name: str, **settings) -> dict:
    """The /admin/mode body of mode `name` with `settings`, every other setting at its default."""
    return {"mode": name, **MODE_DEFAULTS[name], **LINK_DEFAULTS, **settings}


def mode_to_restore(target) -> dict | None:
    """The /admin/mode body that brings a server of the user's own back to the mode bench found it in,
    every setting spelled out (one left out would keep what the last run set); None if it cannot say."""
    status, report = target.get("/admin/mode")
    if status != 200 or not isinstance(report, dict) or report.get("mode") not in MODE_DEFAULTS:
        return None
    if report.get("auto"):
        return {"mode": "auto"}
    body = mode_body(report["mode"])
    return {**body, **{k: v for k, v in report.items() if k in body}}


def restore_mode(target, body: dict) -> None:
    try:
        target.set_mode(body)
        print(f"the server is back in the mode bench found it in: {body}", file=sys.stderr)
    except Exception as err:  # the server gone or refusing: the results are written all the same
        print(f"warning: could not bring the server back to {body}: {err}", file=sys.stderr)


def parse_modes(text: str) -> list[tuple[str, dict]]:
    """'colocated,chunked:64,disagg:1p1d' -> [(label, /admin/mode body)]; ValueError names a bad item."""
    return [parse_mode(item) for item in filter(None, (x.strip() for x in text.split(",")))]


def parse_mode(item: str) -> tuple[str, dict]:
    """One mode: colocated, chunked[:TOKENS], disagg[:PpDd[:localN]], auto (the server's advisor
    chooses and switches live; see run_once) or server (the server's own) -> (label, body)."""
    name, _, variant = item.partition(":")
    if name == "colocated":
        return item, mode_body("colocated")
    if name == "chunked":
        if variant and not (variant.isdigit() and int(variant) > 0):
            raise ValueError(f"bad mode {item!r}: chunked:TOKENS needs a positive whole number of tokens")
        return item, mode_body("chunked", chunk_tokens=int(variant or DEFAULT_CHUNK_TOKENS))
    if name == "disagg":
        variant, _, local = variant.partition(":")
        split = re.fullmatch(r"(\d+)p(\d+)d?", (variant or "1p1d").lower())
        if split is None or min(int(split[1]), int(split[2])) < 1:
            raise ValueError(f"bad mode {item!r}: disagg:PpDd needs P prefill and D decode workers, each >= 1 "
                             "(e.g. disagg:1p1d)")  # fmt: skip
        threshold = re.fullmatch(r"local(\d+)", local) if local else None
        if local and threshold is None:
            raise ValueError(f"bad mode {item!r}: disagg:PpDd:localN prefills prompts under N tokens on their "
                             "decode worker (e.g. disagg:1p1d:local256)")  # fmt: skip
        return item, mode_body("disagg", prefill_workers=int(split[1]), decode_workers=int(split[2]),
                               local_prefill_tokens=int(threshold[1]) if threshold else 0)  # fmt: skip
    if name == "auto":
        if variant:
            raise ValueError(f"bad mode {item!r}: auto takes no options (the advisor chooses them; the server's "
                             "--advisor-window and --slo-ttft-ms/--slo-tpot-ms set how)")  # fmt: skip
        return "auto", dict(AUTO)
    if name == "server":
        return item, {}
    raise ValueError(f"unknown mode {item!r}: use colocated, chunked[:TOKENS] or disagg[:PpDd] "
                     "(disagg:PpDd:localN for per-request disaggregation), or auto")  # fmt: skip


def workload(name: str, rate: float, s: Settings, max_model_len: int) -> list[BenchRequest]:
    return make_workload(name, num_prompts=s.num_prompts, duration=s.duration, rate=rate, burstiness=s.burstiness,
                         seed=s.seed, quick=s.quick, input_len=s.input_len, output_len=s.output_len,
                         max_model_len=max_model_len, phases=s.phases)  # fmt: skip


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: carries what the run measured until then."""

    def __init__(self, run: dict):
        super().__init__()
        self.run = run


def run_once(target: Target, name: str, label: str, body: dict, rate: float, s: Settings, *,
             switches: list[tuple[float, str, dict]] | None = None, start_label: str | None = None,
             keep_steps: bool = False, **extra) -> dict:  # fmt: skip
    """Switch the server to `body` (minipd only), then play the workload at `rate`. With `switches`
    ([(seconds after the first request, label, /admin/mode body)], switching.parse_switch_at's), the
    server's mode is switched live at those times while the load plays, and the run gets "switches"
    and "intervals" (see switching.py); `start_label` names the mode it starts in (default: `label`).

    `body` {"mode": "auto"}: the server is set colocated (where `serve --mode auto` starts, whatever
    the run before left), then auto; after the run the advisor's decisions made during it and the
    switches it made are fetched into the run's "advisor" (GET /admin/advisor). A run of the phases
    workload gets "phases": its numbers per phase and overall (phases.phase_rows). With keep_steps
    (minipd only), the run gets "step_summary": the engine steps the workers ran during it
    (validate.step_summary, for `--validate-sim`)."""
    auto = target.is_minipd and body.get("mode") == "auto"
    if auto:
        target.set_mode(AUTO_STARTS_IN)  # turns auto off if it was on: the advisor starts from colocated
    started_in = target.set_mode(body) if target.is_minipd and body else None
    auto_since = time.time()
    requests = workload(name, rate, s, target.max_model_len)
    started = time.time()
    got: dict = {}
    log: list[dict] = []

    async def play() -> None:
        stop = asyncio.Event()
        t0 = time.time() + min((r.arrival for r in requests), default=0.0)  # the first request's send time
        switcher = asyncio.ensure_future(switch_on_schedule(target.url, target.api_key, switches, t0, log, stop)
                                         ) if switches else None  # fmt: skip
        try:
            got["records"] = await run_load(target.url, target.model, requests, api_key=target.api_key,
                                            max_concurrency=s.max_concurrency, seed=s.seed, progress=s.progress)  # fmt: skip
        finally:
            if switcher is not None:
                stop.set()  # no switch after the load; one under way is waited for
                await asyncio.gather(switcher, return_exceptions=True)

    try:
        _, interrupted = run_interruptible(play)
    except KeyboardInterrupt:  # a second Ctrl-C while the run was winding down
        interrupted = True
    records = got.get("records", [])
    duration = max((r.end_time or r.send_time) for r in records) - started if records else 0.0
    run = {"workload": name, "mode": body.get("mode", "server"), "label": label, "mode_body": body, "rate": rate,
           "burstiness": s.burstiness, "seed": s.seed, "quick": s.quick, "num_prompts": len(requests),
           "duration": duration, "slo_ttft_ms": s.slo_ttft_ms, "slo_tpot_ms": s.slo_tpot_ms, "records": records,
           "workers": target.num_workers, **extra}  # fmt: skip
    run["summary"] = summarize(records, duration, s.slo_ttft_ms, s.slo_tpot_ms)
    run["request_phases"] = [r.phase for r in requests]  # by request index; results.json puts it in each record
    sent = [r.send_time - requests[r.index].arrival for r in records if r.index < len(requests)]
    run["load_start"] = min(sent, default=started)  # epoch time of arrival offset 0 (the client's clock)
    if keep_steps and target.is_minipd:
        from minipd.bench.plan import _steps_since
        from minipd.sim.validate import step_summary

        time.sleep(0.3)  # the last steps' events reach the log
        steps = [e for e in _steps_since(target, started) if e["time"] <= started + duration]
        run["step_summary"] = step_summary(steps, duration, workers_used(body, target.num_workers))
    if auto:
        end = max((r.end_time or r.send_time for r in records), default=time.time())
        run["advisor"] = fetch_advisor(target, auto_since, end, run["load_start"])
    if name == "phases":
        add_phases(run, requests, s, rate)
    if switches:
        t0 = min((r.send_time for r in records), default=started)
        start_mode = {k: v for k, v in (started_in or {}).items() if k != "switch"} or body
        run["mode"] = "switching"
        run["switch_schedule"] = [{"at_s": at, "label": lab, "body": b} for at, lab, b in switches]
        run["switches_not_sent"] = [f"{at:g}:{lab}" for at, lab, _ in switches[len(log) :]]
        run["switches"], run["intervals"] = analyse(records, log, t0, start_label or label, start_mode,
                                                    s.slo_ttft_ms, s.slo_tpot_ms)  # fmt: skip
    if interrupted:
        run["interrupted"] = True
        raise Interrupted(run)
    return run


def add_phases(run: dict, requests: list[BenchRequest], s: Settings, rate: float) -> None:
    """A phases run's phase names, spans and per-phase rows (phases.phase_rows)."""
    run["phase_names"] = list(s.phases)
    run["phase_spans"] = phase_spans(requests, s.duration, rate, len(s.phases))
    run["phases"] = ph.phase_rows(run)


def fetch_advisor(target: Target, since: float, until: float, t0: float) -> dict:
    """GET /admin/advisor after an auto run: its settings, the decisions it made between `since` and
    `until` (epoch seconds; `at_s` is each one's time after `t0`) and the switches among them."""
    try:
        status, got = target.get("/admin/advisor")
    except OSError as e:
        status, got = None, f"{type(e).__name__}: {e}"
    if status != 200 or not isinstance(got, dict):
        return {"error": f"GET /admin/advisor answered {status}: {str(got)[:300]}", "decisions": [], "switches": 0,
                "switch_log": []}  # fmt: skip
    decisions = [{**d, "at_s": d["time"] - t0} for d in got.get("decisions") or []
                 if isinstance(d.get("time"), (int, float)) and since <= d["time"] <= until]  # fmt: skip
    switch_log = [{"at_s": d["at_s"], "time": d["time"], "to": d.get("best"), "mode": d["switch_to"],
                   "decision": d.get("decision"), "outcome": d.get("switch")}
                  for d in decisions if d.get("switch_to") is not None
                  and (d.get("switch") or {}).get("changed") is not False]  # fmt: skip
    return {"enabled": got.get("enabled"), "window_s": got.get("window_s"), "slo_ttft_s": got.get("slo_ttft_s"),
            "slo_tpot_s": got.get("slo_tpot_s"), "min_gain": got.get("min_gain"), "since": since, "until": until,
            "decisions": decisions, "switches": len(switch_log), "switch_log": switch_log}  # fmt: skip


def goodput_search(target: Target, name: str, label: str, body: dict, s: Settings, lo: float, hi: float,
                   max_runs: int) -> dict:  # fmt: skip
    """DistServe's goodput: the highest rate at which >= 90% of requests meet both SLOs, per worker."""
    runs = []

    def attainment(rate: float) -> float:
        run = run_once(target, name, label, body, rate, s, search=True)
        runs.append(run)
        return run["summary"]["slo_attainment"] or 0.0

    best, probes = distserve_goodput(attainment, lo=lo, hi=hi, tolerance=max(lo / 4, 0.02), max_runs=max_runs)
    workers = workers_used(body, target.num_workers)
    return {"workload": name, "label": label, "goodput_rate": best, "workers": workers,
            "goodput_per_worker": per_worker(best, workers), "probes": probes, "runs": runs}  # fmt: skip


def workers_used(body: dict, num_workers: int) -> int:
    if body.get("mode") == "disagg":
        return body["prefill_workers"] + body["decode_workers"]
    return body.get("workers") or num_workers


def crossover(link_points: list[tuple[float, float]], baseline: float, tolerance: float = 0.03) -> float | None:
    """The lowest emulated link rate (Gb/s) from which disagg's goodput stays at or above the best
    co-located mode's (within `tolerance`, relative: runs of one request set differ by noise in
    their length); None if it never does in the range measured."""
    baseline *= 1 - tolerance
    above = [gbps for gbps, goodput in sorted(link_points) if goodput >= baseline]
    if not above:
        return None
    lowest = min(above)
    return lowest if all(g >= baseline for gb, g in link_points if gb >= lowest) else None


def admission_probe(target: Target, s: Settings, body: dict, burst: int = 32) -> dict:
    """`burst` requests arrive at once in disagg: how fast are they all seated, against the decode
    step time (the old one-seat-per-decode-step design's ceiling)?"""
    target.set_mode(body)
    before = target.get("/admin/workers")[1]["seats"]
    requests = [BenchRequest(i, 64, 16, 0.0) for i in range(burst)]
    records = load_or_interrupt(target.url, target.model, requests, api_key=target.api_key, seed=s.seed,
                                progress=False)  # fmt: skip
    after = target.get("/admin/workers")[1]["seats"]
    waits = _seat_waits(records)
    steps = [r.tpot for r in records if r.tpot]
    step = statistics.median(steps) if steps else math.nan
    seated_in = max(waits) if waits else math.nan
    return {"burst": burst, "seat_batches": after["batches_sent"] - before["batches_sent"],
            "seats_granted": after["granted"] - before["granted"], "all_seated_within_s": seated_in,
            "median_seat_wait_s": statistics.median(waits) if waits else math.nan, "decode_step_s": step,
            "one_seat_per_step_would_take_s": burst * step}  # fmt: skip


def _seat_waits(records: list[RequestRecord]) -> list[float]:
    out = []
    for r in records:
        t = r.server_timeline or {}
        ev = t.get("events", {})
        if "seat_reserved" in ev:
            out.append(ev["seat_reserved"] - t["arrival"])
    return out
