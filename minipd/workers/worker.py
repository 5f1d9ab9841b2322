"""One worker process: an engine on one device, driven by messages from the main process.
Its role (both / prefill / decode) and policy are settings, so the mode changes without reloading.

Nothing one request does may end the process: every message and every step is guarded, and an
error that belongs to a request ends that request (RequestError) and frees what it held."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch
import zmq

from minipd.config import EngineConfig
from minipd.engine.block_manager import blocks_for
from minipd.engine.engine import Engine, StepFailed
from minipd.heap import GcPauses, IdleTrim
from minipd.sampling_params import SamplingParams
from minipd.transfer import shm, wire
from minipd.transfer.handoffs import Handoff, Handoffs, Stage
from minipd.transfer.link import LinkEmulator
from minipd.transfer.peer_cache import tensor_view
from minipd.transfer.receiver import SeatTable
from minipd.transfer.sender import IN_PLACE, KVSender
from minipd.workers import faults
from minipd.workers import messages as m
from minipd.workers.launch import WorkerSpec

log = logging.getLogger("minipd.worker")
HEARTBEAT_S = 0.5
LEASE_CHECK_S = 0.5


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.id = spec.worker_id
        self.parent = os.getppid()
        self.cache_segment = None
        storage = None
        self.shm_owner = shm.join_owner(spec.tag) if spec.kv_transport == "shm" else None
        if spec.kv_transport == "shm":  # peers write handed-off KV straight into this cache

            def storage(num_bytes):
                name = shm.cache_segment_name(spec.tag, self.id, spec.incarnation)
                self.cache_segment = shm.create(name, num_bytes)
                return tensor_view(self.cache_segment, [num_bytes], torch.uint8)

        self.engine = Engine(EngineConfig(**spec.engine), kv_storage=storage)
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PULL)
        self.control.bind(spec.control_address)
        self.kv_in = self.ctx.socket(zmq.PULL)
        port = self.kv_in.bind_to_random_port("tcp://127.0.0.1")
        self.kv_address = f"tcp://127.0.0.1:{port}"
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(spec.main_address)
        link = LinkEmulator(spec.kv_link_gbps, spec.kv_link_latency_ms) if spec.kv_transport == "tcp" else None
        lease = spec.kv_transfer_timeout  # a failed write's last word is owed for as long as its seat waits
        self.sender = KVSender(self.ctx, spec.kv_transport, link, lease, word_timeout=spec.seat_timeout)
        self.seats = SeatTable(self.engine, self.id, spec.kv_transport in IN_PLACE, on_release=self._seat_released)
        self.outgoing = Handoffs()  # this worker as the writer
        self.peers: dict[int, wire.Peer] = {}
        self.prefill_started: set[str] = set()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.kv_in, zmq.POLLIN)
        self.running = True
        self.leaving = False  # SIGTERM came: tell the main process (once, from the loop)
        self.said_leaving = False
        self.stuck = False  # the last step could run nothing (no free blocks yet): do not spin
        self.last_stats = self.last_lease_check = 0.0
        self.gc = GcPauses()
        self.idle_trim = IdleTrim()
        self.engine.on_prefill_step = lambda start, tokens, decodes, keys: self.send(
            m.StepStart(self.id, start, tokens, decodes, keys))
        faults.install(self)
        cache = self.engine.runner.kv_cache
        handle = None
        if spec.kv_transport == "cuda-ipc":
            from minipd.transfer.cuda_ipc import export_handle

            handle = export_handle(cache)
        cache_name = self.cache_segment.name if self.cache_segment else f"worker{self.id}-{spec.incarnation}"
        e = self.engine
        self.loop_beat = time.monotonic()  # the loop last came round
        self.step_started: float | None = None
        self.stop_heartbeat = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="minipd-heartbeat", daemon=True)
        self.send(m.Ready(self.id, spec.incarnation, os.getpid(), spec.engine.get("device", "cpu"), self.kv_address,
                          e.blocks.num_blocks, e.blocks.block_size,
                          e.model.config.kv_bytes_per_token(cache.element_size()), cache_name, list(cache.shape),
                          str(cache.dtype).removeprefix("torch."), handle))  # fmt: skip

    def send(self, msg) -> None:
        self.out.send(m.encode(msg))

    def leave(self) -> None:
        """SIGTERM's handler: only a flag (the loop sends the message; a handler must not use the socket)."""
        self.leaving = True

    def _beat(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)  # a socket belongs to one thread
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.main_address)
        try:
            while not self.stop_heartbeat.is_set():
                now, started = time.monotonic(), self.step_started
                step_s, stalled_s = (now - started, 0.0) if started is not None else (0.0, now - self.loop_beat)
                try:  # never blocks: a main process that stopped reading must not hold this thread
                    sock.send(m.encode(m.Heartbeat(self.id, self.spec.incarnation, step_s, stalled_s)), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self.stop_heartbeat.wait(HEARTBEAT_S)
        finally:
            sock.close(linger=0)

    # ---- the loop -------------------------------------------------------------------------
    def loop(self) -> None:
        self.heartbeat.start()
        try:
            while self.running and os.getppid() == self.parent:  # the main process gone: do not outlive it
                self.turn()
        finally:
            self.close()

    def turn(self, poll_ms: int | None = None) -> None:
        """Once round the loop: messages in, handoffs out, leases, one step, stats."""
        self.loop_beat = time.monotonic()
        if poll_ms is None:
            busy = self.engine.has_unfinished() and not self.stuck
            waiting_on_io = bool(len(self.outgoing) or len(self.seats) or self.stuck)
            poll_ms = 0 if busy else 5 if waiting_on_io else 100
        events = dict(self.poller.poll(poll_ms))
        if self.control in events:
            self._drain(self.control, self._on_control)
        if self.kv_in in events:
            self._drain(self.kv_in, self._on_kv)
        self._guarded(self._collect_sent)
        now = time.monotonic()
        if now - self.last_lease_check > LEASE_CHECK_S:
            self.last_lease_check = now
            self._guarded(self._check_leases)
        if self.engine.has_unfinished():
            self._guarded(self._step)
        self.idle_trim.tick(bool(self.engine.has_unfinished() or len(self.outgoing) or len(self.seats)))
        if time.monotonic() - self.last_stats > HEARTBEAT_S:
            self._guarded(self.send_stats)
        if self.leaving and not self.said_leaving:
            self.said_leaving = True
            log.warning("worker %d: SIGTERM: asking the main process to move its requests away and stop it", self.id)
            self.send(m.Leaving(self.id, self.spec.incarnation))

    def close(self) -> None:
        """Sockets closed, the shared-memory cache (if any) unlinked."""
        self.stop_heartbeat.set()
        if self.heartbeat.is_alive():
            self.heartbeat.join(2 * HEARTBEAT_S)
        if self.cache_segment is not None:  # first: whatever happens to the sockets, no segment is left
            shm.unlink(self.cache_segment)
        shm.leave_owner(self.shm_owner, self.spec.tag)
        self.shm_owner = None
        self.sender.close()
        self.ctx.destroy(linger=0)
        self.gc.close()

    @staticmethod
    def _drain(sock, handler) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("worker %d: %s failed", self.id, fn.__name__)

    # ---- control messages -------------------------------------------------------------------
    def _on_control(self, frames) -> None:
        try:
            msg = m.decode(frames[0].bytes)
        except m.BadMessage as err:
            log.warning("worker %d: ignored a message it cannot read: %s", self.id, err)
            return
        try:
            self.handle(msg)
        except Exception as err:
            key = getattr(msg, "key", None)
            log.exception("worker %d: handling %s failed%s", self.id, type(msg).__name__, f" for {key}" if key else "")
            if key is not None:
                self._fail_request(key, f"worker {self.id} could not handle the request: {err}",
                                   reader=getattr(msg, "reader", None))  # fmt: skip

    def handle(self, msg) -> None:
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.ReserveSeats):
            self._reserve(msg)
        elif isinstance(msg, m.Move):
            self._move(msg)
        elif isinstance(msg, m.Abort):
            self._abort(msg.key, msg.writer_done, msg.reader)
            self.send_stats()
        elif isinstance(msg, m.SetMode):
            self._set_peers(msg.peers)
            if msg.link is not None and self.spec.kv_transport == "tcp":
                self.sender.link = LinkEmulator(*msg.link)
            self.engine.set_policy(msg.policy, msg.chunk_tokens)
            self.engine.set_role(msg.role)  # requests here keep their own way (a handoff in flight goes on)
            self.send(m.ModeSet(self.id, msg.role, msg.policy))
            self.send_stats()
            if msg.role == "prefill":
                for wid, peer in self.peers.items():
                    if wid != self.id:
                        self.sender.warm(peer)
        elif isinstance(msg, m.Peers):
            for w in msg.gone:
                self._peer_gone(w)
            self._set_peers(msg.peers)
            self.send_stats()
        elif isinstance(msg, m.Shutdown):
            self.running = False
        else:
            log.warning("worker %d: ignored an unexpected %s", self.id, type(msg).__name__)

    def _add(self, msg: m.AddRequest) -> None:
        reader = None
        if msg.reader is not None:
            reader = self.peers.get(msg.reader)
            if reader is None:
                raise ValueError(f"no decode worker {msg.reader} is known here")
        try:
            params = SamplingParams.from_dict(msg.params)
            self.engine.add_request(msg.key, msg.prompt_token_ids, params, msg.output_token_ids, reader is not None)
        except Exception as err:
            if reader is not None:
                self.sender.cancel(msg.key, reader, f"the prefill worker refused the request: {err}")
            self.send(m.RequestError(msg.key, self.id, str(err)))
            return
        if reader is not None:
            self.outgoing.open(Handoff(msg.key, self.id, msg.reader, msg.seat, Stage.PREFILLING, self.sender.in_place))

    def _move(self, msg: m.Move) -> None:
        """Start handing a running request to another worker (see transfer/handoffs.py). A request
        that is not here, is leaving already, or has outgrown the seat stays where it is: the reader
        hears so (its seat goes back) and the main process gets `move_refused`."""
        peer = self.peers.get(msg.reader)
        seq = self.engine.scheduler.find(msg.key)
        problem, outgrown_at = None, None
        if peer is None:
            problem = f"worker {msg.reader} is not known here"
        elif seq is None or seq.is_finished or self.outgoing.get(msg.key) is not None:
            problem = "the request is not running here"
        elif blocks_for(seq.num_tokens + 1, self.engine.blocks.block_size) > len(msg.seat):
            problem = f"the request ({seq.num_tokens} tokens) outgrew its seat of {len(msg.seat)} blocks"
            outgrown_at = seq.num_tokens
        if problem is not None:
            if peer is not None:
                self.sender.cancel(msg.key, peer, f"the move was refused: {problem}")
            self.send(m.Event(msg.key, self.id, "move_refused", time.time(),
                              {"to": msg.reader, "reason": problem, "outgrown_at": outgrown_at}))  # fmt: skip
            return
        now = self.engine.start_move(msg.key)
        stage = Stage.DECODING if now else Stage.PREFILLING
        self.outgoing.open(Handoff(msg.key, self.id, msg.reader, msg.seat, stage, self.sender.in_place))
        self.send(m.Event(msg.key, self.id, "move_start", time.time(),
                          {"to": msg.reader, "tokens": seq.num_tokens, "now": now}))  # fmt: skip
        if now:
            self._write(msg.key)

    def _reserve(self, msg: m.ReserveSeats) -> None:
        results = []
        for key, num_tokens, headroom, writer in msg.seats:
            try:
                blocks = self.seats.reserve(key, num_tokens, headroom, writer)
            except ValueError as err:
                self.send(m.RequestError(key, self.id, str(err)))
                blocks = None
            results.append([key, blocks])
            if blocks is not None:
                self.send(m.Event(key, self.id, "seat_reserved", time.time(), {"blocks": len(blocks)}))
        self.send(m.SeatsReserved(msg.batch, self.id, results))
        self.send_stats()

    def _abort(self, key: str, writer_done: bool = False, reader: int | None = None) -> None:
        self.engine.abort_request(key)  # a request whose KV is on its way out keeps its blocks until sent
        self.prefill_started.discard(key)
        h = self.outgoing.get(key)
        if h is not None:
            if h.stage in (Stage.PREFILLING, Stage.DECODING):
                self._cancel_outgoing(h, "the request was aborted")
            else:
                h.aborted = True
                self.sender.abort(key, "the request was aborted")  # what of its KV has not gone stays here
        elif reader is not None and reader in self.peers:
            # not (or no longer) ours: say so, in case the reader still waits (a second word is ignored)
            self.sender.cancel(key, self.peers[reader], "the prefill worker does not hold the request")
        self.seats.abort(key, writer_done)

    def _fail_request(self, key: str, message: str, reader: int | None = None) -> None:
        self._abort(key, reader=reader)  # a reader still waiting for this request's KV hears it will not come
        self.send(m.RequestError(key, self.id, message))

    def _cancel_outgoing(self, h: Handoff, reason: str) -> None:
        peer = self.peers.get(h.reader)
        if peer is not None:
            self.sender.cancel(h.key, peer, reason)
        self.outgoing.end(h.key, Stage.RELEASED)

    def _set_peers(self, peers: dict) -> None:
        for k, v in peers.items():
            new = wire.Peer(**v)
            old = self.peers.get(int(k))
            if old is not None and old.cache_name and old.cache_name != new.cache_name:
                self.sender.peer_caches.drop(old.cache_name)
            self.sender.forgotten.discard(new.kv_address)  # a new worker may get an old one's port
            self.peers[int(k)] = new

    def _peer_gone(self, worker_id: int) -> None:
        """A worker died. Handoffs towards it fail (their blocks come back); seats it was writing
        into are given back."""
        for h in self.outgoing.with_peer(worker_id):
            if h.stage is Stage.PREFILLING:
                self.engine.abort_request(h.key)
                self.outgoing.end(h.key, Stage.FAILED)
        peer = self.peers.pop(worker_id, None)
        if peer is not None:
            self.sender.forget_peer(peer)  # writes under way report failure; their blocks come back
        self.seats.writer_gone(worker_id)

    # ---- KV arriving (decode side) -------------------------------------------------------------
    def _on_kv(self, frames) -> None:
        try:
            arrival = self.seats.on_message(frames)
        except Exception:
            log.exception("worker %d: a KV message could not be handled", self.id)
            return
        if arrival is None:
            return
        if arrival.imported:
            meta = arrival.meta
            self.send(m.Event(arrival.key, self.id, "transfer_end", time.time(),
                              {"bytes": meta.num_bytes, "seconds": arrival.seconds, "tokens": len(meta.token_ids)}))  # fmt: skip
        elif arrival.error and not arrival.cancelled:  # a writer that cancels says why itself
            code = m.KV_HANDOFF_TIMEOUT if arrival.timed_out else m.KV_HANDOFF_FAILED
            self.send(m.RequestError(arrival.key, self.id, arrival.error, code))
        self.send_stats()

    def _seat_released(self, key: str, stage: Stage) -> None:
        self.send(m.Event(key, self.id, "seat_released", time.time(), {"stage": stage.value}))

    def _check_leases(self) -> None:
        for h in self.seats.overdue(self.spec.seat_timeout):
            self.send(m.SeatOverdue(h.key, self.id, h.writer))  # the router makes sure the writer answers
            self.seats.abort(h.key)

    # ---- KV leaving (prefill side) ---------------------------------------------------------------
    def _write(self, key: str) -> None:
        h = self.outgoing.get(key)
        peer = self.peers.get(h.reader) if h is not None else None
        if peer is None:
            self.engine.release_handoff(key)
            if h is not None:
                self.outgoing.end(key, Stage.FAILED)
            self.send(m.RequestError(key, self.id, "the prefill finished but there is no decode seat for it",
                                     m.KV_HANDOFF_FAILED))  # fmt: skip
            return
        try:
            meta, kv = self.engine.handoff_meta(key), self.engine.handoff_kv(key)
            if blocks_for(meta.num_computed_tokens + 1, self.engine.blocks.block_size) > len(h.seat):
                raise ValueError(f"its KV ({meta.num_computed_tokens} tokens) outgrew its seat of {len(h.seat)} blocks")
        except Exception as err:  # nothing was written: the reader hears so now, not at the end of its lease
            log.exception("worker %d: the KV write of %s could not start", self.id, key)
            self.engine.release_handoff(key)
            self.outgoing.end(key, Stage.FAILED)
            self.sender.cancel(key, peer, f"the prefill worker could not start writing the KV: {err}")
            self.send(m.RequestError(key, self.id, f"the KV handoff could not start on worker {self.id}: {err}"))
            return
        h.to(Stage.WRITING)
        started = time.time()
        self.send(m.Event(key, self.id, "transfer_start", started, {"bytes": meta.num_bytes, "to": h.reader}))
        extra = {"start": started, "writer": self.id}
        copied = self.sender.write(key, kv, dataclasses.asdict(meta), peer, h.seat, extra)
        if copied is not None:
            self.send(m.Event(key, self.id, "kv_copied", copied, {"to": h.reader}))

    def _collect_sent(self) -> None:
        sent = self.sender.finished()
        for key, outcome, error in sent:
            self.engine.release_handoff(key)
            h = self.outgoing.get(key)
            if h is not None:
                if outcome == wire.WRITTEN:
                    h.to(Stage.WRITTEN)
                self.outgoing.end(key, Stage.FAILED if error else Stage.RELEASED)
            self.send(m.Event(key, self.id, "kv_sent", time.time(), {"outcome": outcome, "error": error}))
            if error and h is not None and not h.aborted:
                code = m.KV_HANDOFF_TIMEOUT if outcome == wire.TIMED_OUT else m.KV_HANDOFF_FAILED
                self.send(m.RequestError(key, self.id, error, code))
        if sent:
            self.send_stats()

    # ---- one engine step -------------------------------------------------------------------------
    def _step(self) -> None:
        e = self.engine
        self.step_started = time.monotonic()
        try:
            outputs = e.step()
        except StepFailed as err:
            log.error("worker %d: a step failed; ending its requests %s: %r", self.id, err.request_ids, err.cause)
            for key in err.request_ids:
                self._fail_request(key, f"the engine step failed on worker {self.id}: {err.cause}")
            self.send_stats()
            return
        except Exception as err:  # outside the model: the scheduler's own state is suspect; start over
            keys = [s.request_id for s in (*e.scheduler.running, *e.scheduler.waiting)]
            log.exception("worker %d: step failed outside the model; ending %s", self.id, keys)
            for key in keys:
                self._fail_request(key, f"worker {self.id} failed: {err}")
            self.send_stats()
            return
        finally:
            self.step_started = None
            self.loop_beat = time.monotonic()
        stats = e.last_step
        self.stuck = stats.scheduled == 0
        if self.stuck:
            return  # nothing ran; blocks come back when a handoff or a seat ends
        end = stats.start + stats.duration
        self.send(m.Step(self.id, stats.start, end, stats.prefill_tokens, stats.num_decodes,
                         [o.request_id for o in outputs], stats.prefilling, stats.prefill_attention,
                         stats.decode_context))  # fmt: skip
        for key in stats.prefilling:
            if key not in self.prefill_started:
                self.prefill_started.add(key)
                self.send(m.Event(key, self.id, "prefill_start", stats.start))
        for out in outputs:
            if out.request_id in self.prefill_started:
                self.prefill_started.discard(out.request_id)
                self.send(m.Event(out.request_id, self.id, "prefill_end", end))
            self.send(m.Tokens(out.request_id, self.id, out.new_token_ids, end, out.finished, out.finish_reason,
                               out.index, out.logprobs, out.prompt_logprobs, out.stop_reason))  # fmt: skip
            if out.handoff:
                self._write(out.request_id)
            elif out.finished and (h := self.outgoing.get(out.request_id)) is not None:
                self._cancel_outgoing(h, f"the request finished during prefill ({out.finish_reason})")
        self.send_stats()

    def send_stats(self) -> None:
        e = self.engine
        idle = e.is_drained() and not len(self.outgoing) and not len(self.seats)
        integrity = None
        if idle:
            try:
                e.blocks.check_integrity()
                assert e.blocks.num_used == 0, f"{e.blocks.num_used} blocks in use with no request here"
                assert e.blocks.num_booked == 0, f"{e.blocks.num_booked} blocks booked with no request here"
            except AssertionError as err:
                integrity = str(err) or "check_integrity failed"
                log.error("worker %d: KV block integrity: %s", self.id, integrity)
        handoffs = {f"out:{k}": v for k, v in self.outgoing.count_by_stage().items()}
        handoffs.update({f"in:{k}": v for k, v in self.seats.handoffs.count_by_stage().items()})
        self.send(m.WorkerStats(self.id, e.scheduler.config.role, e.num_running(), e.num_waiting(),
                                e.blocks.num_used, e.blocks.num_seated, e.blocks.num_booked, e.blocks.num_blocks,
                                e.scheduler.num_preempted, handoffs, integrity, self.gc.as_dict()))  # fmt: skip
        self.last_stats = time.monotonic()
