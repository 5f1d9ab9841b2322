"""Placing a request on the workers of the current mode: the least loaded worker in colocated and
chunked; in disagg a prefill worker plus a seat on a decode worker, asked for before the prompt
is sent (backpressure). A request redone after a worker died is placed again the same way, with
the tokens already sent, which the new worker recomputes and continues from."""

from __future__ import annotations

import asyncio
import logging
import time

from minipd.engine.block_manager import blocks_for
from minipd.server.request_state import Placement, RequestState
from minipd.server.worker_pool import unresponsive
from minipd.workers import messages as m

log = logging.getLogger("minipd.dispatch")


class Dispatcher:
    def __init__(self, router, decode_headroom_tokens: int = 512):
        self.router = router
        self.decode_headroom_tokens = decode_headroom_tokens
        self.next_turn: dict[str, int] = {}  # role -> worker id whose turn it is among equally loaded ones

    async def place(self, state: RequestState) -> None:
        r = self.router
        try:
            while not state.finished:
                await r.serving.wait()
                if state.finished:
                    return
                r.placing += 1
                try:
                    placed = await (self._disagg(state) if r.mode.name == "disagg" else self._colocated(state))
                finally:
                    r.placing -= 1
                if placed:
                    return
        except Exception as err:  # never lose a request silently
            log.exception("placing %s failed", state.request_id)
            r.fail(state, f"could not place the request: {err}")

    async def _colocated(self, state: RequestState, role: str = "both") -> bool:
        """The whole request on one worker: of the role `both`; in disagg a prompt under
        local_prefill_tokens on a decode worker, which reads it itself (no handoff to pay for), or
        a request that ends at its first token on a prefill worker (no decode seat to hold)."""
        r = self.router
        w = await self._pick(state, role)
        if w is None:
            return False
        p = r.assign(state, Placement(state.new_key(), worker=w.worker_id))
        if role != "both":  # (disagg) it makes all its tokens there
            state.decode_worker = w.worker_id
            self._path(state, "local" if role == "decode" else "prefill_only", w.worker_id)
        return self._send_request(state, p)

    async def _disagg(self, state: RequestState) -> bool:
        r = self.router
        if state.local_only or len(state.prompt_token_ids) + len(state.output_token_ids) < r.mode.local_prefill_tokens:
            return await self._colocated(state, "decode")
        if state.ends_at_its_next_token():  # max_tokens 1, echo-only scoring: nothing for a decode worker to do
            return await self._colocated(state, "prefill")
        writer = await self._pick(state, "prefill")
        if writer is None or await self._pick(state, "decode") is None:
            return False
        p = r.assign(state, Placement(state.new_key(), worker=writer.worker_id))
        self._path(state, "remote", writer.worker_id)
        num_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        if not self._fits_a_decode_worker(state, num_tokens):
            return True
        grant = await r.seats.ask(state, p.key, num_tokens, self._headroom(state, num_tokens), writer.worker_id)
        if grant is None:  # a switch, its writer died, or it ended while waiting: go round again
            r.unassign(state)
            return state.finished
        reader, seat = grant
        if state.finished:  # it ended while its seat was on the way: nobody will write into it
            r.pool.send(reader, m.Abort(p.key, writer_done=True))
            return True
        p.reader = reader
        state.events["seat_reserved"] = time.time()
        r.metrics.seats_reserved.labels(r.metrics.model).inc()
        if not writer.alive or not r.pool.workers[reader].alive:  # one of them died while the seat was on its way
            r.release_holders(state)
            return False
        return self._send_request(state, p, seat)

    def _path(self, state: RequestState, path: str, worker: int) -> None:
        r = self.router
        state.path = path
        r.metrics.placements.labels(r.metrics.model, path).inc()
        r.events.publish({"type": "request", "kind": "placed", "request_id": state.request_id, "path": path,
                          "worker": worker, "time": time.time()})  # fmt: skip

    def _send_request(self, state: RequestState, p: Placement, seat: list[int] | None = None) -> bool:
        r = self.router
        msg = m.AddRequest(p.key, state.prompt_token_ids, state.params.to_dict(), list(state.output_token_ids),
                           p.reader, seat)  # fmt: skip
        state.events["dispatched"] = time.time()  # before it goes: the worker's own events may come first
        if not r.pool.send(p.worker, msg):
            del state.events["dispatched"]
            r.release_holders(state)
            return False
        p.dispatched = True
        return True

    async def _pick(self, state: RequestState, role: str):
        """The least loaded live worker of the role, among those that show signs of life if any
        does; waits while one is being restarted."""
        r = self.router
        while True:
            live = r.pool.with_role(role)
            if live:
                silent = unresponsive(r.pool, live)
                live = [w for w in live if w.worker_id not in silent] or live
                turn, n = self.next_turn.get(role, 0), len(r.pool.workers)
                w = min(live, key=lambda w: (r.load(w.worker_id), (w.worker_id - turn) % n))
                self.next_turn[role] = w.worker_id + 1
                return w
            coming = [w for w in r.pool.workers  # a drained worker comes back when it is resumed or restarted
                      if w.role == role and (w.state in ("starting", "restarting") or w.draining and w.alive)]  # fmt: skip
            if not coming:
                causes = "; ".join(w.exit_cause for w in r.pool.workers if w.role == role and w.exit_cause)
                which = "" if role == "both" else f"{role} "
                r.fail(state, f"no {which}worker is alive" + (f" ({causes})" if causes else ""), status=503,
                       code="no_worker")  # fmt: skip
                return None
            r.workers_changed.clear()
            try:
                await asyncio.wait_for(r.workers_changed.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            if state.finished or not r.serving.is_set():
                return None

    def _headroom(self, state: RequestState, num_tokens: int) -> int:
        """Tokens booked in the seat for the reply still to come, so decoding never preempts."""
        left = state.tokens_left()
        decoders = self.router.pool.with_role("decode")
        capacity = max(w.info.num_blocks * w.info.block_size for w in decoders) if decoders else 0
        return max(0, min(self.decode_headroom_tokens, left, capacity - num_tokens - 1))

    def _fits_a_decode_worker(self, state: RequestState, num_tokens: int) -> bool:
        decoders = self.router.pool.with_role("decode")
        if any(blocks_for(num_tokens + 1, w.info.block_size) <= w.info.num_blocks for w in decoders):
            return True
        if decoders:
            self.router.fail(state, f"the prompt ({num_tokens} tokens) does not fit in any decode worker's KV cache")
            return False
        return True  # none is up right now: the seat broker waits for one
