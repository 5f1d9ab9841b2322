"""timeline.png: one panel per mode. A row per reply with a tick per token as the client received
it, the long document's prefill shaded, stalls in red; under them a lane per worker with its
engine steps (orange: steps that read prompt tokens, blue: decode-only steps). Mode switches,
replies moved between workers and advisor decisions found in the recorded events are drawn on
the same time axis: a switch as a black line across every lane (shaded while its replies move),
a move as a green arrow from the worker that had the reply to the one that has it, an advisor
decision as a dotted line with its text."""

from __future__ import annotations

from minipd.demo.analysis import prefill_window, stalls
from minipd.demo.scene import Scene

SWITCH_COLOR = "#1d2330"
MOVE_COLOR = "#0c8a5a"
ADVISOR_COLOR = "#b0651a"


def timeline_png(scenes: list[tuple[str, Scene]], path: str) -> None:
    fig = timeline_figure(scenes)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(scenes: list[tuple[str, Scene]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenes), 1, figsize=(12, 2.2 + 1.1 * len(scenes) * 2.2), squeeze=False)
    for ax, (title, scene) in zip(axes[:, 0], scenes):
        _panel(ax, title, scene)
    axes[-1, 0].set_xlabel("seconds since the long document was sent")
    fig.tight_layout()
    return fig


def short_mode(mode: dict | None) -> str:
    """'disagg 1P1D', 'chunked 64', 'colocated': a mode in a few characters."""
    if not mode:
        return "?"
    name = mode.get("mode", "?")
    if name == "disagg":
        return f"disagg {mode.get('prefill_workers')}P{mode.get('decode_workers')}D"
    text = f"chunked {mode.get('chunk_tokens')}" if name == "chunked" else name
    return text + (f" ×{mode['workers']}" if mode.get("workers") else "")


def switches_of(events: list[dict]) -> list[dict]:
    """The mode switches in recorded /admin/events: when each started, when its new mode served and
    when its moves were done, with its label ('→ disagg 1P1D') and outcome (what moved, how long)."""
    out: list[dict] = []
    for e in events:
        if e.get("type") != "mode":
            continue
        phase = e.get("phase")
        if phase in ("switch", "drain"):
            if not any(s["time"] == e["time"] for s in out):
                out.append({"time": e["time"], "from": e.get("from"), "to": e.get("to"), "drain": phase == "drain",
                            "serving": None, "switched": None, "outcome": None})  # fmt: skip
        elif phase == "serving":
            s = next((s for s in reversed(out) if s["serving"] is None and s["time"] <= e["time"]), None)
            if s is not None:
                s["serving"] = e["time"]
        elif phase == "failed":  # it did not happen
            out = [s for s in out if s["time"] != e.get("started")]
        elif phase == "switched":
            s = next((s for s in out if s["time"] == e.get("started")), None)
            if s is None:
                s = {"time": e.get("started", e["time"]), "from": e.get("from"), "to": e.get("to"),
                     "drain": e.get("drain", False), "serving": None}  # fmt: skip
                out.append(s)
            s["switched"], s["outcome"] = e["time"], e
    for s in out:
        s["label"] = f"→ {short_mode(s['to'])}" + (" (drain)" if s["drain"] else "")
        o = s["outcome"]
        if o is not None:
            s["label"] += f" · {o.get('seconds', 0.0):.2f} s · moved {o.get('moved', 0)}"
            if o.get("moved"):
                s["label"] += f" ({o.get('bytes', 0) / 1e3:.0f} kB)"
    return out


def moves_of(events: list[dict]) -> list[dict]:
    """The moves of running replies in recorded /admin/events, each from its start (the router told
    the worker to hand the reply over) to its end, with where its KV went and how it ended."""
    started: dict[str, dict] = {}
    out = []
    for e in events:
        if e.get("type") != "move":
            continue
        if e.get("phase") == "start":
            started[e["key"]] = e
        elif e.get("phase") == "end":
            s = started.pop(e["key"], None)
            out.append({"request_id": e.get("request_id"), "key": e["key"], "source": e.get("source"),
                        "target": e.get("target"), "start": s["time"] if s else e.get("start", e["time"]),
                        "end": e["time"], "outcome": e.get("outcome"), "reason": e.get("reason"),
                        "bytes": e.get("bytes", 0), "tokens": e.get("tokens", 0)})  # fmt: skip
    return out


def advisor_marks(events: list[dict]) -> list[tuple[float, str]]:
    """Advisor decisions: (time, its text)."""
    out = []
    for e in events:
        if e.get("type") == "advisor":
            what = e.get("decision", e.get("chosen", ""))
            out.append((e["time"], what if isinstance(what, str) else str(what)))
    return out


def _panel(ax, title: str, scene: Scene) -> None:
    t0 = scene.long.sent or scene.started
    labels = []
    row = 0
    for s in scene.streams:
        xs = [t - t0 for t in s.token_times]
        ax.vlines(xs, row - 0.35, row + 0.35, color="#3b6ea8", linewidth=0.8)
        for a, b in stalls(s.token_times):
            inset = min(0.1 * (b - a), 0.015)  # a hair between neighbouring stalls
            ax.plot([a - t0 + inset, b - t0 - inset], [row, row], color="#d62728", linewidth=3, solid_capstyle="butt")
        labels.append(s.name)
        row += 1
    xs = [t - t0 for t in scene.long.token_times]
    ax.vlines(xs, row - 0.35, row + 0.35, color="#2ca02c", linewidth=1.5)
    labels.append("long document")
    window = prefill_window(scene)
    if window is not None:
        ax.axvspan(window[0] - t0, window[1] - t0, color="#ff7f0e", alpha=0.15, label="long prefill")
    row += 1
    moves = moves_of(scene.events)
    workers = sorted({e["worker"] for e in scene.events if e["type"] == "step"}
                     | {w for m in moves for w in (m["source"], m["target"]) if w is not None})  # fmt: skip
    worker_row = {}
    for w in workers:
        worker_row[w] = row
        for e in scene.events:
            if e["type"] == "step" and e["worker"] == w and e["end"] >= t0 - 1:
                color = "#ff7f0e" if e["prefill_tokens"] else "#1f77b4"
                ax.broken_barh([(e["time"] - t0, e["end"] - e["time"])], (row - 0.35, 0.7), facecolor=color,
                               edgecolor="white", linewidth=0.3)  # fmt: skip
        labels.append(f"worker {w} steps")
        row += 1
    _switches_and_moves(ax, scene.events, moves, worker_row, t0)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.7, row - 0.3)
    ax.invert_yaxis()
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _switches_and_moves(ax, events: list[dict], moves: list[dict], worker_row: dict, t0: float) -> None:
    """Switches, moves and advisor decisions, on the axes of a panel (time in seconds from t0)."""
    top = -0.6  # just under the top of the panel (the y axis is inverted afterwards)
    for s in switches_of(events):
        x = s["time"] - t0
        ax.axvline(x, color=SWITCH_COLOR, linewidth=1.2)
        if s["switched"] is not None and s["switched"] > s["time"]:
            ax.axvspan(x, s["switched"] - t0, color=MOVE_COLOR, alpha=0.08)
        ax.text(x, top, " " + s["label"], fontsize=7, color=SWITCH_COLOR, va="top", ha="left",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})  # fmt: skip
    for m in moves:
        source, target = worker_row.get(m["source"]), worker_row.get(m["target"])
        if source is None:
            continue
        if m["outcome"] == "moved" and target is not None and target != source:
            ax.annotate("", xy=(m["end"] - t0, target), xytext=(m["start"] - t0, source),
                        arrowprops={"arrowstyle": "->", "color": MOVE_COLOR, "linewidth": 1.2})  # fmt: skip
        else:  # it did not move: a grey cross on the worker that kept it
            ax.plot([m["end"] - t0], [source], marker="x", color="#8a94a3", markersize=6)
    for when, text in advisor_marks(events):
        ax.axvline(when - t0, color=ADVISOR_COLOR, linewidth=1, linestyle=":")
        ax.text(when - t0, top + 0.5, " advisor: " + text[:40], fontsize=7, color=ADVISOR_COLOR, va="top")
