"""Named POSIX shared-memory segments (torch-free): with the shm transport each worker's KV cache
lives in one, so that a prefill worker can write a prompt's KV straight into a decode worker's
cache. The worker that creates a segment unlinks it; the server removes what a dead one left."""

from __future__ import annotations

import glob
import os
from multiprocessing import resource_tracker, shared_memory

PREFIX = "minipd_"


def segment_name(tag: str, name: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in name)
    return f"{PREFIX}{tag}_{safe}"[:250]


def create(name: str, num_bytes: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(num_bytes, 1))
    # we unlink it ourselves (or the server does if we die): the tracker must not do it again
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def open_segment(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def unlink(segment: shared_memory.SharedMemory) -> None:
    """Remove a segment's name (SharedMemory.unlink would also tell the resource tracker, which
    no longer tracks it)."""
    try:
        os.unlink(f"/dev/shm/{segment.name}")
    except FileNotFoundError:
        pass


def unlink_all(tag: str) -> list[str]:
    """Remove every segment a server's workers left behind. Returns their names."""
    left = glob.glob(f"/dev/shm/{PREFIX}{tag}_*")
    for path in left:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return [os.path.basename(p) for p in left]
