"""The scene in the terminal, as it happens (rich): each reply growing, a red wait while it is
frozen, the long document's progress, and what every worker is doing."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from minipd.demo.analysis import STALL_FACTOR, gaps
from minipd.demo.scene import Scene, Stream

SPARK = 40  # recent steps drawn per worker


def render(scene: Scene, title: str) -> Group:
    now = time.time()
    head = Text(f"{title}   (times as the client receives tokens)", style="bold")
    table = Table(show_header=True, header_style="bold", expand=True, box=None)
    table.add_column("", width=14)
    table.add_column("reply so far", ratio=1, no_wrap=True, overflow="ellipsis")
    table.add_column("tokens", justify="right", width=6)
    table.add_column("waiting", justify="right", width=10)
    for s in scene.streams:
        table.add_row(s.name, _tail(s.text), str(len(s.token_times)), _wait(s, now))
    table.add_row(Text("long document", style="bold"), _long_status(scene, now), str(len(scene.long.token_times)), "")
    lanes = Table(show_header=False, expand=True, box=None)
    lanes.add_column("", width=14)
    lanes.add_column("", ratio=1, no_wrap=True)
    for worker, line in _worker_lines(scene, now):
        lanes.add_row(f"worker {worker}", line)
    return Group(head, table, Text(""), lanes)


def _tail(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return ("…" + flat[-width:]) if len(flat) > width else flat


def _wait(s: Stream, now: float) -> Text:
    if s.done:
        return Text("done", style="dim")
    if not s.token_times:
        return Text("…")
    wait = now - s.token_times[-1]
    pairs = gaps(s.token_times)
    median = sorted(b - a for a, b in pairs)[len(pairs) // 2] if len(pairs) >= 3 else None
    frozen = median is not None and wait > STALL_FACTOR * median
    return Text(f"{wait * 1e3:6.0f} ms", style="bold white on red" if frozen else "green")


def _long_key(scene: Scene) -> str | None:
    rid = scene.long.request_id
    return None if rid is None else rid + "."


def _long_status(scene: Scene, now: float) -> Text:
    long = scene.long
    if not long.sent:
        return Text("not sent yet", style="dim")
    if long.token_times:
        ttft = long.token_times[0] - long.sent
        return Text(f"first token after {ttft:.2f} s" + (" (done)" if long.done else ""), style="green")
    key = _long_key(scene)
    read, handoff = 0, None
    for e in scene.events:
        if key is None:
            break
        if e["type"] == "step" and any(k.startswith(key) for k in e.get("prefilling", [])):
            read += e["prefill_tokens"]
        if e["type"] == "request" and e.get("key", "").startswith(key) and e["kind"] == "transfer_start":
            handoff = e
    total = scene.long_prompt_tokens or None
    text = f"sent {now - long.sent:.1f} s ago; "
    text += f"prompt read: {read}" + (f"/{total}" if total else "") + " tokens" if read else "waiting for its prefill"
    if handoff is not None:
        text += f"; KV handoff of {handoff['bytes'] / 1e6:.1f} MB started"
    return Text(text, style="yellow")


def _worker_lines(scene: Scene, now: float) -> list[tuple[int, Text]]:
    steps: dict[int, list[dict]] = {}
    running: dict[int, dict] = {}
    for e in scene.events:
        if e["type"] == "step":
            steps.setdefault(e["worker"], []).append(e)
            if e["worker"] in running and running[e["worker"]]["time"] <= e["time"]:
                del running[e["worker"]]
        elif e["type"] == "step_start":
            running[e["worker"]] = e
    lines = []
    for worker in sorted(set(steps) | set(running)):
        line = Text()
        for e in steps.get(worker, [])[-SPARK:]:
            line.append("▮", style="dark_orange" if e["prefill_tokens"] else "steel_blue")
        if worker in running:
            r = running[worker]
            line.append(f"  reading {r['prefill_tokens']} prompt tokens for {now - r['time']:.1f} s",
                        style="bold dark_orange")  # fmt: skip
        elif steps.get(worker):
            last = steps[worker][-1]
            what = f"prefill {last['prefill_tokens']} + " if last["prefill_tokens"] else ""
            line.append(f"  last step: {what}decode {last['decodes']}, {(last['end'] - last['time']) * 1e3:.0f} ms",
                        style="dim")  # fmt: skip
        lines.append((worker, line))
    return lines
