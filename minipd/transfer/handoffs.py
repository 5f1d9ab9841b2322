"""The KV handoff as one small state machine, kept by both workers (torch-free).

A decode worker (the reader) opens a handoff when it reserves a seat; the prefill worker (the
writer) opens its own when the request arrives with a seat to fill. Each side moves its record
through the stages below and no other way:

    reader:  seat_reserved -> [writing] -> written -> imported -> released
    writer:  prefilling -> writing -> written -> released
             decoding -> writing -> written -> released      (a move: the source is a decode)
    either:  any unfinished stage -> released (aborted) or failed

A move is the same handoff with a running reply as its source: the writer freezes the request at a
token boundary and writes the KV of its prompt and of the tokens made so far; the reader goes on
sampling from the next token (the sampler's noise depends only on seed and token index).

Ownership rule: for transports that write into the reader's cache (shm, cuda-ipc), the reader
gives the seat's blocks back only once the writer has said it is done with them (its last
message, `written` or `cancelled`) or the writer is known dead. An abort in between only marks
the record `aborted`. Every writer record ends with exactly one such last message to its reader.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class Stage(str, enum.Enum):
    SEAT_RESERVED = "seat_reserved"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    WRITING = "writing"
    WRITTEN = "written"
    IMPORTED = "imported"
    RELEASED = "released"
    FAILED = "failed"


S = Stage
NEXT: dict[Stage, set[Stage]] = {
    S.SEAT_RESERVED: {S.WRITING, S.WRITTEN, S.RELEASED, S.FAILED},
    S.PREFILLING: {S.WRITING, S.RELEASED, S.FAILED},
    S.DECODING: {S.WRITING, S.RELEASED, S.FAILED},
    S.WRITING: {S.WRITTEN, S.RELEASED, S.FAILED},
    S.WRITTEN: {S.IMPORTED, S.RELEASED, S.FAILED},
    S.IMPORTED: {S.RELEASED},
    S.RELEASED: set(),
    S.FAILED: set(),
}
ENDED = (S.RELEASED, S.FAILED)


class IllegalTransition(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Handoff:
    key: str  # the request attempt, as the workers know it
    writer: int  # prefill worker id
    reader: int  # decode worker id
    seat: list[int]  # block ids in the reader's cache
    stage: Stage
    in_place: bool = True  # the writer writes into the reader's cache itself
    aborted: bool = False  # the request ended; the record waits for the writer before it lets go
    writer_done: bool = False  # reader side: the writer's last message came (or the writer died)
    opened: float = field(default_factory=time.monotonic)
    history: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.stage.value, time.monotonic()))

    def to(self, stage: Stage) -> None:
        if stage not in NEXT[self.stage]:
            raise IllegalTransition(f"handoff {self.key}: {self.stage.value} -> {stage.value}")
        self.stage = stage
        self.history.append((stage.value, time.monotonic()))

    @property
    def ended(self) -> bool:
        return self.stage in ENDED

    @property
    def may_release_seat(self) -> bool:
        """Reader side: nobody can still be writing into the seat."""
        return self.writer_done or not self.in_place

    @property
    def age(self) -> float:
        return time.monotonic() - self.opened


class Handoffs:
    """One side's open handoffs, by key. Ended records leave the table."""

    def __init__(self) -> None:
        self._open: dict[str, Handoff] = {}

    def open(self, handoff: Handoff) -> Handoff:
        if handoff.key in self._open:
            raise ValueError(f"a handoff for {handoff.key!r} is already open")
        self._open[handoff.key] = handoff
        return handoff

    def get(self, key: str) -> Handoff | None:
        return self._open.get(key)

    def end(self, key: str, stage: Stage = S.RELEASED) -> Handoff | None:
        h = self._open.pop(key, None)
        if h is not None:
            h.to(stage)
        return h

    def with_peer(self, worker_id: int) -> list[Handoff]:
        return [h for h in self._open.values() if worker_id in (h.writer, h.reader)]

    def __iter__(self):
        return iter(list(self._open.values()))

    def __len__(self) -> int:
        return len(self._open)

    def count_by_stage(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self._open.values():
            name = h.stage.value + (" (aborted)" if h.aborted else "")
            out[name] = out.get(name, 0) + 1
        return out
