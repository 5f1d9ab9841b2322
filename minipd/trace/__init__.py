"""Traces of a run in the Chrome trace / Perfetto JSON format, made from the event dicts of
GET /admin/events (or from a simulator that emits the same dicts)."""

from minipd.trace.chrome import to_chrome_trace

__all__ = ["to_chrome_trace"]
