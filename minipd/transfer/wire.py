"""The KV channel between two workers: one ZeroMQ PUSH (writer) -> PULL (reader) path, messages
as frames. Plain data except the KV bytes themselves.

    BEGIN  [b"B", header]                      tcp: a handoff starts; header has key and meta
    PART   [b"P", key, part (u32 le), bytes]   tcp: one (K/V, layer) part of the KV
    END    [b"E", header]                      the writer's last word on a handoff: header["outcome"]
                                               is "written" (all KV is in the seat), "cancelled"
                                               (nothing will be written), "failed" or "timed_out"
                                               (failed: the write's lease ran out)
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

BEGIN, PART, END = b"B", b"P", b"E"
WRITTEN, CANCELLED, FAILED = "written", "cancelled", "failed"
TIMED_OUT = "timed_out"  # failed: the write's lease ran out first (a slow link, a reader that does not read)


@dataclass(slots=True)
class Peer:
    """How to reach a decode worker: its KV socket, and for in-place writes its cache."""

    kv_address: str
    cache_name: str | None = None
    cache_shape: list[int] | None = None
    cache_dtype: str | None = None
    cache_handle: bytes | None = None  # CUDA IPC


def header(kind: bytes, fields: dict) -> list[bytes]:
    return [kind, msgpack.packb(fields)]


def part(key: str, index: int, data) -> list:
    return [PART, key.encode(), index.to_bytes(4, "little"), data]


def parse(frames: list) -> tuple[bytes, dict | tuple[str, int, object]]:
    kind = bytes(frames[0])
    if kind == PART:
        return kind, (bytes(frames[1]).decode(), int.from_bytes(bytes(frames[2]), "little"), frames[3])
    return kind, msgpack.unpackb(bytes(frames[1]))
