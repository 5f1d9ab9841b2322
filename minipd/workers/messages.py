"""Typed messages between the main process and the workers: small dataclasses, sent as
msgpack lists tagged with the class name. Plain data only; no tensors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

_REGISTRY: dict[str, type] = {}


def message(cls):
    cls = dataclass(slots=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


def encode(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, *(getattr(msg, f.name) for f in dataclasses.fields(msg))])


def decode(data: bytes):
    name, *values = msgpack.unpackb(data, strict_map_key=False)
    return _REGISTRY[name](*values)


# ---- main -> worker -------------------------------------------------------------------
@message
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    decode_worker: int | None = None  # disagg: where the KV goes after prefill
    decode_blocks: list[int] | None = None  # ... and into which blocks of its cache


@message
class ReserveSeat:
    request_id: str
    num_tokens: int


@message
class Abort:
    request_id: str


@message
class SetMode:
    role: str
    policy: str
    chunk_tokens: int
    peers: dict = field(default_factory=dict)  # worker id -> Peer fields (transfer.channel)


@message
class Shutdown:
    pass


# ---- worker -> main -------------------------------------------------------------------
@message
class Ready:
    worker_id: int
    pid: int
    device: str
    kv_address: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    kv_cache_name: str | None = None  # shared-memory segment holding the KV cache (shm transport)
    kv_cache_shape: list[int] | None = None
    kv_cache_dtype: str | None = None
    kv_cache_handle: bytes | None = None  # CUDA IPC handle to the KV cache (cuda-ipc transport)


@message
class Tokens:
    request_id: str
    worker_id: int
    token_ids: list[int]
    time: float
    finished: bool = False
    finish_reason: str | None = None


@message
class Event:
    """A point on a request's timeline (prefill_start, prefill_end, transfer_start, ...)."""

    request_id: str
    worker_id: int
    kind: str
    time: float
    data: dict = field(default_factory=dict)


@message
class SeatReply:
    request_id: str
    worker_id: int
    block_ids: list[int] | None  # None: no room


@message
class ModeSet:
    worker_id: int
    role: str
    policy: str


@message
class WorkerStats:
    worker_id: int
    role: str
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_reserved: int
    blocks_total: int


@message
class RequestError:
    request_id: str
    worker_id: int
    message: str
