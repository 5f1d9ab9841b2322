"""Moves a request's KV from a prefill worker to a decode worker, never through the main process.

shm: the KV is written into a shared-memory segment; only a small header crosses ZeroMQ.
tcp: the KV bytes cross a ZeroMQ tcp:// socket, paced by an optional link emulator.
The sending side runs on a thread of its own, so a slow link does not stall prefill."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import warnings

import msgpack
import torch
import zmq

from minipd.engine.handoff import HandoffMeta, KVHandoff
from minipd.transfer import shm
from minipd.transfer.link import LinkEmulator

TRANSPORTS = ("shm", "tcp")
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(slots=True)
class Outgoing:
    address: str
    header: dict
    payload: torch.Tensor | None  # tcp only


class KVSender:
    def __init__(self, ctx: zmq.Context, transport: str, tag: str, link: LinkEmulator | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.ctx, self.transport, self.tag = ctx, transport, tag
        self.link = link or LinkEmulator()
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self.thread.start()

    def send(self, engine, request_id: str, address: str, extra: dict) -> int:
        """Copy the request's KV out of the engine's cache (after which its blocks may be freed)
        and queue it for the decode worker. Returns the number of KV bytes."""
        start = time.time()
        seq = engine.scheduler.handoffs[request_id]
        n = seq.num_computed_tokens
        shape = list(engine.runner.kv_cache.shape)
        shape[2] = n
        dtype = engine.runner.kv_cache.dtype
        header = {"start": start, **extra}
        if self.transport == "shm":
            name = shm.segment_name(self.tag, request_id)
            size = _numel(shape) * dtype.itemsize
            segment = shm.create(name, size)
            try:
                handoff = engine.export_handoff(request_id, out=shm.tensor_view(segment, shape, dtype))
            finally:
                segment.close()
            header["shm_name"] = name
            payload = None
        else:
            handoff = engine.export_handoff(request_id)
            payload = handoff.kv
        header["meta"] = dataclasses.asdict(handoff.meta)
        self.queue.put(Outgoing(address, header, payload))
        return handoff.meta.num_bytes

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        try:
            while (item := self.queue.get()) is not None:
                sock = sockets.get(item.address)
                if sock is None:
                    sock = sockets[item.address] = self.ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(item.address)
                head = msgpack.packb(item.header)
                if item.payload is None:
                    sock.send(head)
                    continue
                data = memoryview(item.payload.contiguous().view(torch.uint8).numpy()).cast("B")
                chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [data]
                begin, sent = time.perf_counter(), 0
                sock.send(head, zmq.SNDMORE)
                for i, chunk in enumerate(chunks):
                    sent += len(chunk)
                    if self.link.active:
                        self.link.wait(begin, sent)
                    sock.send(chunk, zmq.SNDMORE if i < len(chunks) - 1 else 0, copy=False)
        finally:
            for s in sockets.values():
                s.close(linger=0)


def receive(frames: list[bytes | zmq.Frame]) -> tuple[dict, KVHandoff, callable]:
    """Turn a KV message into a handoff. Call the returned cleanup once the KV is imported."""
    header = msgpack.unpackb(bytes(frames[0]))
    meta = HandoffMeta(**header["meta"])
    dtype = getattr(torch, meta.kv_dtype)
    if "shm_name" in header:
        segment = shm.open_segment(header["shm_name"])
        kv = shm.tensor_view(segment, meta.kv_shape, dtype)

        def cleanup():
            segment.close()
            segment.unlink()

        return header, KVHandoff(meta, kv), cleanup
    kv = torch.empty(meta.num_bytes, dtype=torch.uint8)
    offset = 0
    for frame in frames[1:]:
        chunk = _as_tensor(frame)
        kv[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
    return header, KVHandoff(meta, kv.view(dtype).view(meta.kv_shape)), lambda: None


def _as_tensor(frame) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: we only read it
        return torch.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=torch.uint8)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
