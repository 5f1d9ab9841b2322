"""timeline.png: one panel per mode. A row per reply with a tick per token as the client received
it, the long document's prefill shaded, stalls in red; under them a lane per worker with its
engine steps (orange: steps that read prompt tokens, blue: decode-only steps)."""

from __future__ import annotations

from minipd.demo.analysis import prefill_window, stalls
from minipd.demo.scene import Scene


def timeline_png(scenes: list[tuple[str, Scene]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenes), 1, figsize=(12, 2.2 + 1.1 * len(scenes) * 2.2), squeeze=False)
    for ax, (title, scene) in zip(axes[:, 0], scenes):
        _panel(ax, title, scene)
    axes[-1, 0].set_xlabel("seconds since the long document was sent")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    workers = sorted({e["worker"] for e in scene.events if e["type"] == "step"})
    for w in workers:
        for e in scene.events:
            if e["type"] == "step" and e["worker"] == w and e["end"] >= t0 - 1:
                color = "#ff7f0e" if e["prefill_tokens"] else "#1f77b4"
                ax.broken_barh([(e["time"] - t0, e["end"] - e["time"])], (row - 0.35, 0.7), facecolor=color,
                               edgecolor="white", linewidth=0.3)  # fmt: skip
        labels.append(f"worker {w} steps")
        row += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.7, row - 0.3)
    ax.invert_yaxis()
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
