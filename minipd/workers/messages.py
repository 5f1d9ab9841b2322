"""Typed messages between the main process and the workers: small dataclasses, sent as
msgpack lists tagged with the class name. Plain data only; no tensors.

Workers know a request by its key: the request id and the attempt (a request redone after a
worker died gets a new key, so nothing from the old attempt can be mistaken for the new one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

_REGISTRY: dict[str, type] = {}


class BadMessage(ValueError):
    pass


def message(cls):
    cls = dataclass(slots=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


def encode(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, *(getattr(msg, f.name) for f in dataclasses.fields(msg))])


def decode(data: bytes):
    try:
        name, *values = msgpack.unpackb(data, strict_map_key=False)
        return _REGISTRY[name](*values)
    except Exception as err:
        raise BadMessage(f"not a message: {bytes(data[:60])!r}... ({err})") from None


# ---- main -> worker -------------------------------------------------------------------
@message
class AddRequest:
    key: str
    prompt_token_ids: list[int]
    params: dict
    output_token_ids: list[int] = field(default_factory=list)  # already sent: the request is being redone
    reader: int | None = None  # disagg: the decode worker whose seat receives the KV
    seat: list[int] | None = None  # ... the seat's blocks in its cache


@message
class Move:
    """Hand a running request to `reader` at its next token boundary: its KV goes into `seat`."""

    key: str
    reader: int
    seat: list[int]


@message
class ReserveSeats:
    batch: int
    seats: list  # [key, num_tokens, headroom_tokens, writer] each


@message
class Abort:
    key: str
    writer_done: bool = False  # to a reader: no one will write into this request's seat
    reader: int | None = None  # to a writer: whose seat to tell, should it not know the request


@message
class SetMode:
    role: str
    policy: str
    chunk_tokens: int
    peers: dict = field(default_factory=dict)  # worker id -> transfer.wire.Peer fields
    link: list | None = None  # tcp: [gbps or None, latency_ms] of the emulated KV link


@message
class Peers:
    """The peer table changed: a worker was replaced (new addresses) or died (`gone`)."""

    peers: dict
    gone: list[int] = field(default_factory=list)


@message
class Shutdown:
    pass


# ---- worker -> main -------------------------------------------------------------------
@message
class Ready:
    worker_id: int
    incarnation: int
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
    key: str
    worker_id: int
    token_ids: list[int]
    time: float
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0  # output tokens of the request before these (a prefill and a decode worker send on
    # different sockets, so the main process may read them out of order)
    logprobs: list | None = None  # per token, when the request asked: [its logprob, [[id, logprob], ...]]
    prompt_logprobs: list | None = None  # with the first token, when asked: per prompt token [id, logprob, rank, top]
    stop_reason: int | None = None  # finished by a stop_token_ids token: it (not eos)


@message
class Event:
    """A point on a request's timeline (prefill_start, prefill_end, transfer_start, ...)."""

    key: str
    worker_id: int
    kind: str
    time: float
    data: dict = field(default_factory=dict)


@message
class Step:
    """One engine step, as it happened."""

    worker_id: int
    start: float
    end: float
    prefill_tokens: int
    num_decodes: int
    keys: list[str]
    prefilling: list[str]
    prefill_attention: int = 0  # (query, key) pairs the prompt tokens attended to
    decode_context: int = 0  # tokens the decodes attended to, together


@message
class StepStart:
    """A step that reads prompt tokens has begun (it may take a while)."""

    worker_id: int
    start: float
    prefill_tokens: int
    num_decodes: int
    prefilling: list[str]


@message
class SeatsReserved:
    batch: int
    worker_id: int
    results: list  # [key, block ids or None] each; None: no room


@message
class ModeSet:
    worker_id: int
    role: str
    policy: str
    error: str | None = None


@message
class Leaving:
    """The worker was sent SIGTERM: the main process moves its requests away, then stops it."""

    worker_id: int
    incarnation: int


@message
class Heartbeat:
    """From a thread of its own, whatever the worker's loop is doing: a long step is not a hang."""

    worker_id: int
    incarnation: int
    step_s: float  # how long the step under way has run (0 between steps)
    stalled_s: float  # how long the loop has not come round, outside a step (a hang if it grows)


@message
class WorkerStats:
    """Sent after changes and at least every heartbeat interval."""

    worker_id: int
    role: str
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_seated: int
    blocks_booked: int
    blocks_total: int
    num_preempted: int
    handoffs: dict  # stage -> count, both sides
    integrity_error: str | None = None
    gc: dict | None = None  # heap.GcPauses.as_dict(): the collector's pauses in the worker


@message
class SeatOverdue:
    """A seat waited longer than its lease for its KV (its reader now waits only for the writer)."""

    key: str
    worker_id: int
    writer: int


@message
class RequestError:
    key: str
    worker_id: int
    message: str
    code: str | None = None  # KV_HANDOFF_FAILED: the KV did not cross (a state a retry may pass, not a fault)


KV_HANDOFF_FAILED = "kv_handoff_failed"
KV_HANDOFF_TIMEOUT = "kv_handoff_timeout"  # ... within its lease (--kv-transfer-timeout)
