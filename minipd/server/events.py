"""What happens inside the server, as it happens: every engine step of every worker, KV
transfers, seats, mode switches, worker deaths. The newest are kept, up to a size in bytes
(as JSON), for replay, and fanned out to subscribers (GET /admin/events streams them as
server-sent events)."""

from __future__ import annotations

import asyncio
import json
from collections import deque

SUBSCRIBER_BACKLOG = 20000
MAX_BYTES = 32 * 2**20


class EventLog:
    def __init__(self, max_bytes: int = MAX_BYTES):
        """max_bytes: the kept events' size as JSON (Python holds them in 2 to 4 times that)."""
        self.max_bytes = max_bytes
        self.buffer: deque[tuple[dict, int]] = deque()  # (event, its size as JSON), oldest first
        self.bytes = 0
        self.subscribers: set[asyncio.Queue] = set()
        self.cut_off: set[asyncio.Queue] = set()  # dropped for falling behind: their streams end once read out

    def publish(self, event: dict) -> None:
        size = len(json.dumps(event, default=str))
        self.buffer.append((event, size))
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self.buffer.popleft()[1]
        for q in list(self.subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a reader that stopped reading is cut off, not waited for
                self.subscribers.discard(q)
                self.cut_off.add(q)

    def close(self) -> None:
        """Every subscriber's stream ends (None is the last thing it reads)."""
        for q in list(self.subscribers):
            try:
                q.put_nowait(None)
            except asyncio.QueueFull:
                self.cut_off.add(q)
        self.subscribers.clear()

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)
        self.cut_off.discard(q)

    def ended(self, q: asyncio.Queue) -> bool:
        """A subscriber cut off has read every event it was given: its stream must end, or it would
        wait for events that never come (its reader reconnects with ?since= its last event's time)."""
        return q in self.cut_off and q.empty()

    def since(self, t: float) -> list[dict]:
        return [e for e, _ in self.buffer if e.get("time", 0.0) >= t]
