"""Python's garbage collector in minipd's long-lived processes.

A full (generation 2) collection walks every tracked object. A worker holds torch, the model and
the tokenizer's objects from its start, so one full collection stopped a tiny-model worker for
70-90 ms in the middle of a decode step, and the server process (the relay of every stream) for
0.4-0.5 s under 23 streams: all replies froze at once, a stall no mode causes. As vLLM does
after its start, each process freezes what it built before serving (`gc.freeze()`: those objects
move to a generation no collection visits); collections then walk only what serving made.
MINIPD_GC_FREEZE=0 leaves the collector as Python sets it (for scripts/bench_gc_freeze.py).

GcPauses measures the collections of the process it runs in (gc.callbacks), for the workers'
stats and /metrics.

A worker's tensors of every size come and go through glibc's malloc, which keeps what is freed
inside its arenas: under mixed load a worker's resident memory climbed by 200 MB and stayed there
with nothing running. `IdleTrim` gives the free pages back (malloc_trim) once a worker has sat
idle for a second after serving; MINIPD_MALLOC_TRIM=0 turns it off."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time


def freeze_enabled() -> bool:
    return os.environ.get("MINIPD_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")


_frozen = 0  # gc.get_freeze_count() walks the whole frozen list (15 ms for a worker's): counted once here
_freezing = False  # the collection before the freeze is not serving's: GcPauses leaves it out


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left; returns how many objects are frozen (0 when off)."""
    global _frozen, _freezing
    if not freeze_enabled():
        return 0
    _freezing = True
    try:
        gc.collect()
    finally:
        _freezing = False
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


class GcPauses:
    """Counts this process's collections and how long they stopped it (full ones apart)."""

    def __init__(self):
        self.collections = self.full_collections = 0
        self.seconds = self.longest_full_seconds = 0.0
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None or _freezing:
            return
        took, self._started = time.perf_counter() - self._started, None
        self.collections += 1
        self.seconds += took
        if info.get("generation") == 2:
            self.full_collections += 1
            self.longest_full_seconds = max(self.longest_full_seconds, took)

    def as_dict(self) -> dict:
        return {"frozen_objects": _frozen, "collections": self.collections,
                "full_collections": self.full_collections, "seconds": round(self.seconds, 6),
                "longest_full_seconds": round(self.longest_full_seconds, 6)}  # fmt: skip

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def _malloc_trim():
    if os.environ.get("MINIPD_MALLOC_TRIM", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


class IdleTrim:
    """Free heap pages go back to the system once the process has been idle for `after_s`, once per
    idle spell (a trim walks the arenas: a few ms, never between the steps of a busy worker)."""

    def __init__(self, after_s: float = 1.0):
        self.after_s = after_s
        self.trim = _malloc_trim()
        self.busy_at: float | None = None  # the last time it was busy, until the trim that follows
        self.trims = 0

    def tick(self, busy: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if busy:
            self.busy_at = now
        elif self.busy_at is not None and now - self.busy_at >= self.after_s:
            self.busy_at = None
            if self.trim is not None:
                self.trim(0)
                self.trims += 1
