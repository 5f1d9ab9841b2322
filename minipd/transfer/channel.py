"""Moves a request's KV from a prefill worker to a decode worker, never through the main process.

shm: the prefill worker writes the KV straight into the decode worker's cache (a shared-memory
     segment), into the blocks of the seat reserved for the request; a small header follows.
cuda-ipc: the same, into a GPU cache opened through a CUDA IPC handle.
tcp: the KV crosses a ZeroMQ tcp:// socket layer by layer, paced by an optional link emulator;
     a sender thread reads each layer out of the cache just before it goes on the wire, and the
     decode worker copies each layer into its seat as it lands, so reading, sending and writing
     overlap. (Each layer is its own ZeroMQ message: a multipart message only leaves whole.)
The prefill side keeps the request's blocks until `finished()` reports it sent."""

from __future__ import annotations

import dataclasses
import logging
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

TRANSPORTS = ("shm", "cuda-ipc", "tcp")
IN_PLACE = ("shm", "cuda-ipc")  # the prefill worker writes into the decode worker's cache
log = logging.getLogger("minipd.transfer")


@dataclasses.dataclass(slots=True)
class Peer:
    """How to reach a decode worker: its KV socket, and on shm its cache segment."""

    kv_address: str
    cache_name: str | None = None
    cache_shape: list[int] | None = None
    cache_dtype: str | None = None
    cache_handle: bytes | None = None  # CUDA IPC


@dataclasses.dataclass(slots=True)
class Outgoing:
    request_id: str
    address: str
    header: dict
    cache: torch.Tensor | None = None  # tcp: read these slots of this cache, layer by layer
    slots: torch.Tensor | None = None


class KVSender:
    def __init__(self, ctx: zmq.Context, transport: str, link: LinkEmulator | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.ctx, self.transport = ctx, transport
        self.link = link or LinkEmulator()
        self.peer_caches = PeerCaches()
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.done: queue.Queue[tuple[str, str | None]] = queue.Queue()  # (request id, error)
        self.thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self.thread.start()

    def send(self, engine, request_id: str, peer: Peer, seat_blocks: list[int], extra: dict) -> int:
        """Start moving the request's KV towards the decode worker's seat. Returns its size in bytes.
        The request's blocks must stay allocated until `finished()` yields its id."""
        start = time.time()
        seq = engine.scheduler.handoffs[request_id]
        cache = engine.runner.kv_cache
        meta = KVHandoff.from_sequence(seq, cache).meta
        header = {"start": start, "meta": dataclasses.asdict(meta), **extra}
        if self.transport in IN_PLACE:
            dst = self.peer_caches.get(peer.cache_name, peer.cache_shape, peer.cache_dtype, peer.cache_handle)
            copy_blocks(cache, seq.block_table, dst, seat_blocks, seq.num_computed_tokens, engine.blocks.block_size)
            if cache.is_cuda:
                torch.cuda.current_stream(cache.device).synchronize()  # the KV is there before we say so
            header["written"] = True
            self.queue.put(Outgoing(request_id, peer.kv_address, header))
        else:
            header["written"] = False
            slots = engine.runner.slots_of(seq.block_table, seq.num_computed_tokens)
            self.queue.put(Outgoing(request_id, peer.kv_address, header, cache, slots))
        return meta.num_bytes

    def finished(self) -> list[tuple[str, str | None]]:
        """(request id, error or None) for requests whose KV has left this worker's cache, or
        failed to: their blocks may be freed now."""
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)
        self.peer_caches.close()

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        try:
            while (item := self.queue.get()) is not None:
                error = None
                try:
                    sock = sockets.get(item.address)
                    if sock is None:
                        sock = sockets[item.address] = self.ctx.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(item.address)
                    sock.send_multipart([HEADER, msgpack.packb(item.header)])
                    if item.cache is not None:
                        self._send_layers(sock, item)
                except Exception as err:
                    log.exception("sending the KV of %s failed", item.request_id)
                    error = f"KV handoff failed: {err}"
                finally:
                    self.done.put((item.request_id, error))
        finally:
            for s in sockets.values():
                s.close(linger=0)

    def _send_layers(self, sock, item: Outgoing) -> None:
        kinds, layers = item.cache.shape[:2]
        rid = item.request_id.encode()
        begin, sent = time.perf_counter(), 0
        for part, cache in enumerate(item.cache.flatten(0, 1)):
            data = cache.index_select(0, item.slots).cpu().view(torch.uint8).numpy()  # (tokens, kv_heads, head_dim)
            sent += data.nbytes
            if self.link.active:
                self.link.wait(begin, sent)
            sock.send_multipart([PART, rid, part.to_bytes(4, "little"), data], copy=False)


HEADER, PART = b"H", b"P"


class KVReceiver:
    """Decode side: collects handoffs, writing each tcp layer into the request's seat as it lands."""

    def __init__(self):
        self.pending: dict[str, list] = {}  # request id -> [header, meta, parts still to come]

    def on_message(self, frames: list, engine, wanted) -> tuple[dict, HandoffMeta] | None:
        """Handle one KV message; returns (header, meta) once a handoff is complete and wanted(rid)."""
        if bytes(frames[0]) == HEADER:
            header = msgpack.unpackb(bytes(frames[1]))
            meta = HandoffMeta(**header["meta"])
            if header["written"]:
                return (header, meta) if wanted(meta.request_id) else None
            self.pending[meta.request_id] = [header, meta, 2 * meta.kv_shape[1]]
            return None
        rid = bytes(frames[1]).decode()
        entry = self.pending.get(rid)
        if entry is None:
            return None
        header, meta, _ = entry
        if wanted(rid):
            _, _, tokens, heads, dim = meta.kv_shape
            part = _as_tensor(frames[3]).view(getattr(torch, meta.kv_dtype)).view(tokens, heads, dim)
            engine.write_seat(rid, int.from_bytes(bytes(frames[2]), "little"), part)
        entry[2] -= 1
        if entry[2] > 0:
            return None
        del self.pending[rid]
        return (header, meta) if wanted(rid) else None


def _as_tensor(frame) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: we only read it
        return torch.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=torch.uint8)
