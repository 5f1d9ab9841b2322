from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(slots=True)
class LinkEmulator:
    """Paces a sender so that bytes arrive no faster than a link of `gbps` with `latency_ms`."""

    gbps: float | None = None
    latency_ms: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.gbps) or self.latency_ms > 0

    def due(self, bytes_sent: int) -> float:
        """Seconds after the start by which `bytes_sent` may have left."""
        wire = bytes_sent * 8 / (self.gbps * 1e9) if self.gbps else 0.0
        return self.latency_ms / 1e3 + wire

    def wait(self, start: float, bytes_sent: int, stop: threading.Event | None = None) -> bool:
        """Until `bytes_sent` may have left (start and now on time.monotonic()). False as soon as
        `stop` is set: a transfer nobody wants any more leaves the link at once."""
        delay = start + self.due(bytes_sent) - time.monotonic()
        if stop is not None:
            return not stop.wait(max(0.0, delay))
        if delay > 0:
            time.sleep(delay)
        return True
