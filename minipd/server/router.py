"""The router: the table of requests in flight. It admits them, hands them to the dispatcher,
turns what the workers say into what the clients see, ends them, and redoes a request whose
worker died or whose tokens were lost on the way. It raises the server's own errors
(server/errors.py), never HTTP ones."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from minipd.detokenizer import TextStream
from minipd.sampling_params import SamplingParams
from minipd.server.advisor import Advisor
from minipd.server.dispatch import Dispatcher
from minipd.server.errors import Overloaded, Unavailable
from minipd.server.events import EventLog
from minipd.server.metrics import Metrics
from minipd.server.modes import Mode, ModeSwitcher
from minipd.server.moves import Mover
from minipd.server.rebalance import Rebalancer
from minipd.server.relay import Relay
from minipd.server.request_state import Delta, Placement, RequestState
from minipd.server.seats import SeatBroker
from minipd.server.worker_pool import WorkerPool
from minipd.workers import messages as m

log = logging.getLogger("minipd.router")
KEPT_TIMELINES = 2000
KEPT_TOKEN_TIMES = 1_000_000  # over all kept timelines: about 32 MB as Python floats


@dataclass(slots=True)
class Limits:
    max_waiting: int = 256  # requests queued beyond what the workers run (429 past it)
    max_running_per_worker: int = 64
    kv_transfer_timeout: float = 60.0  # disagg: first token made -> KV imported
    request_timeout: float = 600.0
    decode_headroom_tokens: int = 512
    max_redos: int = 3
    token_gap_timeout: float = 2.0  # later tokens arrived, an earlier one did not: lost past this, and redone


class Router:
    def __init__(self, pool: WorkerPool, tokenizer, metrics: Metrics, limits: Limits | None = None,
                 events: EventLog | None = None, switch_drain_timeout: float = 600.0, kv_transport: str = "shm",
                 target: Mode | None = None):  # fmt: skip
        self.pool = pool
        self.kv_transport = kv_transport
        self.tokenizer = tokenizer
        self.metrics = metrics
        metrics.waiting.labels(metrics.model).set_function(self.num_waiting)  # read when scraped
        self.limits = limits or Limits()
        self.events = events or EventLog()
        self.requests: dict[str, RequestState] = {}
        self.by_key: dict[str, RequestState] = {}
        self.finished: OrderedDict[str, dict] = OrderedDict()  # recent timelines
        self.finished_token_times = 0  # how many token times they hold
        self.mode = Mode()  # the mode the workers serve in
        self.target = target  # the mode a switch (the start's too) is bringing them into, else None
        self.relay = Relay(metrics, kv_transport)
        self.seats = SeatBroker(pool, self.load, self._give_back_seat)
        self.dispatcher = Dispatcher(self, self.limits.decode_headroom_tokens)
        self.switcher = ModeSwitcher(self, switch_drain_timeout)
        self.mover = Mover(self)
        self.advisor = Advisor(self)  # `--mode auto` turns it on
        self.rebalancer = Rebalancer(self)  # `--rebalance-ratio` turns it on
        self.serving = asyncio.Event()  # cleared while the mode switches
        self.workers_changed = asyncio.Event()
        self.accepting = True
        self.ready = False
        self.placing = 0  # placements under way (a switch waits for them)
        self.fault: str | None = None  # set when the router itself cannot go on
        self.gc_seconds_seen: dict[int, float] = {}  # each worker's collection seconds, as it last said
        self.tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    # ---- requests ------------------------------------------------------------------
    def most_requests(self) -> int:
        """Requests the server holds at once with every worker up: one asking for more choices can
        never be taken, however long it waits."""
        return self.limits.max_running_per_worker * len(self.pool.workers) + self.limits.max_waiting

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        if not self.accepting:
            raise Unavailable("the server is shutting down", code="shutting_down")
        if self.fault:
            raise Unavailable(f"the server is broken: {self.fault}", code="server_fault")
        serving = [w for w in self.pool.workers if w.state != "dead"]
        if not serving:
            causes = "; ".join(filter(None, (w.exit_cause for w in self.pool.workers)))
            raise Unavailable("no worker is alive" + (f": {causes}" if causes else ""), code="no_worker")
        lim = self.limits
        if len(self.requests) >= lim.max_running_per_worker * len(serving) + lim.max_waiting:
            raise Overloaded("the server is overloaded; try again later", code="rate_limit_exceeded")
        stream = TextStream.of(self.tokenizer, params) if self.tokenizer else None
        state = RequestState(request_id, prompt_token_ids, params, stream)
        state.deadline = time.monotonic() + lim.request_timeout
        self.requests[request_id] = state
        self.advisor.on_arrival(state.arrival, len(prompt_token_ids), params.max_tokens, request_id)
        self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(prompt_token_ids))
        self.spawn(self.dispatcher.place(state))
        return state

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is not None and not state.finished:
            self._end(state, finish_reason="abort")
            self.release_holders(state)

    def fail(self, state: RequestState, message: str, reporter: int | None = None, status: int = 500,
             code: str | None = None) -> None:  # fmt: skip
        """End a request with an error and free what every other worker holds for it."""
        if state.finished:
            return
        self._end(state, error=message, error_status=status, error_code=code)
        self.release_holders(state, skip=reporter)

    def timeline(self, request_id: str) -> dict | None:
        state = self.requests.get(request_id)
        return state.timeline() if state else self.finished.get(request_id)

    def load(self, worker_id: int) -> int:
        """Requests placed on the worker (a prefill worker: only those it has not handed off yet)."""
        return sum(1 for s in self.requests.values() if s.placement and worker_id in (s.placement.reader, s.placement.worker))

    # ---- placements: who holds what ---------------------------------------------------------
    def assign(self, state: RequestState, placement: Placement) -> Placement:
        state.placement = placement
        self.by_key[placement.key] = state
        if self.mode.name == "disagg":
            state.prefill_worker = placement.worker
        else:
            state.prefill_worker = state.decode_worker = placement.worker
        return placement

    def unassign(self, state: RequestState) -> None:
        if state.placement is not None:
            self.mover.finish(state.placement.key, "ended", "the request ended during its move")
            self.by_key.pop(state.placement.key, None)
            state.placement = None

    def release_holders(self, state: RequestState, skip: int | None = None) -> None:
        """Tell every live worker holding this attempt to let go of it; forget the attempt."""
        p = state.placement
        if p is None:
            return
        workers = self.pool.workers
        writer_gone = not p.dispatched or not workers[p.worker].alive
        for w in p.holders - {skip}:
            if workers[w].alive:
                if w == p.reader:
                    self.pool.send(w, m.Abort(p.key, writer_done=writer_gone))
                else:
                    self.pool.send(w, m.Abort(p.key, reader=p.reader))
        self.unassign(state)

    def _give_back_seat(self, worker_id: int, key: str) -> None:
        self.pool.send(worker_id, m.Abort(key, writer_done=True))

    # ---- messages from workers ------------------------------------------------------------------
    def on_message(self, msg) -> None:
        if isinstance(msg, m.WorkerStats):
            self._on_stats(msg)
        elif isinstance(msg, m.Step):
            self.advisor.on_step(msg.worker_id, msg.start, msg.end, msg.prefill_tokens, msg.num_decodes,
                                 msg.prefill_attention, msg.decode_context)
            self.events.publish({"type": "step", "worker": msg.worker_id, "time": msg.start, "end": msg.end,
                                 "prefill_tokens": msg.prefill_tokens, "decodes": msg.num_decodes,
                                 "keys": msg.keys, "prefilling": msg.prefilling,
                                 "prefill_attention": msg.prefill_attention, "decode_context": msg.decode_context})  # fmt: skip
        elif isinstance(msg, m.StepStart):
            self.events.publish({"type": "step_start", "worker": msg.worker_id, "time": msg.start,
                                 "prefill_tokens": msg.prefill_tokens, "decodes": msg.num_decodes,
                                 "prefilling": msg.prefilling})  # fmt: skip
        elif isinstance(msg, m.SeatsReserved):
            self.seats.on_reply(msg)
        elif isinstance(msg, m.ModeSet):
            self.switcher.on_ack(msg)
        elif isinstance(msg, m.SeatOverdue):
            self._on_seat_overdue(msg)
        elif isinstance(msg, m.Leaving):
            self.spawn(self.mover.on_leaving(msg))
        elif isinstance(msg, (m.Tokens, m.Event, m.RequestError)):
            self._on_request_message(msg)
        else:
            log.warning("ignored an unexpected %s from a worker", type(msg).__name__)

    def _on_request_message(self, msg) -> None:
        if isinstance(msg, m.RequestError):
            self.seats.on_error(msg.worker_id, msg.key)
        elif isinstance(msg, m.Event):
            self.events.publish({"type": "request", "kind": msg.kind, "request_id": msg.key.rpartition(".")[0],
                                 "key": msg.key, "worker": msg.worker_id, "time": msg.time, **msg.data})  # fmt: skip
            self._count_handoff(msg)
        state = self.by_key.get(msg.key)
        if state is None or state.finished:
            return  # an attempt that was ended or redone: nothing it says matters now
        p = state.placement
        if isinstance(msg, m.Tokens):
            if p.reader is not None and msg.worker_id == p.worker and p.first_token_at is None:
                p.first_token_at = time.monotonic()  # the prefill's token: the handoff lease starts
            for tokens in self.relay.in_order(state, msg):
                reason, text, logprobs = self.relay.tokens(state, tokens)
                if reason is not None:
                    self._end(state, finish_reason=reason, text=text, logprobs=logprobs, token_ids=tokens.token_ids)
                    self.release_holders(state, skip=tokens.worker_id if tokens.finished else None)
                    break
        elif isinstance(msg, m.Event):
            if p.key not in self.mover.pending:  # a move's transfer is the move's, not the prefill's handoff
                self.relay.event(state, msg)
            if msg.kind == "transfer_end" and msg.worker_id == p.reader:
                if p.key not in self.mover.pending:
                    self.advisor.on_transfer(msg.data.get("bytes", 0), msg.data.get("seconds"))
                self._arrived(state, msg)
            elif msg.kind == "move_start" and msg.worker_id == p.worker:
                self.mover.started(p.key, msg.data)
            elif msg.kind == "move_refused" and msg.worker_id == p.worker and p.reader == msg.data.get("to"):
                p.reader, p.first_token_at = None, None  # it stays where it is; its seat goes back
                self.mover.finish(p.key, "refused", msg.data.get("reason"), msg.data.get("outgrown_at"))
        elif p.key in self.mover.pending:
            self.redo(state, f"its move failed on worker {msg.worker_id}: {msg.message}", local=True)
        else:
            log.info("request %s failed on worker %d: %s", state.request_id, msg.worker_id, msg.message)
            status = 503 if msg.code in (m.KV_HANDOFF_FAILED, m.KV_HANDOFF_TIMEOUT) else 500
            self.fail(state, msg.message, reporter=msg.worker_id, status=status, code=msg.code)

    def _arrived(self, state: RequestState, msg: m.Event) -> None:
        """The KV is in the reader (after a prefill or a move): the request now runs there alone."""
        p = state.placement
        p.worker, p.reader, p.first_token_at = msg.worker_id, None, None
        state.decode_worker = msg.worker_id
        self.mover.arrived(p.key, msg.data)
        if not self.mover.can_decode(self.pool.workers[msg.worker_id]) and not state.ends_at_its_next_token(
                msg.data.get("tokens", 0)):  # its reader's role changed meanwhile (the first token may still be on its way)
            self.spawn(self.mover.move(state, "switch"))

    def _count_handoff(self, msg: m.Event) -> None:
        outcome = None
        if msg.kind == "kv_sent" and msg.data.get("error"):
            outcome = "send_failed"
        elif msg.kind == "seat_released":
            outcome = "aborted" if msg.data.get("stage") == "released" else "seat_failed"
        if outcome is not None:
            self.metrics.handoffs.labels(self.metrics.model, self.kv_transport, outcome).inc()

    def _on_seat_overdue(self, msg: m.SeatOverdue) -> None:
        """A seat outlived its lease. Its reader waits for the writer's word before it gives the
        blocks back: make sure that word comes, even for an attempt the router has forgotten."""
        state = self.by_key.get(msg.key)
        if state is not None and not state.finished:
            self.fail(state, f"no KV arrived in its seat within {self.pool.spec_defaults['seat_timeout']:g} s",
                      status=503, code="kv_handoff_timeout")  # fmt: skip
        elif self.pool.workers[msg.writer].alive:
            self.pool.send(msg.writer, m.Abort(msg.key, reader=msg.worker_id))
        else:
            self.pool.send(msg.worker_id, m.Abort(msg.key, writer_done=True))

    def num_waiting(self) -> int:
        """Requests not yet running: waiting in a worker, for a seat, or to be placed (at a closed
        door during a switch, or for a worker of their role)."""
        stats = [x.stats for x in self.pool.workers if x.stats and x.alive]
        unplaced = sum(1 for s in self.requests.values() if s.placement is None and not s.finished)
        return sum(s.num_waiting for s in stats) + self.seats.num_waiting + unplaced

    def _on_stats(self, msg: m.WorkerStats) -> None:
        w = self.pool.workers[msg.worker_id]
        model = self.metrics.model
        usage = msg.blocks_used / max(1, msg.blocks_total)  # a malformed message stops here, before it is kept
        before = w.stats.num_preempted if w.stats else 0
        preempted = msg.num_preempted - before if msg.num_preempted >= before else msg.num_preempted  # (restarted)
        gc = (float(msg.gc["longest_full_seconds"]), float(msg.gc["seconds"])) if msg.gc is not None else None
        if preempted > 0:
            self.metrics.preemptions.labels(model).inc(preempted)
        w.stats = msg
        self.metrics.kv_usage.labels(model, str(msg.worker_id)).set(usage)
        if gc is not None:
            self.metrics.worker_gc_longest.labels(model, str(msg.worker_id)).set(gc[0])
            seen = self.gc_seconds_seen.get(msg.worker_id, 0.0)
            grown = gc[1] - seen if gc[1] >= seen else gc[1]  # a worker restarted counts from 0 again
            self.metrics.worker_gc_seconds.labels(model, str(msg.worker_id)).inc(max(0.0, grown))
            self.gc_seconds_seen[msg.worker_id] = gc[1]
        stats = [x.stats for x in self.pool.workers if x.stats and x.alive]
        self.metrics.running.labels(model).set(sum(s.num_running for s in stats))
        self.metrics.seats_waiting.labels(model).set(self.seats.num_waiting)
        if msg.integrity_error:
            log.error("worker %d reports broken KV accounting: %s", msg.worker_id, msg.integrity_error)
        self.seats.on_worker_change(msg.worker_id)

    def _end(self, state: RequestState, finish_reason: str | None = None, error: str | None = None,
             text: str = "", error_status: int = 500, error_code: str | None = None,
             logprobs: list | None = None, token_ids: list[int] | None = None) -> None:  # fmt: skip
        if state.finished:
            return
        state.finished = True
        state.finish_reason = finish_reason if error is None else "error"
        state.events["finish"] = time.time()
        self.requests.pop(state.request_id, None)
        model = self.metrics.model
        if error is None:
            self.metrics.e2e.labels(model).observe(state.events["finish"] - state.arrival)
        self.metrics.success.labels(model, state.finish_reason).inc()
        self.finished[state.request_id] = timeline = state.timeline()
        self.finished_token_times += len(timeline["token_times"])
        self.advisor.on_finished(timeline)
        while len(self.finished) > KEPT_TIMELINES or self.finished_token_times > KEPT_TOKEN_TIMES:
            self.finished_token_times -= len(self.finished.popitem(last=False)[1]["token_times"])
        state.deltas.put_nowait(Delta(text, len(token_ids or ()), state.finish_reason, error, error_status, error_code,
                                      logprobs, token_ids))

    # ---- worker deaths -------------------------------------------------------------------------
    def on_worker_lost(self, worker_id: int, cause: str) -> None:
        """A worker died (or was killed for not answering). What it held is redone elsewhere."""
        self.events.publish({"type": "worker", "worker": worker_id, "state": "lost", "cause": cause,
                             "time": time.time()})  # fmt: skip
        for w in self.pool.workers:
            if w.alive:
                self.pool.send(w.worker_id, m.Peers({}, gone=[worker_id]))
        self.seats.on_worker_lost(worker_id)
        self.switcher.on_worker_lost(worker_id)
        for state in [s for s in self.requests.values() if worker_id in s.holders]:
            self.redo(state, cause)
        self.workers_changed.set()

    def on_worker_back(self, worker_id: int) -> None:
        w = self.pool.workers[worker_id]
        for other in self.pool.workers:
            if other.alive and other is not w:
                self.pool.send(other.worker_id, m.Peers({worker_id: w.peer()}))
        w.state = "up"
        self.events.publish({"type": "worker", "worker": worker_id, "state": "up", "time": time.time()})
        self.workers_changed.set()
        self.seats.pump()

    def redo(self, state: RequestState, cause: str, local: bool = False) -> None:
        """Run the request again from its prompt and the tokens already sent (the client's stream
        goes on where it was; greedy output is unchanged). local: its KV failed to cross a link, so
        in disagg its decode worker reads it itself rather than wait on the link again."""
        if state.finished:
            return
        state.local_only = state.local_only or local
        if state.placement is not None:
            self.mover.finish(state.placement.key, "failed", cause)
        self.release_holders(state)
        state.early.clear()  # tokens of the old attempt that were waiting for their turn
        state.gap_since = None
        if len(state.redos) >= self.limits.max_redos:
            # a fault, not a limit: mostly a request whose every attempt lost its worker (it may be what kills them)
            self.fail(state, f"{cause}; the request was redone {len(state.redos)} times already", code="too_many_redos")
            return
        state.redos.append({"time": time.time(), "cause": cause, "tokens_done": len(state.output_token_ids)})
        self.metrics.redos.labels(self.metrics.model).inc()
        log.info("redoing %s after %d tokens: %s", state.request_id, len(state.output_token_ids), cause)
        self.spawn(self.dispatcher.place(state))

    # ---- deadlines -----------------------------------------------------------------------------
    def check_deadlines(self) -> None:
        now = time.monotonic()
        lease, gap = self.limits.kv_transfer_timeout, self.limits.token_gap_timeout
        for state in list(self.requests.values()):
            p = state.placement
            if now > state.deadline:
                self.fail(state, f"the request did not finish within {self.limits.request_timeout:g} s "
                                 "(--request-timeout)", status=503, code="request_timeout")  # fmt: skip
            elif p is not None and p.first_token_at and now - p.first_token_at > lease:
                if p.key in self.mover.pending:
                    self.redo(state, f"its move did not finish within {lease:g} s", local=True)
                else:
                    self.fail(state, f"the KV handoff did not finish within {lease:g} s (--kv-transfer-timeout)",
                              status=503, code="kv_handoff_timeout")  # fmt: skip
            elif state.gap_since is not None and now - state.gap_since > gap:
                self.redo(state, f"output tokens from index {len(state.output_token_ids)} were lost on their way "
                                 f"from a worker (later ones waited for them over {gap:g} s)")  # fmt: skip

    # ---- modes -----------------------------------------------------------------------------------
    async def set_mode(self, mode: Mode | Callable[[Mode], Mode], drain: bool = False) -> dict:
        """The switch is the server's: a caller that goes away (a client giving up) does not stop it
        halfway. Returns its outcome (what moved, how long it took). `mode`: ModeSwitcher.switch's."""
        return await asyncio.shield(self.spawn(self.switcher.switch(mode, drain)))

    def mode_report(self) -> dict:
        """Starting: the mode the server starts into. Switching: the mode served and the one coming.
        With the last switch's outcome."""
        extra = {"last_switch": self.switcher.last} if self.switcher.last is not None else {}
        if self.advisor.enabled:
            extra["auto"] = True
        if self.rebalancer.enabled:
            extra["rebalance"] = {"ratio": self.rebalancer.ratio, "interval_s": self.rebalancer.interval_s,
                                  "rounds": self.rebalancer.rounds}  # fmt: skip
        if not self.ready:
            return {**(self.target or self.mode).as_dict(), "starting": True}
        if self.target is not None:
            return {**self.mode.as_dict(), "switching_to": self.target.as_dict(), **extra}
        if self.switcher.moving:  # the new mode serves; the switch's moves are under way
            extra["moving"] = [s.request_id for s in self.switcher.moving if not s.finished]
        return {**self.mode.as_dict(), **extra}

    async def drain(self, timeout: float) -> None:
        """Stop admitting; let what runs finish for up to `timeout` seconds; end the rest."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for state in list(self.requests.values()):
            self.fail(state, "the server is shutting down", status=503, code="shutting_down")
