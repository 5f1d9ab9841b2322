"""The writer's side of a KV handoff (on the prefill worker).

shm / cuda-ipc: the KV is copied straight into the decode worker's cache, into the seat's blocks
(in the caller's thread), then an END message says so.
tcp: BEGIN, the KV one (K/V, layer) part per message, read out of the cache just before it goes
on the wire and paced by the link emulator, then END.
Messages to each decode worker leave in order from a thread of its own (a lane).

A write has a lease (`timeout`, from the moment it is asked for): a reader that died or stopped
reading, or a link too slow for the KV, fails the handoff by then instead of holding the thread
and the blocks. A write that fails on the way still owes its reader a last word: a FAILED END,
tried on a new connection between the other messages for as long as the seat waits for it
(`word_timeout`). A write that is aborted stops sending its KV at once (the link is free for the
next one) and its END says `cancelled`. The request's blocks must stay allocated until
`finished()` reports its key."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

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


@dataclass(slots=True, eq=False)
class Outgoing:
    key: str
    address: str
    end: dict
    deadline: float  # time.monotonic() by which the reader must have taken it all
    begin: dict | None = None
    kv: KVSlots | None = None  # tcp: the parts to send between BEGIN and END
    report: bool = True  # a write (its blocks wait for finished()), not a cancel
    stop: threading.Event = field(default_factory=threading.Event)  # set: its KV is not wanted any more
    stop_reason: str = ""


class KVSender:
    def __init__(self, ctx: zmq.Context, transport: str, link: LinkEmulator | None = None,
                 timeout: float = 60.0, copy_hook=None, word_timeout: float | None = None):  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.ctx, self.transport, self.timeout = ctx, transport, timeout
        self.word_timeout = word_timeout or timeout  # how long a failed write's last word is owed (the seat's lease)
        self.in_place = transport in IN_PLACE
        self.link = link or LinkEmulator()
        self.copy_hook = copy_hook  # tests: called between block runs of an in-place copy
        self.wire_hook = None  # tests: (address, frames) -> the frames that go, or None (lost); may raise zmq.Again
        self.peer_caches = PeerCaches()
        self.lanes: dict[str, _Lane] = {}  # one per decode worker: a slow one holds up no other
        self.writing: dict[str, Outgoing] = {}  # writes not reported yet, by key
        self.done: queue.Queue[tuple[str, str, str | None]] = queue.Queue()  # (key, outcome, error)
        self.forgotten: set[str] = set()

    def write(self, key: str, kv: KVSlots, meta: dict, peer: wire.Peer, seat: list[int], extra: dict) -> float | None:
        """Start moving a request's KV into its seat on the peer. In place, the copy is done on
        return, and the time it was done is returned."""
        end = {"key": key, "outcome": wire.WRITTEN, "meta": meta, **extra}
        if not self.in_place:
            self._queue(Outgoing(key, peer.kv_address, end, self._deadline(), {"key": key, "meta": meta, **extra}, kv))
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
        self._queue(Outgoing(key, peer.kv_address, end, self._deadline()))
        return copied

    def abort(self, key: str, reason: str) -> None:
        """The request ended: what of its KV is still queued or on the link does not go (the link
        is free at once), and its reader hears that nothing more comes. In place, the copy is over
        already: its END goes as it is."""
        item = self.writing.get(key)
        if item is not None:
            item.stop_reason = reason
            item.stop.set()

    def warm(self, peer: wire.Peer) -> None:
        """Map the peer's cache and connect to it now, so the first handoff costs what the others do."""
        if peer.kv_address in self.forgotten:
            return
        if self.in_place:
            self.peer_caches.get(peer.cache_name, peer.cache_shape, peer.cache_dtype, peer.cache_handle)
        self._lane(peer.kv_address)

    def cancel(self, key: str, peer: wire.Peer, reason: str) -> None:
        """Tell the reader nothing will be written into this seat."""
        end = {"key": key, "outcome": wire.CANCELLED, "reason": reason}
        self._queue(Outgoing(key, peer.kv_address, end, self._deadline(), report=False))

    def forget_peer(self, peer: wire.Peer) -> None:
        """The reader is gone: whatever is queued for it fails at once."""
        self.forgotten.add(peer.kv_address)
        for item in list(self.writing.values()):
            if item.address == peer.kv_address:
                item.stop.set()
        lane = self.lanes.pop(peer.kv_address, None)
        if lane is not None:
            lane.put(None)
        if peer.cache_name:
            self.peer_caches.drop(peer.cache_name)

    def finished(self) -> list[tuple[str, str, str | None]]:
        """(key, outcome, error or None) of writes that are over: their blocks may be freed now.
        The outcome is `written`, `cancelled` (aborted before all its KV went), `failed` or
        `timed_out` (failed: its lease ran out first)."""
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for item in list(self.writing.values()):  # the lanes stop sending at once: none outlives its socket
            item.stop_reason = item.stop_reason or "the worker is stopping"
            item.stop.set()
        for lane in self.lanes.values():
            lane.put(None)
        for lane in self.lanes.values():
            lane.thread.join(timeout=5)
        self.lanes.clear()
        self.peer_caches.close()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _queue(self, item: Outgoing) -> None:
        if item.report:
            self.writing[item.key] = item
        self._lane(item.address).put(item)

    def _report(self, item: Outgoing, outcome: str, error: str | None) -> None:
        """Once per write: the first report counts (a write stopped halfway is reported before its END goes)."""
        if item.report and self.writing.get(item.key) is item:
            del self.writing[item.key]
            self.done.put((item.key, outcome, error))

    def _lane(self, address: str) -> _Lane:
        lane = self.lanes.get(address)
        if lane is None:
            lane = self.lanes[address] = _Lane(self, address)
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
        try:
            sock.connect(self.address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _run(self) -> None:
        s = self.sender
        owed: list[tuple[list, float]] = []  # (END, deadline): failed writes' last words, tried between the others
        try:
            sock = self._connect()  # now: the first handoff finds the connection made
        except zmq.ZMQError:
            log.exception("connecting to the decode worker at %s failed", self.address)
            sock = None  # tried again, and failed on the way, with each message
        try:
            while True:
                try:
                    item = self.queue.get(timeout=0.05) if owed else self.queue.get()
                except queue.Empty:
                    item = False
                if item is None:
                    return
                try:
                    if sock is None:
                        sock = self._connect()
                    owed = self._try_owed(sock, owed)
                    if item:
                        self._deliver(sock, item)
                except Exception as err:
                    if not isinstance(err, (PeerGone, TimeoutError)):
                        log.exception("sending the KV of %s failed", item.key if item else "a failed write")
                    if sock is not None:
                        sock.close(linger=0)  # a half-sent handoff goes with its socket
                        sock = None
                    outcome = wire.TIMED_OUT if isinstance(err, TimeoutError) else wire.FAILED
                    if item:
                        s._report(item, outcome, f"KV handoff {outcome.replace('_', ' ')}: {err}")
                    if item and item.report and not isinstance(err, PeerGone):  # its reader still waits for its END
                        end = {"key": item.key, "outcome": outcome, "error": str(err)}
                        owed.append((wire.header(wire.END, end), time.monotonic() + s.word_timeout))
        finally:
            while not self.queue.empty():  # forgotten: fail what is still queued
                item = self.queue.get_nowait()
                if item is not None:
                    s._report(item, wire.FAILED, "KV handoff failed: the decode worker is gone")
            if sock is not None:
                sock.close(linger=0)

    def _try_owed(self, sock: zmq.Socket, owed: list[tuple[list, float]]) -> list[tuple[list, float]]:
        """Try each last word once; keep those that could not go and are still owed."""
        left = []
        for frames, deadline in owed:
            if time.monotonic() < deadline and not self._send(sock, frames, 0.0, once=True):
                left.append((frames, deadline))
        return left

    def _deliver(self, sock: zmq.Socket, item: Outgoing) -> None:
        s, end = self.sender, item.end
        if item.kv is not None:
            if self._send(sock, wire.header(wire.BEGIN, item.begin), item.deadline, item.stop):
                self._send_parts(sock, item)
            if item.stop.is_set():  # not all of its KV went, and none will: its blocks are not read any more
                if self.address in s.forgotten:
                    raise PeerGone("the decode worker is gone")
                s._report(item, wire.CANCELLED, None)
                end = {"key": item.key, "outcome": wire.CANCELLED, "reason": item.stop_reason}
        self._send(sock, wire.header(wire.END, end), item.deadline)
        failed = end["outcome"] == wire.FAILED
        s._report(item, end["outcome"], f"KV handoff failed: {end.get('error')}" if failed else None)

    def _send(self, sock: zmq.Socket, frames: list, deadline: float, stop: threading.Event | None = None,
              once: bool = False) -> bool:  # fmt: skip
        """True once sent; False if `stop` was set first, or it could not go at once and `once`."""
        s = self.sender
        while True:
            if self.address in s.forgotten:
                raise PeerGone("the decode worker is gone")
            if stop is not None and stop.is_set():
                return False
            try:
                sent = frames if s.wire_hook is None else s.wire_hook(self.address, frames)
                if sent is not None:
                    sock.send_multipart(sent, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if once:
                    return False
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the decode worker did not take the KV within {s.timeout:g} s") from None
                sock.poll(50, zmq.POLLOUT)

    def _send_parts(self, sock: zmq.Socket, item: Outgoing) -> None:
        """Every part, paced by the link, until the transfer is stopped."""
        link, timeout = self.sender.link, self.sender.timeout
        slots = item.kv.slots()
        begin, sent = time.monotonic(), 0
        for index in range(item.kv.num_parts):
            if item.stop.is_set():
                return
            data = item.kv.read_part(index, slots).cpu().view(torch.uint8).numpy()  # (tokens, kv_heads, head_dim)
            sent += data.nbytes
            if link.active:
                if begin + link.due(sent) > item.deadline:  # the link cannot carry it within the lease
                    if item.stop.wait(max(0.0, item.deadline - time.monotonic())):
                        return
                    raise TimeoutError(f"the KV did not finish within {timeout:g} s on the emulated link")
                if not link.wait(begin, sent, item.stop):
                    return
            if not self._send(sock, wire.part(item.key, index, data), item.deadline, item.stop):
                return
