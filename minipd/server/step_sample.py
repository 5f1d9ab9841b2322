"""The steps the advisor fits its step model on: the latest few of every shape of step seen in the
last minutes (how many prompt tokens it read, in powers of four; how many decodes, in powers of two), not
only the latest steps. The latest steps are of the shapes the current mode and traffic make; the
fit must also know what the others cost, for it predicts every mode from the same fit, and the
traffic changes. (On a step trace of the default model, colocated then chunked:64 under phases
traffic, scripts/measure_live_fit.py: in chunked:64's generate phase the next window's steps were
predicted 21% off, 17% slow on average, from the latest 800 steps; 12.5% off from this sample.)"""

from __future__ import annotations

from collections import deque

PER_SHAPE = 40
KEPT_FOR_S = 300.0


def shape_of(prefill_tokens: int, decodes: int) -> tuple[int, int]:
    """Prompt tokens read: 0, 1, 2-7, 8-31, 32-127, ...; decodes: 0, 1, 2-3, 4-7, ..., 128 or more."""
    return (prefill_tokens.bit_length() // 2 + 1 if prefill_tokens else 0), min(decodes.bit_length(), 8)


class StepSample:
    def __init__(self, per_shape: int = PER_SHAPE, kept_for_s: float = KEPT_FOR_S):
        self.per_shape, self.kept_for_s = per_shape, kept_for_s
        self.by_shape: dict[tuple[int, int], deque[dict]] = {}

    def add(self, step: dict) -> None:
        kept = self.by_shape.setdefault(shape_of(step["prefill_tokens"], step["decodes"]), deque(maxlen=self.per_shape))
        kept.append(step)

    def steps(self, now: float) -> list[dict]:
        """Every shape's latest steps that ended within kept_for_s of `now`, in time order."""
        for key in [k for k, kept in self.by_shape.items() if kept[-1]["end"] < now - self.kept_for_s]:
            del self.by_shape[key]
        return sorted((s for kept in self.by_shape.values() for s in kept if s["end"] >= now - self.kept_for_s),
                      key=lambda s: s["time"])  # fmt: skip

    def clear(self) -> None:
        self.by_shape.clear()
