"""The reader's side of a KV handoff (on the decode worker): the seats in this worker's cache, the
KV arriving into them, and when their blocks may be given back (see transfer/handoffs.py)."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import torch

from minipd.engine.handoff import HandoffMeta
from minipd.transfer import wire
from minipd.transfer.handoffs import Handoff, Handoffs, Stage

log = logging.getLogger("minipd.transfer")


@dataclass(slots=True)
class Arrival:
    """What became of a seat after a KV message: the request now runs here, or the seat is gone."""

    key: str
    imported: bool
    meta: HandoffMeta | None = None
    seconds: float | None = None  # from the writer's start to the import
    error: str | None = None  # set when the seat failed while its request was still wanted
    cancelled: bool = False  # the writer called it off (and tells the main process itself)
    timed_out: bool = False  # the writer's lease ran out before all of it came


@dataclass(slots=True)
class _Incoming:  # tcp: a handoff whose parts are still landing
    meta: HandoffMeta
    start: float
    missing: set[int]  # parts not landed yet
    slots: torch.Tensor | None = None
    error: str | None = None  # a part that came wrong: the KV in the seat cannot be trusted


class SeatTable:
    def __init__(self, engine, worker_id: int, in_place: bool, on_release=None):
        self.engine = engine
        self.on_release = on_release  # (key, stage): a seat's blocks went back
        self.worker_id = worker_id
        self.in_place = in_place
        self.handoffs = Handoffs()
        self._incoming: dict[str, _Incoming] = {}
        self._asked: dict[str, float] = {}  # key -> when its writer was last asked for its word

    def __len__(self) -> int:
        return len(self.handoffs)

    def reserve(self, key: str, num_tokens: int, headroom_tokens: int, writer: int) -> list[int] | None:
        """The seat's block ids, or None: no room now. A key whose old seat is still here (a move
        asked again before its source's cancel, which comes on the KV channel, has landed) is
        "not now" too: the router asks again when this worker's room grows."""
        if self.handoffs.get(key) is not None:
            log.info("worker %d: the seat of %s is still here; asked again later", self.worker_id, key)
            return None
        blocks = self.engine.add_seat(key, num_tokens, headroom_tokens)
        if blocks is not None:
            self.handoffs.open(Handoff(key, writer, self.worker_id, blocks, Stage.SEAT_RESERVED, self.in_place))
        return blocks

    def on_message(self, frames: list) -> Arrival | None:
        kind, body = wire.parse(frames)
        if kind == wire.PART:
            self._on_part(*body)
            return None
        h = self.handoffs.get(body["key"])
        if h is None:
            return None  # the seat is gone already (its request ended): nothing to keep
        if kind == wire.BEGIN:
            meta = HandoffMeta(**body["meta"])
            if h.stage is Stage.SEAT_RESERVED and not h.aborted:
                h.to(Stage.WRITING)
                self._incoming[h.key] = _Incoming(meta, body["start"], set(range(meta.kv_shape[0] * meta.kv_shape[1])))
            return None
        return self._on_end(h, body)

    def _on_part(self, key: str, index: int, frame) -> None:
        h, inc = self.handoffs.get(key), self._incoming.get(key)
        if h is None or inc is None or h.aborted:
            return
        _, _, tokens, heads, dim = inc.meta.kv_shape
        data, dtype = _as_tensor(frame), getattr(torch, inc.meta.kv_dtype)
        expected = tokens * heads * dim * dtype.itemsize
        if index not in inc.missing:
            inc.error = inc.error or f"KV part {index} came twice, or is no part of this KV"
            return
        if data.numel() != expected:
            inc.error = inc.error or f"KV part {index} came with {data.numel()} of its {expected} bytes"
            return
        kv = self.engine.seat_kv(key, tokens)
        if inc.slots is None:
            inc.slots = kv.slots()
        kv.write_part(index, data.view(dtype).view(tokens, heads, dim), inc.slots)
        inc.missing.discard(index)

    def _on_end(self, h: Handoff, body: dict) -> Arrival | None:
        h.writer_done = True
        incoming = self._incoming.pop(h.key, None)
        if h.aborted:
            self._release(h, Stage.RELEASED)
            return None
        outcome = body["outcome"]
        if outcome == wire.WRITTEN and not self.in_place and (problem := _what_went_wrong(incoming)):
            outcome, body = wire.FAILED, {**body, "error": problem}
        if outcome != wire.WRITTEN:
            self._release(h, Stage.FAILED)
            reason = body.get("error") or body.get("reason") or outcome
            return Arrival(h.key, False, error=f"the KV handoff {outcome.replace('_', ' ')}: {reason}",
                           cancelled=outcome == wire.CANCELLED, timed_out=outcome == wire.TIMED_OUT)  # fmt: skip
        meta = HandoffMeta(**body["meta"])
        try:
            h.to(Stage.WRITTEN)
            self.engine.import_handoff(meta)
        except Exception as err:
            log.exception("importing the KV of %s failed", h.key)
            self._release(h, Stage.FAILED)
            return Arrival(h.key, False, error=f"KV import failed on the decode worker: {err}")
        self.handoffs.end(h.key, Stage.IMPORTED)
        self._asked.pop(h.key, None)
        return Arrival(h.key, True, meta, time.time() - body["start"])

    def abort(self, key: str, writer_done: bool = False) -> None:
        """The request ended. Its seat goes back now, or once its writer is done with it."""
        h = self.handoffs.get(key)
        if h is None:
            return
        h.writer_done |= writer_done
        self._incoming.pop(key, None)
        if h.may_release_seat:
            self._release(h, Stage.RELEASED)
        else:
            h.aborted = True

    def writer_gone(self, worker_id: int) -> list[str]:
        """A prefill worker died: nobody writes into its seats any more. Returns their keys."""
        keys = []
        for h in self.handoffs.with_peer(worker_id):
            if h.writer == worker_id:
                h.writer_done = True
                self._incoming.pop(h.key, None)
                self._release(h, Stage.FAILED)
                keys.append(h.key)
        return keys

    def overdue(self, lease: float) -> list[Handoff]:
        """Seats that waited `lease` seconds for their KV, or, once aborted, for their writer's last
        word (asked again every lease: a lost END must not keep the blocks forever)."""
        now = time.monotonic()
        out = []
        for h in self.handoffs:
            if now - self._asked.get(h.key, h.opened) > lease:
                self._asked[h.key] = now
                out.append(h)
        return out

    def _release(self, h: Handoff, stage: Stage) -> None:
        self._asked.pop(h.key, None)
        self.engine.release_seat(h.key)
        self.handoffs.end(h.key, stage)
        if self.on_release is not None:
            self.on_release(h.key, stage)


def _what_went_wrong(incoming: _Incoming | None) -> str | None:
    """tcp: why a handoff said `written` but its KV is not all in the seat, or None."""
    if incoming is None:
        return "its BEGIN did not arrive"
    if incoming.error:
        return incoming.error
    if incoming.missing:
        return f"{len(incoming.missing)} KV parts did not arrive"
    return None


def _as_tensor(frame) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: we only read it
        return torch.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=torch.uint8)
