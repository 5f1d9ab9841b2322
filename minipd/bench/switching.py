"""`bench --switch-at T:MODE[,T:MODE...]`: switch a minipd server's mode live during one run, and
measure each interval between the switches apart and what each switch cost the replies streaming
through it.

Times T are seconds after the run's first request is sent; MODE is a mode as `--modes` spells it
(`colocated`, `chunked[:TOKENS]`, `disagg[:PpDd]`, parsed by experiment.parse_mode). The switches are
POSTed to /admin/mode by a task running beside the load; a POST answers once the new mode serves
and the replies that had to move were moved.

Intervals: the run is cut at the moments the switch requests were sent (client clock, the clock of
the request records). A request belongs to the interval in which it was sent ("arrived"); the mode
in force is the one the last successful switch set (during a switch, new requests wait at the
server's door for its few milliseconds, and are counted in the interval that is ending).

A switch's cost to the replies streaming through it (a first token before the switch was sent and
the stream still open then): per request, its largest inter-token gap over its whole reply and its
largest gap that overlaps the switch (from the POST to its answer), against the median of the same
requests' inter-token latencies.
"""

from __future__ import annotations

import asyncio
import math
import time

from minipd.bench.metrics import RequestRecord, percentile, summarize
from minipd.bench.report import fmt_number

SWITCH_FIELDS = ("seconds", "serving_after_seconds", "requests_in_flight", "moved", "not_moved", "bytes",
                 "slowest_move_seconds", "outcomes")  # fmt: skip


def parse_switch_at(text: str, drain: bool = False) -> list[tuple[float, str, dict]]:
    """'1:disagg:1p1d,2.5:colocated' -> [(seconds, mode label, /admin/mode body)], in time order.
    ValueError, naming the item, for anything else."""
    from minipd.bench.experiment import parse_mode

    out: list[tuple[float, str, dict]] = []
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise ValueError("--switch-at needs T:MODE[,T:MODE...], e.g. 1:disagg:1p1d,2:colocated")
    for item in items:
        at, sep, mode = item.partition(":")
        if not sep or not mode.strip():
            raise ValueError(f"--switch-at item {item!r}: use T:MODE (seconds after the first request, then a "
                             "mode), e.g. 1.5:disagg:1p1d")  # fmt: skip
        try:
            seconds = float(at)
        except ValueError:
            raise ValueError(f"--switch-at item {item!r}: {at.strip()!r} is not a time in seconds") from None
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"--switch-at item {item!r}: the time must be a finite number of seconds >= 0")
        label, body = parse_mode(mode.strip())
        if not body:
            raise ValueError(f"--switch-at item {item!r}: switch to colocated, chunked[:TOKENS] or disagg[:PpDd]")
        if out and seconds <= out[-1][0]:
            raise ValueError(f"--switch-at item {item!r}: times must increase ({seconds:g} s after {out[-1][0]:g} s)")
        out.append((seconds, label, {**body, "drain": True} if drain else body))
    return out


# ---- while the load plays ------------------------------------------------------------------------


async def switch_on_schedule(url: str, api_key: str | None, schedule: list[tuple[float, str, dict]], t0: float,
                             log: list[dict], stop: asyncio.Event, timeout: float = 900.0) -> None:  # fmt: skip
    """POST each switch of `schedule` at t0 + its time (time.time() clock), one after the other (a
    switch that answers late delays the next); appends one entry per switch sent to `log`. Once
    `stop` is set (the load ended) no further switch is sent; one under way is waited for."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for at, label, body in schedule:
            delay = t0 + at - time.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            if stop.is_set():
                return
            entry = {"at_s": at, "label": label, "body": body, "sent": time.time()}
            log.append(entry)
            try:
                async with session.post(url.rstrip("/") + "/admin/mode", json=body, headers=headers) as resp:
                    entry["status"] = resp.status
                    answer = await resp.json(content_type=None)
            except Exception as e:  # recorded: the load goes on in the mode it has
                entry["status"], answer = None, {"error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}
            entry["answered"] = time.time()
            entry["answer"] = answer


# ---- after the run: intervals and the cost of each switch -----------------------------------------


def split_intervals(records: list[RequestRecord], switches: list[dict], t0: float, start_label: str,
                    start_mode: dict | None = None, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None, end: float | None = None) -> list[dict]:  # fmt: skip
    """One row per interval between switches (cut at each switch's `sent`, epoch seconds): its times
    (epoch and seconds after t0), the mode in force and the numbers of the requests sent in it."""
    if end is None:
        end = max((r.end_time or r.send_time for r in records), default=t0)
    cuts = [s["sent"] for s in switches]
    bounds = [t0, *cuts, max(end, *cuts) if cuts else end]
    label, mode = start_label, start_mode
    rows = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if i > 0 and ok(switches[i - 1]):
            label, mode = switches[i - 1]["label"], switches[i - 1].get("to") or switches[i - 1]["body"]
        first, last = i == 0, i == len(bounds) - 2
        mine = [r for r in records if (first or r.send_time >= lo) and (last or r.send_time < hi)]
        s = summarize(mine, hi - lo, slo_ttft_ms, slo_tpot_ms)
        itls = [gap for r in mine if r.ok for gap in r.itls]
        rows.append({"index": i, "start": lo, "end": hi, "start_s": lo - t0, "end_s": hi - t0, "mode": label,
                     "mode_body": mode, "requests": len(mine), "completed": s["completed"], "failed": s["failed"],
                     "median_ttft_ms": s["median_ttft_ms"], "p90_ttft_ms": s["p90_ttft_ms"],
                     "median_tpot_ms": s["median_tpot_ms"], "p90_tpot_ms": s["p90_tpot_ms"],
                     "median_itl_ms": s["median_itl_ms"], "p90_itl_ms": s["p90_itl_ms"],
                     "max_itl_ms": _ms(percentile(itls, 100)), "goodput": s["goodput"],
                     "slo_attainment": s["slo_attainment"]})  # fmt: skip
    return rows


def ok(switch: dict) -> bool:
    return switch.get("status") == 200


def switch_cost(records: list[RequestRecord], sent: float, answered: float) -> dict:
    """What a switch sent at `sent` and answered at `answered` cost the requests streaming then."""
    streaming = [r for r in records if r.token_times and r.token_times[0] <= sent
                 and (r.end_time or r.token_times[-1]) > sent]  # fmt: skip
    waiting = [r for r in records if r.send_time <= sent and (not r.token_times or r.token_times[0] > sent)
               and (r.end_time is None or r.end_time > sent)]  # fmt: skip

    def moves(r: RequestRecord) -> list[dict]:
        return [m for m in (r.server_timeline or {}).get("moves") or []
                if m.get("reason") == "switch" and sent - 0.5 <= (m.get("start") or 0) <= answered + 0.5]  # fmt: skip

    def moved(found: list[dict]) -> bool:
        return any(m.get("outcome") == "moved" for m in found)

    rows = []
    for r in streaming:
        t = r.token_times
        across = [b - a for a, b in zip(t, t[1:]) if a < answered and b > sent]
        if r.end_time is not None and t[-1] < answered and r.end_time > sent:
            across.append(r.end_time - t[-1])  # the gap to the stream's end, if the switch fell in it
        rows.append({"index": r.index, "largest_gap_ms": _ms(max(r.itls, default=None)),
                     "gap_across_switch_ms": _ms(max(across, default=None)), "median_itl_ms": _ms(percentile(r.itls, 50)),
                     "moved": moved(found := moves(r)), "move_outcomes": [m.get("outcome") for m in found]})  # fmt: skip
    largest = [x["largest_gap_ms"] for x in rows if x["largest_gap_ms"] is not None]
    across = [x["gap_across_switch_ms"] for x in rows if x["gap_across_switch_ms"] is not None]
    itl = _ms(percentile((g for r in streaming for g in r.itls), 50))
    # every request the server held at the switch may have moved: one whose first token had not reached
    # the client, and one whose POST beat the switch's to the server though the client stamped it later
    return {"streaming": len(streaming), "waiting_for_first_token": len(waiting),
            "moved_per_timelines": sum(moved(moves(r)) for r in records if r.send_time <= answered),
            "largest_gap_max_ms": max(largest, default=None), "largest_gap_median_ms": percentile(largest, 50),
            "gap_across_switch_max_ms": max(across, default=None),
            "gap_across_switch_median_ms": percentile(across, 50), "median_itl_ms": itl,
            "largest_gap_max_over_median_itl": _ratio(max(largest, default=None), itl),
            "gap_across_switch_max_over_median_itl": _ratio(max(across, default=None), itl),
            "requests": rows}  # fmt: skip


def analyse(records: list[RequestRecord], log: list[dict], t0: float, start_label: str, start_mode: dict | None,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """(switches, intervals) of a run from its records and the switches' log (switch_on_schedule's)."""
    switches = []
    for i, e in enumerate(log):
        answer = e.get("answer") if isinstance(e.get("answer"), dict) else {}
        outcome = answer.get("switch") or {}
        answered = e.get("answered") or e["sent"]
        row = {"index": i, "at_s": e["at_s"], "sent_s": e["sent"] - t0, "sent": e["sent"], "answered": answered,
               "answered_after_seconds": answered - e["sent"], "label": e["label"], "body": e["body"],
               "status": e.get("status"), "error": None if e.get("status") == 200 else _error(e.get("answer")),
               "from": outcome.get("from"), "to": outcome.get("to"), "changed": outcome.get("changed"),
               "drain": outcome.get("drain"), "started": outcome.get("started"),
               **{k: outcome.get(k) for k in SWITCH_FIELDS}, "note": outcome.get("note"),
               "cost": switch_cost(records, e["sent"], answered)}  # fmt: skip
        switches.append(row)
    intervals = split_intervals(records, switches, t0, start_label, start_mode, slo_ttft_ms, slo_tpot_ms)
    return switches, intervals


def _error(answer) -> str:
    if isinstance(answer, dict):
        err = answer.get("error", answer)
        return str(err.get("message") or err) if isinstance(err, dict) else str(err)
    return str(answer)[:300]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- tables ----------------------------------------------------------------------------------------


def _f(x, digits: int = 0) -> str:  # whole numbers unless told otherwise
    return fmt_number(x, digits)


def _mode_text(mode) -> str:
    if not isinstance(mode, dict):
        return "-" if mode is None else str(mode)
    rest = ", ".join(f"{k} {v}" for k, v in mode.items() if k != "mode")
    return f"{mode.get('mode', '?')}" + (f" ({rest})" if rest else "")


def tables(run: dict) -> str:
    """Markdown: the intervals, then the switches with their cost to the replies streaming through them."""
    intervals, switches = run.get("intervals") or [], run.get("switches") or []
    slo = any(run.get(k) for k in ("slo_ttft_ms", "slo_tpot_ms"))
    lines = ["### Intervals between switches (requests by the interval they were sent in)", "",
             "| interval (s) | mode in force | requests (done / failed) | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
             "| ITL p50 / p90 / max (ms) |" + (" goodput (req/s) | SLO attainment |" if slo else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if slo else "")]  # fmt: skip
    for iv in intervals:
        row = (f"| {iv['start_s']:.2f}-{iv['end_s']:.2f} | {iv['mode']} | {iv['requests']} ({iv['completed']} / "
               f"{iv['failed']}) | {_f(iv['median_ttft_ms'])} / {_f(iv['p90_ttft_ms'])} "
               f"| {_f(iv['median_tpot_ms'], 1)} / {_f(iv['p90_tpot_ms'], 1)} "
               f"| {_f(iv['median_itl_ms'], 1)} / {_f(iv['p90_itl_ms'], 1)} / {_f(iv['max_itl_ms'], 1)} |")  # fmt: skip
        if slo:
            att = iv["slo_attainment"]
            row += f" {_f(iv['goodput'], 2)} | {'-' if att is None else f'{100 * att:.0f}%'} |"
        lines.append(row)
    lines += ["", "### Switches (the server's outcome; the cost to the replies streaming at the switch)", "",
              "| at (s) | to | changed | serving after (ms) | done after (ms) | in flight (server) "
              "| moved / not moved | KV moved (MB) | slowest move (ms) | streaming (in flight moved, per timelines) "
              "| gap across switch max / median (ms) | largest gap max / median (ms) | their median ITL (ms) "
              "| max gap / ITL |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in switches:
        c = s["cost"]
        changed = s["changed"] if s["status"] == 200 else f"failed: {s['error']}"
        mb = None if s["bytes"] is None else s["bytes"] / 1e6
        ratio = c["gap_across_switch_max_over_median_itl"]
        lines.append(
            f"| {s['sent_s']:.2f} | {_mode_text(s['to']) if s['to'] else s['label']} | {changed} "
            f"| {_f(_ms(s['serving_after_seconds']), 1)} | {_f(_ms(s['seconds']), 1)} | {_f(s['requests_in_flight'])} "
            f"| {_f(s['moved'])} / {_f(s['not_moved'])} | {_f(mb, 2)} | {_f(_ms(s['slowest_move_seconds']), 1)} "
            f"| {c['streaming']} ({c['moved_per_timelines']}) "
            f"| {_f(c['gap_across_switch_max_ms'], 1)} / {_f(c['gap_across_switch_median_ms'], 1)} "
            f"| {_f(c['largest_gap_max_ms'], 1)} / {_f(c['largest_gap_median_ms'], 1)} | {_f(c['median_itl_ms'], 1)} "
            f"| {'-' if ratio is None else f'{ratio:.1f}x'} |"
        )  # fmt: skip
    if run.get("switches_not_sent"):
        lines += ["", f"Not sent (the load ended first): {', '.join(run['switches_not_sent'])}."]
    return "\n".join(lines)
