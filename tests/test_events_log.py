"""The event log behind GET /admin/events: bounded by bytes, replayed from a time."""

import json

from minipd.server.events import EventLog

MiB = 2**20


def step(t: float, keys: list[str]) -> dict:
    return {"type": "step", "worker": 0, "time": t, "end": t + 0.01, "prefill_tokens": 0, "decodes": len(keys),
            "keys": keys, "prefilling": []}  # fmt: skip


def encoded(events: list[dict]) -> int:
    return sum(len(json.dumps(e)) for e in events)


def test_the_log_keeps_at_most_32_mib_of_events_by_default():
    """Defect: it kept the last 50,000 events whatever their size; steps of 64 decodes each made that
    over 300 MB of the main process."""
    keys = [f"cmpl-{i:032x}.1" for i in range(64)]
    log = EventLog()
    for i in range(50_000):
        log.publish(step(float(i), keys))
    kept = log.since(0.0)
    assert 32 * MiB - 2 * encoded(kept[:1]) < encoded(kept) <= 32 * MiB
    assert [e["time"] for e in kept] == [float(i) for i in range(50_000 - len(kept), 50_000)]


def test_since_replays_what_is_kept_from_a_time_on():
    log = EventLog(max_bytes=2000)
    for i in range(100):
        log.publish(step(float(i), ["r.1"]))
    kept = [e["time"] for e in log.since(0.0)]
    assert kept == [float(i) for i in range(100 - len(kept), 100)] and encoded(log.since(0.0)) <= 2000
    assert [e["time"] for e in log.since(97.5)] == [98.0, 99.0]
    assert log.since(100.0) == []
