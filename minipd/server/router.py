"""The router: admits requests, picks workers for the current mode, reserves decode seats
(backpressure), relays tokens to the HTTP handlers, and switches modes at run time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from minipd.detokenizer import TextStream
from minipd.sampling_params import SamplingParams
from minipd.server.metrics import Metrics
from minipd.server.protocol import ApiError
from minipd.server.request_state import Delta, RequestState
from minipd.server.worker_pool import WorkerPool
from minipd.workers import messages as m

log = logging.getLogger("minipd.router")
MODES = ("colocated", "chunked", "disagg")


@dataclass(slots=True)
class Mode:
    name: str = "colocated"
    prefill_workers: int = 1
    decode_workers: int = 1
    chunk_tokens: int = 512

    def check(self, num_workers: int) -> None:
        if self.name not in MODES:
            raise ApiError(f"mode must be one of {MODES}", param="mode")
        if self.chunk_tokens < 1:
            raise ApiError("chunk_tokens must be >= 1", param="chunk_tokens")
        if self.name == "disagg":
            p, d = self.prefill_workers, self.decode_workers
            if p < 1 or d < 1 or p + d > num_workers:
                raise ApiError(f"disagg needs prefill_workers >= 1 and decode_workers >= 1 with P + D <= "
                               f"{num_workers} workers, got {p}P{d}D", param="prefill_workers")  # fmt: skip

    def roles(self, num_workers: int) -> list[str]:
        if self.name != "disagg":
            return ["both"] * num_workers
        p, d = self.prefill_workers, self.decode_workers
        return ["prefill"] * p + ["decode"] * d + ["idle"] * (num_workers - p - d)

    def as_dict(self) -> dict:
        return {"mode": self.name, "prefill_workers": self.prefill_workers,
                "decode_workers": self.decode_workers, "chunk_tokens": self.chunk_tokens}  # fmt: skip


class Router:
    def __init__(self, pool: WorkerPool, tokenizer, metrics: Metrics, max_waiting: int = 256,
                 max_running_per_worker: int = 64, kv_transfer_timeout: float = 60.0):  # fmt: skip
        self.pool = pool
        self.kv_transfer_timeout = kv_transfer_timeout  # a handoff's lease: past it, the request fails
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_running_per_worker = max_running_per_worker
        self.mode = Mode()
        self.requests: dict[str, RequestState] = {}
        self.finished: OrderedDict[str, dict] = OrderedDict()  # recent timelines
        self.num_waiting_for_seat = 0
        self.dispatching = 0  # dispatches under way (they finish before a mode switch proceeds)
        self.seat_lock = asyncio.Lock()
        self.capacity_changed = asyncio.Event()
        self.seat_replies: dict[str, asyncio.Future] = {}
        self.mode_acks: dict[int, asyncio.Future] = {}
        self.serving = asyncio.Event()
        self.switching = asyncio.Lock()
        self.ready = False
        self.dead: list[int] = []

    # ---- requests ------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        if self.dead:
            raise ApiError(f"worker(s) {self.dead} died; the server cannot serve", 503, type_="server_error")
        capacity = self.max_running_per_worker * sum(w.alive for w in self.pool.workers)
        if len(self.requests) >= capacity + self.max_waiting:
            raise ApiError("the server is overloaded; try again later", 429, type_="rate_limit_error")
        stream = TextStream(self.tokenizer, params.stop) if self.tokenizer else None
        state = RequestState(request_id, prompt_token_ids, params, stream)
        self.requests[request_id] = state
        self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(prompt_token_ids))
        asyncio.get_running_loop().create_task(self._dispatch(state))
        return state

    async def _dispatch(self, state: RequestState) -> None:
        try:
            while not state.finished:
                await self.serving.wait()
                self.dispatching += 1
                try:
                    if self.mode.name != "disagg":
                        await self._dispatch_colocated(state)
                        return
                    if await self._dispatch_disagg(state):
                        return
                finally:
                    self.dispatching -= 1
                # a mode switch began while it waited for a seat: go round again in the new mode
        except Exception as err:  # never lose a request silently
            log.exception("dispatch of %s failed", state.request_id)
            self._end(state, error=f"could not dispatch the request: {err}")

    async def _dispatch_colocated(self, state: RequestState) -> None:
        worker = self._least_loaded(self._workers_with_role("both"))
        state.prefill_worker = state.decode_worker = worker.worker_id
        worker.inflight.add(state.request_id)
        state.events["dispatched"] = time.time()
        await self.pool.send(worker.worker_id, m.AddRequest(state.request_id, state.prompt_token_ids,
                                                            state.params.to_dict()))  # fmt: skip

    async def _dispatch_disagg(self, state: RequestState) -> bool:
        """False if a mode switch interrupted the wait for a seat."""
        self.num_waiting_for_seat += 1
        try:
            async with self.seat_lock:  # first come, first seated
                decode, seat = await self._reserve_seat(state)
        finally:
            self.num_waiting_for_seat -= 1
        if decode is None:
            return state.finished
        if state.finished:
            await self.pool.send(decode.worker_id, m.Abort(state.request_id))
            return True
        state.events["seat_reserved"] = time.time()
        state.decode_worker = decode.worker_id
        decode.inflight.add(state.request_id)
        prefill = self._least_loaded(self._workers_with_role("prefill"))
        state.prefill_worker = prefill.worker_id
        prefill.inflight.add(state.request_id)
        state.events["dispatched"] = time.time()
        await self.pool.send(prefill.worker_id, m.AddRequest(state.request_id, state.prompt_token_ids,
                                                             state.params.to_dict(), decode.worker_id, seat))  # fmt: skip
        return True

    async def _reserve_seat(self, state: RequestState):
        """Ask decode workers for room for this prompt's KV; wait for a request to end if none has it."""
        while not state.finished and self.serving.is_set():
            self.capacity_changed.clear()
            decoders = sorted(self._workers_with_role("decode"), key=lambda w: len(w.inflight))
            for w in decoders:
                fut = asyncio.get_running_loop().create_future()
                self.seat_replies[state.request_id] = fut
                await self.pool.send(w.worker_id, m.ReserveSeat(state.request_id, len(state.prompt_token_ids)))
                try:
                    seat = await asyncio.wait_for(fut, timeout=30)
                finally:
                    self.seat_replies.pop(state.request_id, None)
                if seat is not None:
                    return w, seat
            if not any(w.inflight for w in decoders):
                self._end(state, error="the prompt does not fit in any decode worker's KV cache")
                return None, None
            try:
                await asyncio.wait_for(self.capacity_changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        return None, None

    def _workers_with_role(self, role: str):
        workers = [w for w in self.pool.workers if w.alive and w.role == role]
        if not workers:
            raise RuntimeError(f"no live worker has the role {role!r}")
        return workers

    @staticmethod
    def _least_loaded(workers):
        return min(workers, key=lambda w: (len(w.inflight), w.worker_id))

    async def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None or state.finished:
            return
        holders = state.holders
        self._end(state, finish_reason="abort")
        for w in holders:
            await self.pool.send(w, m.Abort(request_id))

    # ---- messages from workers ---------------------------------------------------------
    def on_message(self, msg) -> None:
        if isinstance(msg, m.WorkerStats):
            self._on_stats(msg)
            return
        if isinstance(msg, m.ModeSet):
            fut = self.mode_acks.get(msg.worker_id)
            if fut and not fut.done():
                fut.set_result(msg)
            return
        if isinstance(msg, m.SeatReply):
            fut = self.seat_replies.get(msg.request_id)
            if fut and not fut.done():
                fut.set_result(msg.block_ids)
            elif msg.block_ids is not None:  # nobody waits for it any more: give the seat back
                asyncio.get_running_loop().create_task(self.pool.send(msg.worker_id, m.Abort(msg.request_id)))
            return
        state = self.requests.get(msg.request_id)
        if state is None or state.finished:
            return
        if isinstance(msg, m.Tokens):
            self._on_tokens(state, msg)
        elif isinstance(msg, m.Event):
            state.events[msg.kind] = msg.time
            if msg.kind == "prefill_start":
                self.metrics.queue_time.labels(self.metrics.model).observe(msg.time - state.arrival)
            elif msg.kind == "transfer_start":
                asyncio.get_running_loop().call_later(self.kv_transfer_timeout, self._transfer_lease_ended, state)
            elif msg.kind == "transfer_end":
                state.kv_bytes, state.kv_seconds = msg.data["bytes"], msg.data["seconds"]
                self.metrics.kv_bytes.labels(self.metrics.model).inc(state.kv_bytes)
                self.metrics.kv_seconds.labels(self.metrics.model).observe(state.kv_seconds)
        elif isinstance(msg, m.RequestError):
            self._fail(state, msg.message, skip=msg.worker_id)

    def _transfer_lease_ended(self, state: RequestState) -> None:
        if not state.finished and "transfer_end" not in state.events:
            self._fail(state, f"the KV handoff did not finish within {self.kv_transfer_timeout:g} s")

    def _fail(self, state: RequestState, message: str, skip: int | None = None) -> None:
        """End a request with an error and free what every other worker holds for it."""
        holders = state.holders - {skip}
        self._end(state, error=message)
        for w in holders:
            asyncio.get_running_loop().create_task(self.pool.send(w, m.Abort(state.request_id)))

    def _on_tokens(self, state: RequestState, msg: m.Tokens) -> None:
        model = self.metrics.model
        if state.token_times:
            self.metrics.itl.labels(model).observe(msg.time - state.token_times[-1])
        else:
            self.metrics.ttft.labels(model).observe(msg.time - state.arrival)
        state.token_times += [msg.time] * len(msg.token_ids)
        state.output_token_ids += msg.token_ids
        self.metrics.generation_tokens.labels(model).inc(len(msg.token_ids))
        text = state.stream.push(msg.token_ids, final=msg.finished) if state.stream else ""
        stopped = state.stream is not None and state.stream.stopped
        if msg.finished or stopped:
            holders = state.holders
            reason = "stop" if stopped else msg.finish_reason
            self._end(state, finish_reason=reason, text=text, num_tokens=len(msg.token_ids))
            for w in holders if (stopped and not msg.finished) or msg.worker_id != state.decode_worker else ():
                # a stop string the engine cannot see, or a request that ended during prefill:
                # free what the other side holds (its running sequence or its reserved seat)
                asyncio.get_running_loop().create_task(self.pool.send(w, m.Abort(state.request_id)))
            return
        state.deltas.put_nowait(Delta(text, len(msg.token_ids)))

    def _on_stats(self, msg: m.WorkerStats) -> None:
        self.pool.workers[msg.worker_id].stats = msg
        usage = msg.blocks_used / max(1, msg.blocks_total)
        self.metrics.kv_usage.labels(self.metrics.model, str(msg.worker_id)).set(usage)
        stats = [w.stats for w in self.pool.workers if w.stats]
        self.metrics.running.labels(self.metrics.model).set(sum(s.num_running for s in stats))
        waiting = sum(s.num_waiting for s in stats) + self.num_waiting_for_seat
        self.metrics.waiting.labels(self.metrics.model).set(waiting)

    def _end(self, state: RequestState, finish_reason: str | None = None, error: str | None = None,
             text: str = "", num_tokens: int = 0) -> None:  # fmt: skip
        if state.finished:
            return
        state.finished = True
        state.finish_reason = finish_reason if error is None else "error"
        state.events["finish"] = time.time()
        for w in state.holders:
            self.pool.workers[w].inflight.discard(state.request_id)
        self.requests.pop(state.request_id, None)
        if error is None:
            self.metrics.e2e.labels(self.metrics.model).observe(state.events["finish"] - state.arrival)
        self.metrics.success.labels(self.metrics.model, state.finish_reason).inc()
        self.finished[state.request_id] = state.timeline()
        while len(self.finished) > 2000:
            self.finished.popitem(last=False)
        state.deltas.put_nowait(Delta(text, num_tokens, state.finish_reason, error))
        self.capacity_changed.set()

    def timeline(self, request_id: str) -> dict | None:
        state = self.requests.get(request_id)
        return state.timeline() if state else self.finished.get(request_id)

    # ---- worker deaths -------------------------------------------------------------
    async def watch_workers(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for w in self.pool.dead_workers():
                log.error("worker %d (pid %s) died with exit code %s", w.worker_id, w.pid, w.process.exitcode)
                self.dead.append(w.worker_id)
                for state in [s for s in self.requests.values() if w.worker_id in s.holders]:
                    self._fail(state, f"worker {w.worker_id} died while serving this request", skip=w.worker_id)

    # ---- modes ---------------------------------------------------------------------
    async def set_mode(self, mode: Mode, drain_timeout: float = 600.0) -> None:
        mode.check(len(self.pool.workers))
        async with self.switching:
            self.serving.clear()  # new requests wait at the door
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_timeout
            while self.dispatching or any(s.prefill_worker is not None for s in self.requests.values()):
                if loop.time() > deadline:
                    self.serving.set()
                    raise ApiError("could not drain running requests in time", 503, type_="server_error")
                await asyncio.sleep(0.02)
            roles = mode.roles(len(self.pool.workers))
            peers = {w.worker_id: {"kv_address": w.info.kv_address, "cache_name": w.info.kv_cache_name,
                                   "cache_shape": w.info.kv_cache_shape, "cache_dtype": w.info.kv_cache_dtype,
                                   "cache_handle": w.info.kv_cache_handle}
                     for w in self.pool.workers}  # fmt: skip
            policy = "chunked" if mode.name == "chunked" else "prefill_first"
            self.mode_acks = {w.worker_id: loop.create_future() for w in self.pool.workers if w.alive}
            for w, role in zip(self.pool.workers, roles):
                if w.alive:
                    await self.pool.send(w.worker_id, m.SetMode(role if role != "idle" else "both", policy,
                                                                mode.chunk_tokens, peers))  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*self.mode_acks.values()), timeout=60)
            for w, role in zip(self.pool.workers, roles):
                w.role = role
            self.mode = mode
            self.serving.set()
