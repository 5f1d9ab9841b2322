"""One worker process: an engine on one device, driven by messages from the main process.
Its role (both / prefill / decode) and policy are settings, so the mode changes without reloading."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass

import msgpack
import torch
import zmq

from minipd.engine.handoff import KVHandoff
from minipd.transfer import shm
from minipd.transfer.channel import Peer
from minipd.workers import messages as m

log = logging.getLogger("minipd.worker")


@dataclass(slots=True)
class WorkerSpec:
    worker_id: int
    engine: dict  # EngineConfig fields
    control_address: str  # this worker binds it
    main_address: str  # the main process binds it
    kv_transport: str = "shm"
    kv_link_gbps: float | None = None
    kv_link_latency_ms: float = 0.0
    tag: str = "0"  # names this server's shared-memory segments


def run_worker(spec: WorkerSpec) -> None:
    try:
        Worker(spec).loop()
    except KeyboardInterrupt:
        pass


class Worker:
    def __init__(self, spec: WorkerSpec):
        from minipd.config import EngineConfig
        from minipd.engine.engine import Engine
        from minipd.transfer.channel import KVReceiver, KVSender
        from minipd.transfer.link import LinkEmulator

        self.spec = spec
        self.id = spec.worker_id
        self.parent = os.getppid()
        self.cache_segment = None
        storage = None
        if spec.kv_transport == "shm":  # peers write handed-off KV straight into this cache

            def storage(num_bytes):
                self.cache_segment = shm.create(shm.segment_name(spec.tag, f"cache{self.id}"), num_bytes)
                return shm.tensor_view(self.cache_segment, [num_bytes], torch.uint8)

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
        self.sender = KVSender(self.ctx, spec.kv_transport, link)
        self.receiver = KVReceiver()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.kv_in, zmq.POLLIN)
        self.peers: dict[int, Peer] = {}
        self.decode_target: dict[str, tuple[int, list[int]]] = {}  # request -> (decode worker, seat blocks)
        self.prefill_started: set[str] = set()
        self.aborted: deque[str] = deque(maxlen=4096)
        self.running = True
        e = self.engine
        cache = e.runner.kv_cache
        handle = None
        if spec.kv_transport == "cuda-ipc":
            from minipd.transfer.cuda_ipc import export_handle

            handle = export_handle(cache)
        cache_name = self.cache_segment.name if self.cache_segment else f"worker{self.id}"
        self.send(m.Ready(self.id, os.getpid(), spec.engine.get("device", "cpu"), self.kv_address,
                          e.blocks.num_blocks, e.blocks.block_size,
                          e.model.config.kv_bytes_per_token(cache.element_size()), cache_name, list(cache.shape),
                          str(cache.dtype).removeprefix("torch."), handle))  # fmt: skip

    def send(self, msg) -> None:
        self.out.send(m.encode(msg))

    def loop(self) -> None:
        try:
            while self.running:
                if os.getppid() != self.parent:
                    break  # the main process is gone: do not outlive it
                busy = self.engine.has_unfinished()
                sending = bool(self.engine.scheduler.handoffs)
                events = dict(self.poller.poll(0 if busy else 5 if sending else 100))
                if self.control in events:
                    self._drain(self.control, lambda frames: self.handle(m.decode(frames[0])))
                if self.kv_in in events:
                    self._drain(self.kv_in, self.receive_kv)
                sent = self.sender.finished()
                for rid, error in sent:
                    self.engine.release_handoff(rid)
                    if error:
                        self.send(m.RequestError(rid, self.id, error))
                if sent:
                    self.send_stats()
                if self.engine.has_unfinished():
                    self.step()
        finally:
            self.sender.close()
            self.ctx.destroy(linger=0)
            if self.cache_segment is not None:
                shm.unlink(self.cache_segment)

    @staticmethod
    def _drain(sock, handler) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler([f.bytes if len(frames) == 1 else f for f in frames])

    # ---- control --------------------------------------------------------------------
    def handle(self, msg) -> None:
        from minipd.sampling_params import SamplingParams

        e = self.engine
        if isinstance(msg, m.AddRequest):
            try:
                e.add_request(msg.request_id, msg.prompt_token_ids, SamplingParams.from_dict(msg.params))
            except ValueError as err:
                self.send(m.RequestError(msg.request_id, self.id, str(err)))
                return
            if msg.decode_worker is not None:
                self.decode_target[msg.request_id] = (msg.decode_worker, msg.decode_blocks)
        elif isinstance(msg, m.ReserveSeat):
            seat = e.reserve_seat(msg.request_id, msg.num_tokens)
            self.send(m.SeatReply(msg.request_id, self.id, seat))
            self.send_stats()
        elif isinstance(msg, m.Abort):
            e.abort_request(msg.request_id)
            e.blocks.release(msg.request_id)
            self.aborted.append(msg.request_id)
            self.decode_target.pop(msg.request_id, None)
            self.send_stats()
        elif isinstance(msg, m.SetMode):
            e.set_role(msg.role)
            e.set_policy(msg.policy, msg.chunk_tokens)
            self.peers = {int(k): Peer(**v) for k, v in msg.peers.items()}
            self.send(m.ModeSet(self.id, msg.role, msg.policy))
        elif isinstance(msg, m.Shutdown):
            self.running = False

    # ---- one engine step --------------------------------------------------------------
    def step(self) -> None:
        e = self.engine
        outputs = e.step()
        stats = e.last_step
        started = time.time() - stats.duration
        for rid in stats.prefilling:
            if rid not in self.prefill_started:
                self.prefill_started.add(rid)
                self.send(m.Event(rid, self.id, "prefill_start", started))
        now = time.time()
        for out in outputs:
            if out.request_id in self.prefill_started:
                self.prefill_started.discard(out.request_id)
                self.send(m.Event(out.request_id, self.id, "prefill_end", now))
            self.send(m.Tokens(out.request_id, self.id, out.new_token_ids, now, out.finished, out.finish_reason))
            if out.handoff:
                self.hand_off(out.request_id)
            elif out.finished:
                self.decode_target.pop(out.request_id, None)
        if not e.has_unfinished() and not e.scheduler.handoffs:
            e.blocks.check_integrity()  # just went idle: every block must be free or reserved
        self.send_stats()

    def hand_off(self, request_id: str) -> None:
        target, seat = self.decode_target.pop(request_id)
        started = time.time()
        try:
            num_bytes = self.sender.send(self.engine, request_id, self.peers[target], seat, {"from": self.id})
            self.send(m.Event(request_id, self.id, "transfer_start", started, {"bytes": num_bytes}))
        except Exception as err:  # end this request, keep serving
            log.exception("handoff of %s failed", request_id)
            self.send(m.RequestError(request_id, self.id, f"KV handoff failed: {err}"))
            self.engine.release_handoff(request_id)

    def receive_kv(self, frames) -> None:
        e = self.engine

        def wanted(rid: str) -> bool:  # False if the request ended while its KV was on the way
            return rid not in self.aborted and e.blocks.has_reservation(rid)

        try:
            done = self.receiver.on_message(frames, e, wanted)
            if done is None:
                return
            header, meta = done
            e.import_handoff(KVHandoff(meta, None), kv_written=True)
        except Exception:
            log.error("KV import failed:\n%s", traceback.format_exc())
            rid = msgpack.unpackb(bytes(frames[1]))["meta"]["request_id"] if bytes(frames[0]) == b"H" \
                else bytes(frames[1]).decode()  # fmt: skip
            self.send(m.RequestError(rid, self.id, "KV import failed on the decode worker"))
            e.blocks.release(rid)
            return
        now = time.time()
        self.send(m.Event(meta.request_id, self.id, "transfer_end", now,
                          {"bytes": meta.num_bytes, "seconds": now - header["start"]}))  # fmt: skip
        self.send_stats()

    def send_stats(self) -> None:
        e = self.engine
        self.send(m.WorkerStats(self.id, e.scheduler.config.role, e.num_running(), e.num_waiting(),
                                e.blocks.num_used, e.blocks.num_reserved, e.blocks.num_blocks))  # fmt: skip
