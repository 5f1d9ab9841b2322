"""The event stream of GET /admin/events as a Chrome trace (the Trace Event Format, JSON), the
format that Perfetto's UI (https://ui.perfetto.dev) opens.

Layout of the trace:

- process "workers": a track per worker ("worker N"); each engine step is a slice on it
  ("prefill 512 + 3 decodes", "decode x8"), its args the batch (prefill_tokens, decodes, keys,
  prefilling); a worker's state changes (lost, up, draining, drained) are instants on it.
- process "links": a track per writer -> reader pair ("worker 0 -> worker 1"; a second lane,
  "#2", where two transfers on the pair overlap); each KV transfer is a slice from the writer's
  transfer_start to the reader's transfer_end ("KV handoff", or "KV move" for a live move).
- process "server": tracks "mode" (switches: an instant per phase and a slice for the whole
  switch), "moves" (an instant as each move starts and ends) and "advisor" (its decisions).
- flows: one per request ("request <id>"), through every step and transfer that carried it in
  time order, so the UI draws its path: prefill worker -> link -> decode worker.

Times are epoch seconds in the events and whole microseconds from the first event in the trace (a
flow's point is the middle of its slice, so that it binds to that slice). The function only reads
the dicts' fields: a simulator that emits the same dicts gets the same trace. Track ids are unique
over the whole trace and none equals a process id (Perfetto would take it for the main thread).
"""

from __future__ import annotations

from collections import defaultdict

WORKERS_PID, LINKS_PID, SERVER_PID = 1, 2, 3
PROCESS_NAMES = {WORKERS_PID: "workers", LINKS_PID: "links", SERVER_PID: "server"}
FIRST_TID = 10  # above every pid
SERVER_TRACKS = ("mode", "moves", "advisor")
TRANSFER_KINDS = ("transfer_start", "transfer_end", "kv_copied", "kv_sent")
# known, and not drawn: step_start (the step event that follows has it all), the other request kinds
IGNORED_TYPES = ("step_start",)
NAME_CHARS = 100


def to_chrome_trace(events: list[dict], title: str = "minipd") -> dict:
    """The events (as GET /admin/events publishes them, oldest first) as a Chrome trace:
    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}. Events of an unknown
    type, or without the fields their type needs, are skipped (counted in otherData.skipped)."""
    return _Builder(events, title).build()


class _Builder:
    def __init__(self, events: list[dict], title: str):
        self.title = title
        self.events = [e for e in events if isinstance(e, dict)]
        self.skipped = len(events) - len(self.events)
        self.out: list[dict] = []
        self.tids: dict[tuple, int] = {}  # (pid, track key) -> tid, unique over the whole trace
        self.track_names: dict[tuple, str] = {}
        self.flow_points: dict[str, list[tuple[float, int, int]]] = defaultdict(list)  # request_id -> points
        self.t0 = 0.0

    # ---- the whole trace ------------------------------------------------------------------------
    def build(self) -> dict:
        times = [e["time"] for e in self.events if e.get("type") in HANDLERS and _is_number(e.get("time"))]
        self.t0 = min(times) if times else 0.0
        self.t_last = max([*times, *(e["end"] for e in self.events if _is_number(e.get("end")))], default=self.t0)
        self.moves = [e for e in self.events if e.get("type") == "move" and e.get("phase") == "start"]
        self.transfers: dict[str, list[dict]] = defaultdict(list)  # key -> its transfer events
        for e in self.events:
            handler = HANDLERS.get(e.get("type"))
            if handler is None:
                if e.get("type") not in IGNORED_TYPES:
                    self.skipped += 1
                continue
            try:
                handler(self, e)
            except (KeyError, TypeError, ValueError, AttributeError):  # a dict without the fields it needs
                self.skipped += 1
        self._transfers()
        self._flows()
        self._number_tracks()
        slices = sum(1 for x in self.out if x["ph"] == "X")
        other = {"title": self.title, "start_time": self.t0, "events": len(self.events), "slices": slices,
                 "flows": self.num_flows, "skipped": self.skipped}  # fmt: skip
        trace_events = self._metadata() + sorted(self.out, key=lambda x: x["ts"])
        return {"traceEvents": trace_events, "displayTimeUnit": "ms", "otherData": other}

    def us(self, t: float) -> int:
        """Whole microseconds from the first event (an epoch time in a float is good to 0.24 us)."""
        return round((float(t) - self.t0) * 1e6)

    def tid(self, pid: int, key, name: str) -> int:
        if (pid, key) not in self.tids:
            self.tids[(pid, key)] = len(self.tids) + FIRST_TID
            self.track_names[(pid, key)] = name
        return self.tids[(pid, key)]

    def worker_tid(self, worker) -> int:
        return self.tid(WORKERS_PID, worker, f"worker {worker}")

    def server_tid(self, track: str) -> int:
        return self.tid(SERVER_PID, track, track)

    def slice(self, pid: int, tid: int, name: str, cat: str, start: float, end: float, args: dict) -> dict:
        ts = self.us(start)
        x = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": ts,
             "dur": max(0, self.us(end) - ts), "args": args}  # fmt: skip
        self.out.append(x)
        return x

    def instant(self, pid: int, tid: int, name: str, cat: str, t: float, args: dict) -> None:
        self.out.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": name[:NAME_CHARS], "cat": cat,
                         "ts": self.us(t), "args": args})  # fmt: skip

    def _number_tracks(self) -> None:
        """Tracks were numbered as they appeared; number them in order (workers by id, links by
        pair and lane, then the server's), so that the UIs that sort threads by tid show that order."""
        order = sorted(self.tids, key=lambda track: (track[0], _sort_key(track)))
        new = {self.tids[track]: FIRST_TID + i for i, track in enumerate(order)}
        for x in self.out:
            x["tid"] = new[x["tid"]]
        self.tids = {track: new[tid] for track, tid in self.tids.items()}

    def _metadata(self) -> list[dict]:
        """Process and thread names, and sort indexes (for the viewers that read them)."""
        meta = []
        for i, pid in enumerate(sorted({pid for pid, _ in self.tids})):
            meta.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": PROCESS_NAMES[pid]}})
            meta.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": i}})
        for track, tid in sorted(self.tids.items(), key=lambda kv: kv[1]):
            pid, name = track[0], self.track_names[track]
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        return meta

    # ---- each type of event ---------------------------------------------------------------------
    def on_step(self, e: dict) -> None:
        start, end = float(e["time"]), float(e["end"])
        prefill, decodes = int(e.get("prefill_tokens") or 0), int(e.get("decodes") or 0)
        keys, prefilling = list(e.get("keys") or []), list(e.get("prefilling") or [])
        tid = self.worker_tid(e["worker"])
        args = {k: v for k, v in e.items() if k not in ("type", "time", "end", "worker")}
        x = self.slice(WORKERS_PID, tid, step_name(prefill, decodes), "step", start, end, args)
        mid = x["ts"] + x["dur"] / 2
        for rid in dict.fromkeys(request_id(k) for k in (*prefilling, *keys)):
            self.flow_points[rid].append((mid, WORKERS_PID, tid))

    def on_request(self, e: dict) -> None:
        if e.get("kind") in TRANSFER_KINDS:
            self.transfers[str(e["key"])].append(e)

    def on_mode(self, e: dict) -> None:
        tid, phase = self.server_tid("mode"), e.get("phase")
        args = _args(e)
        if phase in ("switch", "drain"):
            verb = "switch" if phase == "switch" else "drain, then switch"
            name = f"{verb} {mode_label(e.get('from'))} -> {mode_label(e.get('to'))}"
        elif phase == "serving":
            name = f"serving {mode_label(e.get('mode'))}"
        elif phase == "switched":
            name = f"switched to {mode_label(e.get('to'))}: {e.get('moved', 0)} moved"
            started, seconds = e.get("started"), e.get("seconds")
            if _is_number(started) and _is_number(seconds):
                start = max(float(started), self.t0)
                end = max(start, float(started) + float(seconds))
                self.slice(SERVER_PID, tid, f"switch {mode_label(e.get('from'))} -> {mode_label(e.get('to'))}",
                           "mode", start, end, args)  # fmt: skip
        else:
            name = f"mode {phase}"
        self.instant(SERVER_PID, tid, name, "mode", e["time"], args)

    def on_move(self, e: dict) -> None:
        rid = e.get("request_id") or request_id(str(e.get("key", "")))
        if e.get("phase") == "start":
            name = f"move {rid}: {e.get('from')} -> {e.get('to')} ({e.get('reason')})"
        else:
            name = f"moved {rid}" if e.get("outcome") == "moved" else f"move {rid} {e.get('outcome')}"
        self.instant(SERVER_PID, self.server_tid("moves"), name, "move", e["time"], _args(e))

    def on_advisor(self, e: dict) -> None:
        what = e.get("decision") or (f"switch to {mode_label(e['switch_to'])}" if e.get("switch_to") else "decision")
        self.instant(SERVER_PID, self.server_tid("advisor"), f"advisor: {what}", "advisor", e["time"], _args(e))

    def on_worker(self, e: dict) -> None:
        name = f"worker {e['worker']} {e.get('state')}"
        if e.get("state") == "drained" and e.get("moved") is not None:
            name += f": {e['moved']} moved"
        self.instant(WORKERS_PID, self.worker_tid(e["worker"]), name, "worker", e["time"], _args(e))

    # ---- KV transfers: a slice from transfer_start to its end, on the writer -> reader link --------
    def _transfers(self) -> None:
        done = []
        for key, evs in self.transfers.items():
            current = None
            for e in sorted(evs, key=lambda x: float(x["time"])):
                if e["kind"] == "transfer_start":
                    current = {"key": key, "start": e}
                    done.append(current)
                elif current is not None and e["kind"] not in current:
                    current[e["kind"]] = e  # the first of each kind after a start belongs to that start
        lanes: dict[tuple, list[float]] = defaultdict(list)  # (writer, reader) -> each lane's last end
        for t in sorted(done, key=lambda t: float(t["start"]["time"])):
            try:
                self._transfer(t, lanes)
            except (KeyError, TypeError, ValueError):
                self.skipped += 1

    def _transfer(self, t: dict, lanes: dict) -> None:
        s = t["start"]
        writer, reader = s["worker"], s.get("to")
        if reader is None:  # a simulator's transfer_start may leave it to the reader's transfer_end
            reader = t["transfer_end"]["worker"] if "transfer_end" in t else t.get("kv_copied", {}).get("to")
        start = float(s["time"])
        end_ev = t.get("transfer_end") or t.get("kv_sent") or t.get("kv_copied")
        end = max(start, float(end_ev["time"])) if end_ev is not None else max(start, self.t_last)
        pair = (writer, reader)
        lane = next((i for i, last in enumerate(lanes[pair]) if last <= start), None)
        if lane is None:
            lane = len(lanes[pair])
            lanes[pair].append(end)
        lanes[pair][lane] = end
        name = f"worker {writer} -> worker {reader}" + (f" #{lane + 1}" if lane else "")
        tid = self.tid(LINKS_PID, (writer, reader, lane), name)
        key = t["key"]
        rid = s.get("request_id") or request_id(key)
        is_move = any(m.get("key") == key and m.get("from") == writer and m.get("to") == reader
                      and float(m.get("time", start)) <= start for m in self.moves)  # fmt: skip
        nbytes = s.get("bytes") or (t.get("transfer_end") or {}).get("bytes")
        args = {"request_id": rid, "key": key, "from": writer, "to": reader, "bytes": nbytes,
                "end_seen": end_ev is not None}  # fmt: skip
        if nbytes and end > start:
            args["gbps"] = round(nbytes * 8 / (end - start) / 1e9, 3)
        if "transfer_end" in t:
            args["seconds"] = t["transfer_end"].get("seconds")
        if "kv_copied" in t:
            args["copied_after_ms"] = round((float(t["kv_copied"]["time"]) - start) * 1e3, 3)
        if "kv_sent" in t:
            args.update(outcome=t["kv_sent"].get("outcome"), error=t["kv_sent"].get("error"))
        x = self.slice(LINKS_PID, tid, "KV move" if is_move else "KV handoff", "kv", start, end, args)
        self.flow_points[rid].append((x["ts"] + x["dur"] / 2, LINKS_PID, tid))

    # ---- flows: a request's path through the steps and transfers that carried it -----------------
    def _flows(self) -> None:
        self.num_flows = 0
        for rid, points in self.flow_points.items():
            if len(points) < 2:
                continue
            self.num_flows += 1
            points.sort(key=lambda p: p[0])
            for i, (ts, pid, tid) in enumerate(points):
                ph = "s" if i == 0 else "f" if i == len(points) - 1 else "t"
                flow = {"ph": ph, "id": self.num_flows, "name": f"request {rid}", "cat": "request", "pid": pid,
                        "tid": tid, "ts": ts}  # fmt: skip
                if ph != "s":
                    flow["bp"] = "e"  # bound to the slice it lies in, not to the next one
                self.out.append(flow)


HANDLERS = {"step": _Builder.on_step, "request": _Builder.on_request, "mode": _Builder.on_mode,
            "move": _Builder.on_move, "advisor": _Builder.on_advisor, "worker": _Builder.on_worker}  # fmt: skip


def step_name(prefill_tokens: int, decodes: int) -> str:
    if prefill_tokens and decodes:
        return f"prefill {prefill_tokens} + {decodes} decode{'s' if decodes != 1 else ''}"
    if prefill_tokens:
        return f"prefill {prefill_tokens}"
    return f"decode x{decodes}" if decodes else "step"


def mode_label(mode) -> str:
    """{"mode": "disagg", "prefill_workers": 1, "decode_workers": 2} -> "disagg:1p2d" (bench's spelling)."""
    if not isinstance(mode, dict):
        return str(mode)
    name = str(mode.get("mode"))
    if name == "disagg" and "prefill_workers" in mode:
        return f"disagg:{mode['prefill_workers']}p{mode.get('decode_workers')}d"
    if name == "chunked" and "chunk_tokens" in mode:
        return f"chunked:{mode['chunk_tokens']}"
    return name


def request_id(key: str) -> str:
    """A request's attempt key is "<request_id>.<attempt>"."""
    return key.rpartition(".")[0] or key


def _args(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in ("type", "time")}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _sort_key(track: tuple):
    """Workers by id, links by pair and lane, server tracks in their order; mixed types by text."""
    _, key = track
    if isinstance(key, str) and key in SERVER_TRACKS:
        return (0, SERVER_TRACKS.index(key), "")
    parts = key if isinstance(key, tuple) else (key,)
    return (1, 0, tuple((0, p, "") if _is_number(p) else (1, 0, str(p)) for p in parts))
