"""The writer's side of a KV handoff (on the prefill worker).

shm / cuda-ipc: the KV is copied straight into the decode worker's cache, into the seat's blocks
(in the caller's thread), then an END message says so.
tcp: BEGIN, the KV one (K/V, layer) part per message, read out of the cache just before it goes
on the wire and paced by the link emulator, then END.
Messages to each decode worker leave in order from a thread of its own (a lane).

Every send has a deadline: a reader that died or stopped reading fails the handoff instead of
blocking the thread forever. The request's blocks must stay allocated until `finished()`
reports its key."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from minipd.engine.handoff import KVSlots
from minipd.transfer import wire
from minipd.transfer.link import LinkEmulator
from minipd.transfer.peer_cache import PeerCaches, copy_blocks

TRANSPORTS = ("shm", "cuda-ipc", "tcp")
IN_PLACE = ("shm", "cuda-ipc")
log = logging.getLogger("minipd.transfer")


class PeerGone(RuntimeError):
    pass


@dataclass(slots=True)
class Outgoing:
    key: str
    address: str
    end: dict
    begin: dict | None = None
    kv: KVSlots | None = None  # tcp: the parts to send between BEGIN and END
    report: bool = True  # a write (its blocks wait for finished()), not a cancel


class KVSender:
    def __init__(self, ctx: zmq.Context, transport: str, link: LinkEmulator | None = None,
                 timeout: float = 60.0, copy_hook=None):  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.ctx, self.transport, self.timeout = ctx, transport, timeout
        self.in_place = transport in IN_PLACE
        self.link = link or LinkEmulator()
        self.copy_hook = copy_hook  # tests: called between block runs of an in-place copy
        self.wire_hook = None  # tests: (address, frames) -> the frames that go, or None (lost); may raise zmq.Again
        self.peer_caches = PeerCaches()
        self.lanes: dict[str, _Lane] = {}  # one per decode worker: a slow one holds up no other
        self.done: queue.Queue[tuple[str, str | None]] = queue.Queue()  # (key, error)
        self.forgotten: set[str] = set()

    def write(self, key: str, kv: KVSlots, meta: dict, peer: wire.Peer, seat: list[int], extra: dict) -> float | None:
        """Start moving a request's KV into its seat on the peer. In place, the copy is done on
        return, and the time it was done is returned."""
        end = {"key": key, "outcome": wire.WRITTEN, "meta": meta, **extra}
        if not self.in_place:
            self._lane(peer).put(Outgoing(key, peer.kv_address, end, begin={"key": key, "meta": meta, **extra}, kv=kv))
            return None
        try:
            dst = self.peer_caches.get(peer.cache_name, peer.cache_shape, peer.cache_dtype, peer.cache_handle)
            copy_blocks(kv, dst, seat, self.copy_hook)
            if kv.cache.is_cuda:
                torch.cuda.current_stream(kv.cache.device).synchronize()  # the KV is there before we say so
        except Exception as err:
            log.exception("writing the KV of %s into its seat failed", key)
            end = {"key": key, "outcome": wire.FAILED, "error": str(err), **extra}
        copied = time.time()
        self._lane(peer).put(Outgoing(key, peer.kv_address, end))
        return copied

    def warm(self, peer: wire.Peer) -> None:
        """Map the peer's cache and connect to it now, so the first handoff costs what the others do."""
        if peer.kv_address in self.forgotten:
            return
        if self.in_place:
            self.peer_caches.get(peer.cache_name, peer.cache_shape, peer.cache_dtype, peer.cache_handle)
        self._lane(peer)

    def cancel(self, key: str, peer: wire.Peer, reason: str) -> None:
        """Tell the reader nothing will be written into this seat."""
        end = {"key": key, "outcome": wire.CANCELLED, "reason": reason}
        self._lane(peer).put(Outgoing(key, peer.kv_address, end, report=False))

    def forget_peer(self, peer: wire.Peer) -> None:
        """The reader is gone: whatever is queued for it fails at once."""
        self.forgotten.add(peer.kv_address)
        lane = self.lanes.pop(peer.kv_address, None)
        if lane is not None:
            lane.put(None)
        if peer.cache_name:
            self.peer_caches.drop(peer.cache_name)

    def finished(self) -> list[tuple[str, str | None]]:
        """(key, error or None) of writes that are over: their blocks may be freed now."""
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.put(None)
        for lane in self.lanes.values():
            lane.thread.join(timeout=5)
        self.lanes.clear()
        self.peer_caches.close()

    def _lane(self, peer: wire.Peer) -> _Lane:
        lane = self.lanes.get(peer.kv_address)
        if lane is None:
            lane = self.lanes[peer.kv_address] = _Lane(self, peer.kv_address)
        return lane


class _Lane:
    """The messages for one decode worker, sent in order by a thread of their own."""

    def __init__(self, sender: KVSender, address: str):
        self.sender, self.address = sender, address
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-sender {address}", daemon=True)
        self.thread.start()

    def put(self, item: Outgoing | None) -> None:
        self.queue.put(item)

    def _connect(self) -> zmq.Socket:
        sock = self.sender.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection, else time out
        sock.connect(self.address)
        return sock

    def _run(self) -> None:
        s = self.sender
        sock = self._connect()
        try:
            while (item := self.queue.get()) is not None:
                error = None
                try:
                    if sock is None:
                        sock = self._connect()
                    deadline = time.monotonic() + s.timeout
                    if item.begin is not None:
                        self._send(sock, wire.header(wire.BEGIN, item.begin), deadline)
                    if item.kv is not None:
                        self._send_parts(sock, item, deadline)
                    self._send(sock, wire.header(wire.END, item.end), deadline)
                    if item.end["outcome"] == wire.FAILED:
                        error = f"KV handoff failed: {item.end.get('error')}"
                except Exception as err:
                    if not isinstance(err, (PeerGone, TimeoutError)):
                        log.exception("sending the KV of %s failed", item.key)
                    error = f"KV handoff failed: {err}"
                    if sock is not None:
                        sock.close(linger=0)  # a half-sent handoff goes with its socket
                        sock = None
                if item.report:
                    s.done.put((item.key, error))
        finally:
            while not self.queue.empty():  # forgotten: fail what is still queued
                item = self.queue.get_nowait()
                if item is not None and item.report:
                    s.done.put((item.key, "KV handoff failed: the decode worker is gone"))
            if sock is not None:
                sock.close(linger=0)

    def _send(self, sock: zmq.Socket, frames: list, deadline: float) -> None:
        s = self.sender
        while True:
            if self.address in s.forgotten:
                raise PeerGone("the decode worker is gone")
            try:
                sent = frames if s.wire_hook is None else s.wire_hook(self.address, frames)
                if sent is not None:
                    sock.send_multipart(sent, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the decode worker did not take the KV within {s.timeout:g} s") from None
                sock.poll(50, zmq.POLLOUT)

    def _send_parts(self, sock: zmq.Socket, item: Outgoing, deadline: float) -> None:
        link = self.sender.link
        slots = item.kv.slots()
        begin, sent = time.perf_counter(), 0
        for index in range(item.kv.num_parts):
            data = item.kv.read_part(index, slots).cpu().view(torch.uint8).numpy()  # (tokens, kv_heads, head_dim)
            sent += data.nbytes
            if link.active:
                link.wait(begin, sent)
            self._send(sock, wire.part(item.key, index, data), deadline)
