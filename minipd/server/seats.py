"""Decode seats for disaggregated requests (backpressure: nothing is prefilled before its seat
exists). Requests wait first come, first seated; seats are asked for in batches, one batch in
flight per decode worker, so one round trip to a busy decode worker seats every waiting request
that fits, instead of one per decode step. A seat a worker refuses is either "no room now" (the
request waits, and the worker is not asked again until it has more room) or "this request cannot
be seated" (its RequestError ends that request alone). A move asks for its seat here too, on
any worker that can decode (`roles`) other than the one it leaves."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass

from minipd.engine.block_manager import blocks_for
from minipd.server.worker_pool import unresponsive
from minipd.workers import messages as m

MAX_BATCH = 64


@dataclass(slots=True, eq=False)
class Want:
    state: object  # RequestState
    key: str
    num_tokens: int  # tokens whose KV the seat receives
    headroom: int  # tokens booked for the reply's growth
    writer: int  # the prefill worker that will write into the seat
    future: asyncio.Future  # -> (decode worker, block ids), or None: ask again later
    roles: tuple[str, ...] = ("decode",)  # the workers that may seat it
    unseatable: bool = False  # the worker could not seat this request: an error for it, not a lack of room

    def fits(self, worker) -> bool:
        return worker.role in self.roles and worker.worker_id != self.writer

    def wanted(self) -> bool:
        s = self.state
        return not self.future.done() and not s.finished and s.placement is not None and s.placement.key == self.key


class SeatBroker:
    def __init__(self, pool, load, give_back):
        """load(worker_id) -> requests it holds; give_back(worker_id, key): free a seat nobody wants."""
        self.pool, self.load, self.give_back = pool, load, give_back
        self.queue: deque[Want] = deque()
        self.in_flight: dict[int, tuple[int, list[Want]]] = {}  # decode worker -> (batch id, wants)
        self.full: dict[int, int] = {}  # decode worker -> blocks it had free when it last refused
        self.batch_ids = itertools.count()
        self.turn = 0  # which decode worker goes first among equally loaded ones
        self.batches_sent = self.seats_granted = 0

    def ask(self, state, key: str, num_tokens: int, headroom: int, writer: int,
            roles: tuple[str, ...] = ("decode",)) -> asyncio.Future:  # fmt: skip
        want = Want(state, key, num_tokens, headroom, writer, asyncio.get_running_loop().create_future(), roles)
        self.queue.append(want)
        self.pump()
        return want.future

    @property
    def num_waiting(self) -> int:
        return len(self.queue) + sum(len(w) for _, w in self.in_flight.values())

    def pump(self) -> None:
        """Send a batch to every seating worker that has none in flight and may have room."""
        self._drop_unwanted()
        if not self.queue:
            return
        roles = {r for want in self.queue for r in want.roles}
        n = len(self.pool.workers)
        seating = sorted((w for w in self.pool.workers if w.alive and w.role in roles and not w.draining),
                         key=lambda w: (self.load(w.worker_id), (w.worker_id - self.turn) % n))  # fmt: skip
        silent = unresponsive(self.pool, seating)  # a stopped worker would sit on its batch until it is replaced
        seating = [w for w in seating if w.worker_id not in silent] or seating
        if seating:
            self.turn = seating[0].worker_id + 1
        for w in seating:
            if not self.queue:
                return
            if w.worker_id in self.in_flight or w.worker_id in self.full:
                continue
            room = _available(w)
            take, need = [], 0
            for want in self.queue:
                if len(take) == MAX_BATCH:
                    break
                if not want.fits(w):
                    continue
                blocks = blocks_for(want.num_tokens + 1 + want.headroom, w.info.block_size)
                if take and need + blocks > room:
                    break
                take.append(want)
                need += blocks
            if not take:
                continue
            for want in take:
                self.queue.remove(want)
            batch = next(self.batch_ids)
            seats = [[t.key, t.num_tokens, t.headroom, t.writer] for t in take]
            if self.pool.send(w.worker_id, m.ReserveSeats(batch, seats)):
                self.in_flight[w.worker_id] = (batch, take)
                self.batches_sent += 1
            else:
                self.queue.extendleft(reversed(take))

    def waiting_for_room(self, key: str) -> bool:
        """This seat is asked for, and every worker that could give it has said it has no room now."""
        want = next((w for w in self.queue if w.key == key), None)
        if want is None:
            return False
        could = [w for w in self.pool.workers if w.alive and not w.draining and want.fits(w)]
        return all(w.worker_id in self.full for w in could)

    def on_reply(self, msg: m.SeatsReserved) -> None:
        entry = self.in_flight.get(msg.worker_id)
        if entry is None or entry[0] != msg.batch:
            for key, blocks in msg.results:  # a batch nobody waits for any more
                if blocks is not None:
                    self.give_back(msg.worker_id, key)
            return
        del self.in_flight[msg.worker_id]
        refused = []
        for want, (key, blocks) in zip(entry[1], msg.results):
            if blocks is None and not want.unseatable:
                refused.append(want)  # no room now
            elif blocks is None:
                if not want.future.done():
                    want.future.set_result(None)  # its error ends it
            elif want.wanted():
                self.seats_granted += 1
                want.future.set_result((msg.worker_id, blocks))
            else:
                self.give_back(msg.worker_id, key)
                if not want.future.done():
                    want.future.set_result(None)  # its request ended meanwhile
        if refused:
            w = self.pool.workers[msg.worker_id]
            self.full[msg.worker_id] = _available(w)
            self.queue.extendleft(reversed(refused))
        self.pump()

    def on_error(self, worker_id: int, key: str) -> None:
        """The worker could not seat this request. It says so before its SeatsReserved, where the
        request's None is then about the request, not about the worker's room."""
        entry = self.in_flight.get(worker_id)
        for want in entry[1] if entry else ():
            if want.key == key:
                want.unseatable = True

    def on_worker_change(self, worker_id: int) -> None:
        """New stats from a worker: a decode worker that refused may have room again."""
        if worker_id in self.full and _available(self.pool.workers[worker_id]) > self.full[worker_id]:
            del self.full[worker_id]
        if self.queue:
            self.pump()

    def on_worker_lost(self, worker_id: int) -> None:
        entry = self.in_flight.pop(worker_id, None)
        if entry is not None:
            self.queue.extendleft(reversed(entry[1]))
        self.full.pop(worker_id, None)
        coming = [w for w in self.pool.workers if w.state != "dead"]
        for want in [w for w in self.queue if w.writer == worker_id or not any(w.fits(x) for x in coming)]:
            self.queue.remove(want)
            if not want.future.done():
                want.future.set_result(None)  # its writer is gone, or no worker that may seat it will come back
        self.pump()

    def cancel_all(self) -> None:
        """A mode switch: everyone waiting goes round again (batches in flight give their seats back)."""
        for want in [*self.queue, *(w for _, ws in self.in_flight.values() for w in ws)]:
            if not want.future.done():
                want.future.set_result(None)
        self.queue.clear()
        self.full.clear()

    def _drop_unwanted(self) -> None:
        if any(not w.wanted() for w in self.queue):
            for want in [w for w in self.queue if not w.wanted()]:
                self.queue.remove(want)
                if not want.future.done():
                    want.future.set_result(None)


def _available(w) -> int:
    s = w.stats
    if s is None:
        return w.info.num_blocks
    return s.blocks_total - s.blocks_used - s.blocks_booked
