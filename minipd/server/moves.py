"""Moving running replies between workers (the router's side of a move; the workers' side is a
handoff whose source is a decode, transfer/handoffs.py). A move asks for a seat on a worker that
can decode, then tells the worker holding the request to hand it over at its next token boundary.
The request keeps its key: tokens from both workers are put in order by their index. A move that
fails on the way is redone by the router from the prompt and the tokens sent (nothing is lost)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass

from minipd.workers import messages as m

DECODE_ROLES = ("both", "decode")
SLACK_TOKENS = 32  # tokens the reply may grow between the seat's size and the boundary where it moves
MOVE_ATTEMPTS = 3  # a reply that outgrew its seat while the seat came is asked again, with a bigger one
KEPT_MOVES = 500


@dataclass(slots=True)
class MoveRecord:
    request_id: str
    key: str
    source: int
    reason: str  # switch | drain | rebalance
    start: float  # time.time()
    target: int | None = None
    tokens: int = 0  # KV positions that moved
    bytes: int = 0
    seconds: float | None = None  # seat granted -> KV imported on the target
    outcome: str | None = None  # moved | refused | no_seat | ended | failed (| under_way: in move_all's answer)
    detail: str | None = None
    attempts: int = 1  # seats asked for: more than one when the reply outgrew the first


class Mover:
    def __init__(self, router):
        self.router = router
        self.pending: dict[str, tuple[MoveRecord, asyncio.Future]] = {}  # key -> (record, done)
        self.asking: set[str] = set()  # keys whose move waits for a seat
        self.recent: deque[dict] = deque(maxlen=KEPT_MOVES)
        self.outgrown: dict[str, int] = {}  # key -> its length when the source refused a seat too small
        self.counts: dict[str, int] = {}

    @staticmethod
    def can_decode(worker) -> bool:
        return worker.alive and worker.role in DECODE_ROLES and not worker.draining

    def settled_on(self, state) -> int | None:
        """The worker a request runs on, if it is not between workers (a handoff or move under way)."""
        p = state.placement
        if (state.finished or p is None or not p.dispatched or p.reader is not None or p.key in self.pending
                or p.key in self.asking):  # fmt: skip
            return None
        return p.worker

    def misplaced(self) -> list:
        """Requests whose worker cannot decode in the current mode (or is being drained), other than
        those that end at their next token (nothing would be left to decode where they went)."""
        workers = self.router.pool.workers
        return [s for s in self.router.requests.values()
                if (w := self.settled_on(s)) is not None and not self.can_decode(workers[w])
                and not s.ends_at_its_next_token()]  # fmt: skip

    async def move_all(self, states: list, reason: str, timeout: float,
                       seat_patience: float | None = None) -> list[MoveRecord]:  # fmt: skip
        """Move these requests to workers that can decode, all at once; wait up to `timeout`, and no
        longer than `seat_patience` for moves that all wait for a seat every worker that could give
        it has refused for lack of room (it comes when replies end there, which may be minutes)."""
        tasks = [self.router.spawn(self.move(s, reason)) for s in states]
        if not tasks:
            return []
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        patience = min(timeout, seat_patience) if seat_patience is not None else timeout
        done, pending = await asyncio.wait(tasks, timeout=patience)

        def seatless() -> bool:  # every move left waits for room, not for a slow answer
            return all(s.placement is not None and s.placement.key in self.asking
                       and self.router.seats.waiting_for_room(s.placement.key)
                       for t, s in zip(tasks, states) if t in pending)  # fmt: skip

        while pending and loop.time() < deadline and not seatless():
            more, pending = await asyncio.wait(pending, timeout=min(0.05, max(0.0, deadline - loop.time())))
            done |= more
        records = []
        for task, state in zip(tasks, states):
            if task not in done:  # it goes on, past the caller's patience: counted, not dropped
                key = state.placement.key if state.placement else ""
                waited = loop.time() - started
                why = (f"waiting for a seat (no worker that can decode had room) after {waited:.1f} s"
                       if key in self.asking else f"not over after {waited:.1f} s")  # fmt: skip
                records.append(MoveRecord(state.request_id, key, -1, reason, time.time(), outcome="under_way",
                                          detail=f"{why}; its end is in the request's timeline"))  # fmt: skip
            elif not task.cancelled() and task.exception() is None:
                records.append(task.result())
        return records

    async def move(self, state, reason: str, target_roles: tuple[str, ...] = DECODE_ROLES) -> MoveRecord:
        """Move one request. Its seat is sized for the reply's length now plus a slack; a reply that
        grew past it while the seat came (a slow moment) is asked again, with the slack three times
        what it grew by. The request's timeline keeps the last attempt, with their count."""
        slack = SLACK_TOKENS
        for attempt in range(1, MOVE_ATTEMPTS + 1):
            known = len(state.prompt_token_ids) + len(state.output_token_ids)
            rec = await self._move(state, reason, target_roles, slack)
            rec.attempts = attempt
            grown_to = self.outgrown.pop(rec.key, None)
            if rec.outcome != "refused" or grown_to is None:
                break
            slack = max(2 * slack, 3 * (grown_to - known))  # the next seat may wait behind others
        state.moves.append(asdict(rec))
        kept = self.router.finished.get(state.request_id)
        if kept is not None:  # the request ended while the move was under way: its kept timeline too
            kept["moves"] = list(state.moves)
        return rec

    async def _move(self, state, reason: str, target_roles: tuple[str, ...], slack: int) -> MoveRecord:
        r = self.router
        source = self.settled_on(state)
        rec = MoveRecord(state.request_id, state.placement.key if state.placement else "", source, reason, time.time())
        if rec.key in self.asking or rec.key in self.pending:
            return self._end(rec, "under_way", "another move of this request is under way")
        if source is None:
            return self._end(rec, "ended", "the request is not settled on a worker")
        p = state.placement
        longest = len(state.prompt_token_ids) + state.params.max_tokens
        num_tokens = min(len(state.prompt_token_ids) + len(state.output_token_ids) + slack, longest)
        headroom = r.dispatcher._headroom(state, num_tokens)
        self.asking.add(p.key)
        try:
            grant = await r.seats.ask(state, p.key, num_tokens, headroom, source, target_roles)
        finally:
            self.asking.discard(p.key)
        if grant is None and state.finished:
            return self._end(rec, "ended", "the request ended while its seat was on the way")
        if grant is None and state.placement is not p:
            return self._end(rec, "no_seat", "the request was placed anew (redone) while its seat was sought")
        if grant is None:
            return self._end(rec, "no_seat", "no worker that can decode had room (or a switch or a lost worker withdrew the ask)")
        reader, seat = grant
        rec.target = reader
        if state.finished or state.placement is not p or p.reader is not None or not r.pool.workers[source].alive:
            r.pool.send(reader, m.Abort(p.key, writer_done=True))
            return self._end(rec, "ended", "the request ended or moved while its seat was on the way")
        p.reader = reader
        p.first_token_at = time.monotonic()  # the handoff lease runs from here
        done = asyncio.get_running_loop().create_future()
        self.pending[p.key] = (rec, done)
        r.pool.send(source, m.Move(p.key, reader, seat))
        r.events.publish({"type": "move", "phase": "start", "request_id": state.request_id, "key": p.key,
                          "from": source, "to": reader, "reason": reason, "time": time.time()})  # fmt: skip
        return await done

    # ---- a worker that leaves -------------------------------------------------------------------
    async def drain_worker(self, worker_id: int, timeout: float = 60.0, stop: bool = False) -> dict:
        """Give the worker no new request, move its replies to the others (those it prefills or
        receives move once their KV lands), and, with stop=True, stop it afterwards (the supervisor
        starts it again, as after any exit). Returns what moved and what was left."""
        r = self.router
        w = r.pool.workers[worker_id]
        started, records = time.time(), []
        w.draining = True
        r.events.publish({"type": "worker", "worker": worker_id, "state": "draining", "time": started})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while w.alive and loop.time() < deadline and self._holding(worker_id):
            here = [s for s in self.misplaced() if s.placement.worker == worker_id]
            batch = await self.move_all(here, "drain", max(0.0, deadline - loop.time()))
            records += batch
            if not any(x.outcome == "moved" for x in batch):
                await asyncio.sleep(0.05)  # nothing moved this round: KV still landing here, or no room elsewhere
        left = self._holding(worker_id)
        outcome = {"worker": worker_id, "seconds": time.time() - started, "left": left, "stopped": False,
                   **summary(records)}  # fmt: skip
        if stop and w.alive:
            w.kill_reason = f"stopped on request after its replies were moved away ({left} left to redo)"
            w.stop_requested = True
            outcome["stopped"] = r.pool.send(worker_id, m.Shutdown())
        r.events.publish({"type": "worker", "worker": worker_id, "state": "drained", "time": time.time(), **outcome})
        return outcome

    def _holding(self, worker_id: int) -> int:
        return sum(1 for s in self.router.requests.values() if worker_id in s.holders)

    async def on_leaving(self, msg: m.Leaving, settle_s: float = 0.5) -> None:
        """A worker was sent SIGTERM. If the whole server is stopping (a SIGTERM to the process
        group reaches every worker), the main process's own drain handles it; else it leaves alone."""
        r = self.router
        w = r.pool.workers[msg.worker_id]
        if msg.incarnation != w.incarnation:
            return
        w.leaving = True
        await asyncio.sleep(settle_s)
        if not r.accepting or all(x.leaving for x in r.pool.workers if x.alive):
            return
        await self.drain_worker(msg.worker_id, stop=True)

    # ---- what the workers and the router report --------------------------------------------------
    def started(self, key: str, data: dict) -> None:
        """The source froze the reply (move_start): how many tokens' KV goes."""
        entry = self.pending.get(key)
        if entry is not None:
            entry[0].tokens = data.get("tokens", 0)

    def arrived(self, key: str, data: dict) -> None:
        entry = self.pending.get(key)
        if entry is not None:
            entry[0].bytes, entry[0].seconds = data.get("bytes", 0), data.get("seconds")
            entry[0].tokens = entry[0].tokens or data.get("tokens", 0)  # move_start may come in after it
            self.finish(key, "moved")

    def finish(self, key: str, outcome: str, detail: str | None = None, outgrown_at: int | None = None) -> None:
        entry = self.pending.pop(key, None)
        if entry is None:
            return
        if outgrown_at is not None:
            self.outgrown[key] = outgrown_at
        rec, done = entry
        self._end(rec, outcome, detail)
        if not done.done():
            done.set_result(rec)

    def _end(self, rec: MoveRecord, outcome: str, detail: str | None = None) -> MoveRecord:
        rec.outcome, rec.detail = outcome, detail
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        row = asdict(rec)
        self.recent.append(row)
        r = self.router
        r.metrics.moves.labels(r.metrics.model, rec.reason, outcome).inc()
        if outcome == "moved":
            r.metrics.move_bytes.labels(r.metrics.model).inc(rec.bytes)
        r.events.publish({"type": "move", "phase": "end", **row, "time": time.time()})
        return rec


def summary(records: list[MoveRecord]) -> dict:
    """How a batch of moves went: counts, bytes, the slowest."""
    moved = [x for x in records if x.outcome == "moved"]
    return {"moved": len(moved), "not_moved": len(records) - len(moved), "bytes": sum(x.bytes for x in moved),
            "slowest_move_seconds": max((x.seconds or 0.0 for x in moved), default=None),
            "outcomes": {o: sum(1 for x in records if x.outcome == o) for o in {x.outcome for x in records}}}  # fmt: skip
