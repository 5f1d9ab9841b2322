"""The demo's scene and the server's event stream, checked against each other on real workers:
every token a client received was made by a step the server reported, and in colocated mode a
reply's longest wait is the step that read the long document."""

import json
import subprocess
import sys

import pytest

from minipd.demo import analysis
from minipd.demo.scene import play
from tests.helpers import serving

pytestmark = pytest.mark.slow
DOC = "A long document about a harbour town. " * 150


def steps_of(scene):
    return [e for e in scene.events if e["type"] == "step"]


@pytest.mark.parametrize("mode", [{"mode": "colocated", "workers": 1},
                                  {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}])  # fmt: skip
@pytest.mark.asyncio
async def test_every_token_lies_in_a_step_of_the_worker_that_made_it(mode):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1",
                 env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:  # fmt: skip
        scene = await play(s.url, mode, 1, streams=3, stream_tokens=40, document=DOC)
        steps = steps_of(scene)
        for stream in (*scene.streams, scene.long):
            t = stream.timeline
            key = stream.request_id + "."
            for i, when in enumerate(t["token_times"]):
                maker = t["prefill_worker"] if i == 0 else t["decode_worker"]
                made = [e for e in steps if e["worker"] == maker and e["end"] == when
                        and any(k.startswith(key) for k in e["keys"])]  # fmt: skip
                assert len(made) == 1, (stream.name, i, when)
                assert made[0]["time"] <= when
            # text is received after the step that made it ended (a chunk may carry held-back text of several)
            assert stream.token_times[0] >= t["token_times"][0] and stream.token_times[-1] >= t["token_times"][-1]


@pytest.mark.asyncio
async def test_in_colocated_the_longest_wait_is_the_long_prefill_step():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1",
                 env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:  # fmt: skip
        scene = await play(s.url, {"mode": "colocated", "workers": 1}, 1, streams=3, stream_tokens=60,
                           document=DOC * 2)  # fmt: skip
        key = scene.long.request_id + "."
        prefill = [e for e in steps_of(scene) if any(k.startswith(key) for k in e["prefilling"])]
        assert len(prefill) == 1  # read whole, in one step
        step = prefill[0]
        for stream in scene.streams:
            a, b = max(analysis.gaps(stream.token_times), key=lambda g: g[1] - g[0])
            assert a <= step["time"] and step["end"] <= b, stream.name
        assert analysis.stats(scene)["stall_over_prefill"] >= 0.8


def test_demo_quick_on_the_default_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipd", "demo", "--quick", "--no-live", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    demo = json.loads((tmp_path / "demo.json").read_text())
    assert all(c["ok"] for c in demo["checks"]), demo["checks"]
    colo, chunked, disagg = (demo["modes"][m]["summary"] for m in ("colocated", "chunked", "disagg"))
    assert colo["stall_over_prefill"]["median"] >= 0.8
    assert disagg["stall_over_prefill"]["median"] <= 0.1
    assert colo["stall_s"]["median"] > chunked["stall_s"]["median"] > disagg["stall_s"]["median"]
    assert len(demo["modes"]["disagg"]["runs"]) == 2 and disagg["kv_bytes"]["median"] > 0
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert "client" in demo["note"]


def test_disaggregation_passes_when_its_replies_did_not_wait_for_the_document():
    """Defect (a CI run on the 2-core machine): the demo exited 1 because disagg's worst reply gap
    was 3.3x the median (73 ms against 22), one scheduling hiccup of two busy cores, while the
    replies froze for 2% of the document's prefill against colocated's 101%. The check asks what
    the demo teaches: the replies froze for at most a tenth of the prefill (colocated: at least 80%)."""
    from minipd.demo.main import _checks

    def summary(colocated: float, chunked: float, disagg: float, disagg_gap_ratio: float) -> dict:
        def mode(stall: float, ratio: float) -> dict:
            return {"stall_s": {"median": stall}, "stall_over_prefill": {"median": stall / 2.7},
                    "stall_over_median": {"median": ratio}}  # fmt: skip
        return {"colocated": mode(colocated, 126), "chunked": mode(chunked, 9), "disagg": mode(disagg, disagg_gap_ratio)}

    assert all(ok for _, ok in _checks(summary(2.7, 0.19, 0.073, 3.3)))
    failed = [text for text, ok in _checks(summary(2.7, 0.9, 0.8, 36)) if not ok]
    assert len(failed) == 1 and failed[0].startswith("disagg: the replies froze for 30%"), failed


def test_the_table_title_says_what_the_brackets_hold():
    from argparse import Namespace

    from rich.console import Console

    from minipd.demo.main import _print_table

    console = Console(record=True, width=200)
    s = {"median": 0.1, "min": 0.09, "max": 0.11}
    _print_table(console, {"colocated": {"stall_s": s}}, Namespace(streams=3, long_tokens=1500, repeats=3))
    text = console.export_text()
    assert "[min-max]" in text and "100 ms [90-110]" in text
