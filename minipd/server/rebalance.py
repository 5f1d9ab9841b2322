"""Rebalancing between the workers that decode (off by default, `serve --rebalance-ratio R`; on at
AUTO_RATIO while `auto` is, unless a ratio was given).

The router places each request on the least loaded worker, but loads drift apart: replies of very
different lengths end unevenly, and a worker that was drained or restarted comes back empty while
the others hold everything. A decode step's time grows with its batch, so the replies on the
crowded worker run slower until they end. Every `interval_s` the rebalancer compares the replies
settled on each worker that can decode; when the most crowded holds more than `ratio` times the
emptiest's (and at least `min_gap` more), it moves replies from it at their next token boundary
(server/moves.py), those with the most tokens still to make first (and at least `min_tokens_left`:
a reply about to end is not worth its move; a reply moves for balance once at most), until the
two would be even.
Nothing moves while a mode switch or another move is under way."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("minipd.rebalance")
AUTO_RATIO = 2.0  # `auto` switches leave the old decode workers holding every reply: it rebalances unless told


class Rebalancer:
    def __init__(self, router, ratio: float | None = None, interval_s: float = 1.0, min_gap: int = 4,
                 min_tokens_left: int = 32):  # fmt: skip
        self.router = router
        self.chosen_ratio = ratio  # None: off, but AUTO_RATIO while the advisor (`auto`) is on
        self.interval_s, self.min_gap = interval_s, min_gap
        self.min_tokens_left = min_tokens_left  # a reply about to end is not worth its move
        self.rounds = 0  # rounds that moved something
        self.task: asyncio.Task | None = None

    @property
    def ratio(self) -> float:
        if self.chosen_ratio is not None:
            return self.chosen_ratio
        return AUTO_RATIO if self.router.advisor.enabled else 0.0

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def start(self) -> None:
        if self.task is None:
            self.task = self.router.spawn(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.enabled:
                continue
            try:
                await self.once()
            except Exception:
                log.exception("a rebalancing round failed")

    def plan(self) -> tuple[int, int, list]:
        """(crowded worker, emptiest worker, the replies to move from the one to the other); no
        replies when the loads are within bounds."""
        r = self.router
        mover = r.mover
        if r.target is not None or mover.pending:
            return -1, -1, []
        decoding = [w.worker_id for w in r.pool.workers if mover.can_decode(w)]
        if len(decoding) < 2:
            return -1, -1, []
        settled: dict[int, list] = {w: [] for w in decoding}  # a prompt being read counts where it will decode
        for state in r.requests.values():
            where = mover.settled_on(state)
            if where in settled:
                settled[where].append(state)
        crowded = max(decoding, key=lambda w: len(settled[w]))
        emptiest = min(decoding, key=lambda w: len(settled[w]))
        hi, lo = len(settled[crowded]), len(settled[emptiest])
        if hi - lo < self.min_gap or hi <= self.ratio * lo:
            return crowded, emptiest, []
        decoding_there = [s for s in settled[crowded] if s.output_token_ids  # one reading its prompt stays
                          and s.tokens_left() >= self.min_tokens_left
                          and not any(mv["reason"] == "rebalance" for mv in s.moves)]  # moved once: no ping-pong  # fmt: skip
        to_make = sorted(decoding_there, key=lambda s: -s.tokens_left())
        return crowded, emptiest, to_make[: (hi - lo) // 2]

    async def once(self) -> list:
        """One round: move what plan() says; returns the moves' records."""
        crowded, emptiest, states = self.plan()
        if not states:
            return []
        r = self.router
        r.events.publish({"type": "rebalance", "from": crowded, "to": emptiest, "replies": len(states),
                          "time": time.time()})  # fmt: skip
        records = await r.mover.move_all(states, "rebalance", timeout=r.limits.kv_transfer_timeout)
        self.rounds += any(x.outcome == "moved" for x in records)
        return records
