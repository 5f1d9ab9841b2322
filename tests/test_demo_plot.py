"""The demo's timeline plot on a synthetic scene (no server): mode switches, moves of running
replies and advisor decisions found in the recorded events are drawn on the steps' time axis."""

import pytest

from minipd.demo import plot
from minipd.demo.scene import Scene, Stream

pytest.importorskip("matplotlib")

T = 1_000_000.0  # epoch seconds of the scene's start
SWITCH = [
    {"type": "mode", "phase": "switch", "time": T + 1.0, "from": {"mode": "colocated"},
     "to": {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}},
    {"type": "mode", "phase": "serving", "time": T + 1.05, "drain_seconds": 0.05,
     "mode": {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}},
    {"type": "move", "phase": "start", "request_id": "r1", "key": "r1.0", "from": 0, "to": 1, "reason": "switch",
     "time": T + 1.06},
    {"type": "request", "kind": "transfer_start", "request_id": "r1", "key": "r1.0", "worker": 0, "to": 1,
     "bytes": 30_000, "time": T + 1.07},
    {"type": "move", "phase": "end", "request_id": "r1", "key": "r1.0", "source": 0, "target": 1,
     "reason": "switch", "start": T + 1.05, "tokens": 40, "bytes": 30_000, "seconds": 0.02, "outcome": "moved",
     "detail": None, "time": T + 1.09},
    {"type": "move", "phase": "end", "request_id": "r2", "key": "r2.0", "source": 0, "target": None,
     "reason": "switch", "start": T + 1.05, "tokens": 0, "bytes": 0, "seconds": None, "outcome": "no_seat",
     "detail": "no worker that can decode had room", "time": T + 1.1},
    {"type": "mode", "phase": "switched", "time": T + 1.3, "from": {"mode": "colocated"},
     "to": {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, "changed": True, "drain": False,
     "started": T + 1.0, "serving_after_seconds": 0.05, "seconds": 0.3, "requests_in_flight": 2, "moved": 1,
     "not_moved": 1, "bytes": 30_000, "slowest_move_seconds": 0.02, "outcomes": {"moved": 1, "no_seat": 1}},
    {"type": "advisor", "time": T + 2.0, "decision": "stay in disagg"},
]  # fmt: skip


def scene(events):
    steps = [{"type": "step", "worker": w, "time": T + 0.1 * i, "end": T + 0.1 * i + 0.05, "prefill_tokens": 0,
              "decodes": 1, "keys": [], "prefilling": []} for i in range(25) for w in (0, 1)]  # fmt: skip
    streams = [Stream(f"reply {i + 1}", sent=T, token_times=[T + 0.1 * k for k in range(1, 25)]) for i in range(2)]
    long = Stream("long document", sent=T + 0.5, token_times=[T + 1.5, T + 1.6])
    return Scene({"mode": "colocated"}, 1, streams, long, events=steps + events, started=T)


def test_switches_and_moves_are_read_from_the_events():
    (sw,) = plot.switches_of(SWITCH)
    assert sw["time"] == T + 1.0 and sw["serving"] == T + 1.05 and sw["switched"] == T + 1.3
    assert sw["label"] == "→ disagg 1P1D · 0.30 s · moved 1 (30 kB)"
    moved, refused = plot.moves_of(SWITCH)
    assert (moved["source"], moved["target"], moved["outcome"]) == (0, 1, "moved")
    assert moved["start"] == T + 1.06 and moved["end"] == T + 1.09  # from its start event to its end
    assert (refused["source"], refused["target"], refused["outcome"]) == (0, None, "no_seat")
    assert plot.advisor_marks(SWITCH) == [(T + 2.0, "stay in disagg")]
    drain = [{"type": "mode", "phase": "drain", "time": T, "from": {"mode": "disagg"},
              "to": {"mode": "chunked", "chunk_tokens": 64, "workers": 1}}]  # fmt: skip
    assert plot.switches_of(drain)[0]["label"] == "→ chunked 64 ×1 (drain)"  # under way: no outcome yet


def test_the_plot_draws_them_on_the_steps_time_axis(tmp_path):
    from matplotlib.text import Annotation

    fig = plot.timeline_figure([("with a switch", scene(SWITCH)), ("without", scene([]))])
    ax, plain = fig.axes
    t0 = T + 0.5  # the panel's zero: the long document's sending
    texts = [t.get_text() for t in ax.texts]
    assert " → disagg 1P1D · 0.30 s · moved 1 (30 kB)" in texts and " advisor: stay in disagg" in texts
    arrows = [t for t in ax.texts if isinstance(t, Annotation) and t.arrow_patch is not None]
    assert len(arrows) == 1
    rows = {t.get_text(): i for i, t in enumerate(ax.get_yticklabels())}
    (x0, y0), (x1, y1) = arrows[0].xyann, arrows[0].xy  # from the source worker's lane to the target's
    assert (y0, y1) == (rows["worker 0 steps"], rows["worker 1 steps"])
    assert (x0, x1) == pytest.approx((1.06 - 0.5, 1.09 - 0.5))
    switch_lines = [ln for ln in ax.get_lines() if ln.get_xdata()[0] == pytest.approx(T + 1.0 - t0)]
    assert switch_lines  # a vertical line at the switch, in the same seconds as the steps
    assert not [t for t in plain.texts if "→" in t.get_text() or "advisor" in t.get_text()]
    path = tmp_path / "timeline.png"
    plot.timeline_png([("with a switch", scene(SWITCH))], str(path))
    assert path.stat().st_size > 10_000
