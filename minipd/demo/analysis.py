"""The numbers of a scene: how long the other replies froze while the long document was read."""

from __future__ import annotations

import statistics

from minipd.demo.scene import Scene

STALL_FACTOR = 3.0  # a gap this many times a reply's median gap is drawn as a stall


def gaps(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:]))


def prefill_window(scene: Scene) -> tuple[float, float] | None:
    """When the server read the long document (its first to its last prompt step)."""
    events = (scene.long.timeline or {}).get("events", {})
    if "prefill_start" in events and "prefill_end" in events:
        return events["prefill_start"], events["prefill_end"]
    return None


def stats(scene: Scene) -> dict:
    """The stall (the longest gap of another reply that overlaps the long prefill), the replies'
    median gap, the long prompt's prefill time and TTFT, and in disagg the KV handoff."""
    all_gaps = [b - a for s in scene.streams for a, b in gaps(s.token_times)]
    median = statistics.median(all_gaps) if all_gaps else None
    window = prefill_window(scene)
    stall = 0.0
    if window is not None:
        for s in scene.streams:
            for a, b in gaps(s.token_times):
                if b >= window[0] and a <= window[1]:
                    stall = max(stall, b - a)
    timeline = scene.long.timeline or {}
    kv = timeline.get("kv_transfer") or {}
    first = scene.long.token_times[0] if scene.long.token_times else None
    return {
        "median_gap_s": median,
        "stall_s": stall,
        "stall_over_median": stall / median if median else None,
        "prefill_s": window[1] - window[0] if window else None,
        "stall_over_prefill": stall / (window[1] - window[0]) if window and window[1] > window[0] else None,
        "long_prompt_tokens": scene.long_prompt_tokens,
        "long_ttft_s": first - scene.long.sent if first else None,
        "kv_bytes": kv.get("bytes") or 0,
        "kv_transfer_s": kv.get("seconds"),
        "errors": [s.error for s in (*scene.streams, scene.long) if s.error],
    }


def stalls(times: list[float], factor: float = STALL_FACTOR) -> list[tuple[float, float]]:
    """The gaps of one reply longer than `factor` times its median gap."""
    pairs = gaps(times)
    if len(pairs) < 3:
        return []
    median = statistics.median(b - a for a, b in pairs)
    return [(a, b) for a, b in pairs if b - a > factor * median]


def summary(runs: list[dict]) -> dict:
    """Median and spread over the runs of one mode."""
    out = {}
    for key in ("stall_s", "median_gap_s", "stall_over_median", "stall_over_prefill", "prefill_s", "long_ttft_s",
                "kv_bytes", "kv_transfer_s"):  # fmt: skip
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out
