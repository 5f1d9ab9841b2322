"""Moves a request's KV from a prefill worker to a decode worker, never through the main process.

shm: the prefill worker writes the KV straight into the decode worker's cache (a shared-memory
     segment), into the blocks of the seat reserved for the request; a small header follows.
tcp: the KV bytes cross a ZeroMQ tcp:// socket, paced by an optional link emulator, and the
     decode worker copies them into its seat.
Sending runs on a thread of its own, so a slow link does not stall prefill."""

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
from minipd.transfer.link import LinkEmulator
from minipd.transfer.peer_cache import PeerCaches, copy_blocks

TRANSPORTS = ("shm", "tcp")
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(slots=True)
class Peer:
    """How to reach a decode worker: its KV socket, and on shm its cache segment."""

    kv_address: str
    cache_name: str | None = None
    cache_shape: list[int] | None = None
    cache_dtype: str | None = None


@dataclasses.dataclass(slots=True)
class Outgoing:
    address: str
    header: dict
    payload: torch.Tensor | None  # tcp only


class KVSender:
    def __init__(self, ctx: zmq.Context, transport: str, link: LinkEmulator | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.ctx, self.transport = ctx, transport
        self.link = link or LinkEmulator()
        self.peer_caches = PeerCaches()
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self.thread.start()

    def send(self, engine, request_id: str, peer: Peer, seat_blocks: list[int], extra: dict) -> int:
        """Move the request's KV out of this engine's cache (after which its blocks may be freed)
        towards the decode worker's seat. Returns the number of KV bytes."""
        start = time.time()
        seq = engine.scheduler.handoffs[request_id]
        cache = engine.runner.kv_cache
        if self.transport == "shm":
            dst = self.peer_caches.get(peer.cache_name, peer.cache_shape, peer.cache_dtype)
            copy_blocks(cache, seq.block_table, dst, seat_blocks, seq.num_computed_tokens, engine.blocks.block_size)
            handoff = KVHandoff.from_sequence(seq, cache)
            payload, written = None, True
        else:
            handoff = engine.export_handoff(request_id)
            payload, written = handoff.kv, False
        header = {"start": start, "written": written, "meta": dataclasses.asdict(handoff.meta), **extra}
        self.queue.put(Outgoing(peer.kv_address, header, payload))
        return handoff.meta.num_bytes

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)
        self.peer_caches.close()

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


def receive(frames: list) -> tuple[dict, KVHandoff]:
    """Turn a KV message into a handoff (kv None when it was already written into the seat)."""
    header = msgpack.unpackb(bytes(frames[0]))
    meta = HandoffMeta(**header["meta"])
    if header["written"]:
        return header, KVHandoff(meta, None)
    kv = torch.empty(meta.num_bytes, dtype=torch.uint8)
    offset = 0
    for frame in frames[1:]:
        chunk = _as_tensor(frame)
        kv[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
    return header, KVHandoff(meta, kv.view(getattr(torch, meta.kv_dtype)).view(meta.kv_shape))


def _as_tensor(frame) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: we only read it
        return torch.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=torch.uint8)
