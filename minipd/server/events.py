"""What happens inside the server, as it happens: every engine step of every worker, KV
transfers, seats, mode switches, worker deaths. Kept in a ring buffer and fanned out to
subscribers (GET /admin/events streams it as server-sent events)."""

from __future__ import annotations

import asyncio
from collections import deque

SUBSCRIBER_BACKLOG = 20000


class EventLog:
    def __init__(self, size: int = 50000):
        self.buffer: deque[dict] = deque(maxlen=size)
        self.subscribers: set[asyncio.Queue] = set()

    def publish(self, event: dict) -> None:
        self.buffer.append(event)
        for q in list(self.subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a reader that stopped reading is cut off, not waited for
                self.subscribers.discard(q)

    def close(self) -> None:
        """Every subscriber's stream ends (None is the last thing it reads)."""
        for q in list(self.subscribers):
            try:
                q.put_nowait(None)
            except asyncio.QueueFull:
                pass
        self.subscribers.clear()

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    def since(self, t: float) -> list[dict]:
        return [e for e in self.buffer if e.get("time", 0.0) >= t]
