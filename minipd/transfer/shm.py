"""KV handoff through POSIX shared memory (CPU, same host): the prefill worker writes the prompt's
KV straight from its cache into a named segment; the decode worker maps it, copies it into its own
cache and unlinks it."""

from __future__ import annotations

import glob
import os
from multiprocessing import resource_tracker, shared_memory

import torch

PREFIX = "minipd_"


def segment_name(tag: str, request_id: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in request_id)
    return f"{PREFIX}{tag}_{safe}"[:250]


def create(name: str, num_bytes: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(num_bytes, 1))
    # the reader unlinks it; the creator's tracker must not unlink it again at exit
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def tensor_view(shm: shared_memory.SharedMemory, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    count = 1
    for d in shape:
        count *= d
    return torch.frombuffer(shm.buf, dtype=dtype, count=count).view(shape)


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
    """Remove every segment a server left behind (a worker died mid-handoff). Returns their names."""
    left = glob.glob(f"/dev/shm/{PREFIX}{tag}_*")
    for path in left:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return [os.path.basename(p) for p in left]
