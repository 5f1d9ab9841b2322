from __future__ import annotations

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

    def wait(self, start: float, bytes_sent: int) -> None:
        delay = start + self.due(bytes_sent) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
