"""The Chrome / Perfetto trace made from the event stream of GET /admin/events."""

import json
import subprocess
import sys

import pytest

from minipd.trace import to_chrome_trace

T0 = 1_700_000_000.0
DISAGG = {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}


def disagg_request(rid="cmpl-a", t=T0) -> list[dict]:
    """One request as the server publishes it in disagg 1P1D: a prefill step on worker 0, its KV
    from worker 0 to worker 1, two decode steps on worker 1 (another request rides the second)."""
    key = f"{rid}.0"
    return [
        {"type": "request", "kind": "placed", "request_id": rid, "path": "remote", "time": t},
        {"type": "step", "worker": 0, "time": t + 0.010, "end": t + 0.110, "prefill_tokens": 512, "decodes": 0,
         "keys": [key], "prefilling": [key]},
        {"type": "request", "kind": "transfer_start", "request_id": rid, "key": key, "worker": 0,
         "time": t + 0.120, "bytes": 4_000_000, "to": 1},
        {"type": "request", "kind": "kv_copied", "request_id": rid, "key": key, "worker": 0, "time": t + 0.125, "to": 1},
        {"type": "request", "kind": "transfer_end", "request_id": rid, "key": key, "worker": 1, "time": t + 0.130,
         "bytes": 4_000_000, "seconds": 0.01},
        {"type": "request", "kind": "kv_sent", "request_id": rid, "key": key, "worker": 0, "time": t + 0.131,
         "outcome": "written", "error": None},
        {"type": "step", "worker": 1, "time": t + 0.140, "end": t + 0.160, "prefill_tokens": 0, "decodes": 1,
         "keys": [key], "prefilling": []},
        {"type": "step", "worker": 1, "time": t + 0.160, "end": t + 0.185, "prefill_tokens": 0, "decodes": 3,
         "keys": [key, "cmpl-b.0", "cmpl-c.1"], "prefilling": []},
    ]  # fmt: skip


def by_ph(trace, ph):
    return [x for x in trace["traceEvents"] if x["ph"] == ph]


def track_names(trace) -> dict[tuple[int, int], str]:
    return {(x["pid"], x["tid"]): x["args"]["name"] for x in by_ph(trace, "M") if x["name"] == "thread_name"}


def process_names(trace) -> dict[int, str]:
    return {x["pid"]: x["args"]["name"] for x in by_ph(trace, "M") if x["name"] == "process_name"}


def track_of(trace, x) -> str:
    return f"{process_names(trace)[x['pid']]}/{track_names(trace)[(x['pid'], x['tid'])]}"


def test_steps_are_slices_in_microseconds_on_a_track_per_worker():
    trace = to_chrome_trace(disagg_request())
    steps = [x for x in by_ph(trace, "X") if x["cat"] == "step"]
    assert [(track_of(trace, x), x["name"], x["ts"], x["dur"]) for x in steps] == [
        ("workers/worker 0", "prefill 512", 10_000.0, 100_000.0),
        ("workers/worker 1", "decode x1", 140_000.0, 20_000.0),
        ("workers/worker 1", "decode x3", 160_000.0, 25_000.0),
    ]
    assert steps[2]["args"] == {"prefill_tokens": 0, "decodes": 3, "keys": ["cmpl-a.0", "cmpl-b.0", "cmpl-c.1"],
                                "prefilling": []}  # fmt: skip
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["start_time"] == T0
    assert all(isinstance(x["ts"], (int, float)) for x in trace["traceEvents"] if x["ph"] != "M")


def test_a_mixed_step_is_named_by_both_parts():
    ev = [{"type": "step", "worker": 2, "time": T0, "end": T0 + 0.5, "prefill_tokens": 64, "decodes": 3,
           "keys": ["x.0"], "prefilling": ["y.0"]}]  # fmt: skip
    (x,) = by_ph(to_chrome_trace(ev), "X")
    assert x["name"] == "prefill 64 + 3 decodes" and x["dur"] == 500_000.0


def test_the_kv_transfer_is_a_slice_on_its_link():
    trace = to_chrome_trace(disagg_request())
    (kv,) = [x for x in by_ph(trace, "X") if x["cat"] == "kv"]
    assert track_of(trace, kv) == "links/worker 0 -> worker 1"
    assert (kv["name"], kv["ts"], kv["dur"]) == ("KV handoff", 120_000.0, 10_000.0)  # transfer_start -> transfer_end
    assert kv["args"]["bytes"] == 4_000_000 and kv["args"]["request_id"] == "cmpl-a"
    assert kv["args"]["copied_after_ms"] == 5.0 and kv["args"]["outcome"] == "written"
    assert kv["args"]["gbps"] == pytest.approx(3.2)


def test_overlapping_transfers_on_one_link_get_lanes():
    ev = []
    for i, (start, end) in enumerate([(0.0, 0.3), (0.1, 0.2), (0.4, 0.5)]):
        key = f"r{i}.0"
        ev += [{"type": "request", "kind": "transfer_start", "key": key, "worker": 0, "time": T0 + start, "to": 1,
                "bytes": 10},
               {"type": "request", "kind": "transfer_end", "key": key, "worker": 1, "time": T0 + end, "bytes": 10}]  # fmt: skip
    trace = to_chrome_trace(ev)
    assert [track_of(trace, x) for x in by_ph(trace, "X")] == [
        "links/worker 0 -> worker 1",
        "links/worker 0 -> worker 1 #2",
        "links/worker 0 -> worker 1",
    ]


def test_a_failed_transfer_ends_at_kv_sent_and_one_without_an_end_at_the_last_event():
    ev = [
        {"type": "request", "kind": "transfer_start", "key": "f.0", "worker": 1, "time": T0, "to": 0, "bytes": 8},
        {"type": "request", "kind": "kv_sent", "key": "f.0", "worker": 1, "time": T0 + 0.5, "outcome": "failed",
         "error": "the reader died"},
        {"type": "request", "kind": "transfer_start", "key": "g.0", "worker": 1, "time": T0 + 0.6, "bytes": 8},
        {"type": "request", "kind": "transfer_end", "key": "g.0", "worker": 0, "time": T0 + 0.7, "bytes": 8},
        {"type": "request", "kind": "transfer_start", "key": "h.0", "worker": 1, "time": T0 + 0.8, "to": 0},
        {"type": "request", "kind": "transfer_end", "key": "lost-its-start.0", "worker": 0, "time": T0 + 1.0},
    ]  # fmt: skip
    trace = to_chrome_trace(ev)
    failed, ok, unfinished = by_ph(trace, "X")
    assert {track_of(trace, x) for x in (failed, ok, unfinished)} == {"links/worker 1 -> worker 0"}
    assert (failed["dur"], failed["args"]["outcome"], failed["args"]["error"]) == (500_000, "failed", "the reader died")
    assert (ok["ts"], ok["dur"], ok["args"]["end_seen"]) == (600_000, 100_000, True)  # its reader from transfer_end
    assert (unfinished["ts"], unfinished["dur"], unfinished["args"]["end_seen"]) == (800_000, 200_000, False)


def test_a_flow_follows_the_request_from_prefill_over_the_link_to_decode():
    trace = to_chrome_trace(disagg_request())
    flows = [x for x in trace["traceEvents"] if x["ph"] in "stf" and x["name"] == "request cmpl-a"]
    assert [x["ph"] for x in flows] == ["s", "t", "t", "f"]
    assert len({x["id"] for x in flows}) == 1 and all(x["cat"] == "request" for x in flows)
    assert [track_of(trace, x) for x in flows] == ["workers/worker 0", "links/worker 0 -> worker 1",
                                                   "workers/worker 1", "workers/worker 1"]  # fmt: skip
    ts = [x["ts"] for x in flows]
    assert ts == sorted(ts)
    slices = by_ph(trace, "X")
    for flow in flows:  # each point lies inside a slice of its track, which it binds to
        assert any(s["pid"] == flow["pid"] and s["tid"] == flow["tid"] and s["ts"] < flow["ts"] < s["ts"] + s["dur"]
                   for s in slices)  # fmt: skip
    assert all(x.get("bp") == "e" for x in flows[1:])
    # cmpl-b and cmpl-c rode one step each here: no flow of one point
    assert not [x for x in trace["traceEvents"] if x["ph"] in "stf" and x["name"] != "request cmpl-a"]
    assert trace["otherData"]["flows"] == 1


def test_each_request_has_a_flow_of_its_own():
    ev = disagg_request("cmpl-a", T0) + disagg_request("cmpl-z", T0 + 1)
    flows = [x for x in to_chrome_trace(ev)["traceEvents"] if x["ph"] in "stf"]
    ids = {}
    for x in flows:
        ids.setdefault(x["name"], set()).add(x["id"])
    # cmpl-b and cmpl-c rode a step in each of the two: a flow of two points each
    assert set(ids) == {f"request cmpl-{c}" for c in "azbc"} and all(len(v) == 1 for v in ids.values())
    assert len(set.union(*ids.values())) == 4


def test_a_mode_switch_is_instants_and_a_slice_on_the_mode_track():
    other = {"mode": "colocated"}
    ev = [
        {"type": "mode", "phase": "switch", "time": T0, "from": other, "to": DISAGG},
        {"type": "mode", "phase": "serving", "time": T0 + 0.004, "mode": DISAGG, "drain_seconds": 0.004},
        {"type": "mode", "phase": "switched", "time": T0 + 0.061, "from": other, "to": DISAGG, "changed": True,
         "drain": False, "started": T0, "serving_after_seconds": 0.004, "seconds": 0.06, "moved": 4, "bytes": 100},
    ]  # fmt: skip
    trace = to_chrome_trace(ev)
    instants = by_ph(trace, "i")
    assert [(track_of(trace, x), x["name"], x["ts"]) for x in instants] == [
        ("server/mode", "switch colocated -> disagg:1p1d", 0.0),
        ("server/mode", "serving disagg:1p1d", 4000.0),
        ("server/mode", "switched to disagg:1p1d: 4 moved", 61000.0),
    ]
    assert instants[2]["args"]["moved"] == 4 and instants[2]["args"]["to"] == DISAGG
    assert all(x["s"] == "t" for x in instants)
    (switch,) = by_ph(trace, "X")
    assert (track_of(trace, switch), switch["name"], switch["ts"], switch["dur"]) == (
        "server/mode", "switch colocated -> disagg:1p1d", 0.0, 60000.0)  # fmt: skip


def test_a_move_is_instants_and_its_kv_a_move_on_the_link():
    key = "cmpl-m.0"
    ev = [
        {"type": "move", "phase": "start", "request_id": "cmpl-m", "key": key, "from": 0, "to": 1,
         "reason": "switch", "time": T0},
        {"type": "request", "kind": "transfer_start", "request_id": "cmpl-m", "key": key, "worker": 0,
         "time": T0 + 0.01, "bytes": 1000, "to": 1},
        {"type": "request", "kind": "transfer_end", "request_id": "cmpl-m", "key": key, "worker": 1,
         "time": T0 + 0.03, "bytes": 1000, "seconds": 0.02},
        {"type": "move", "phase": "end", "request_id": "cmpl-m", "key": key, "source": 0, "reason": "switch",
         "start": T0, "target": 1, "tokens": 40, "bytes": 1000, "seconds": 0.03, "outcome": "moved",
         "detail": None, "time": T0 + 0.031},
    ]  # fmt: skip
    trace = to_chrome_trace(ev)
    instants = by_ph(trace, "i")
    assert [(track_of(trace, x), x["name"], x["ts"]) for x in instants] == [
        ("server/moves", "move cmpl-m: 0 -> 1 (switch)", 0.0),
        ("server/moves", "moved cmpl-m", 31000.0),
    ]
    assert instants[1]["args"]["tokens"] == 40
    (kv,) = by_ph(trace, "X")
    assert (track_of(trace, kv), kv["name"], kv["ts"], kv["dur"]) == ("links/worker 0 -> worker 1", "KV move",
                                                                      10000.0, 20000.0)  # fmt: skip


def test_worker_changes_and_advisor_decisions_are_instants():
    ev = [
        {"type": "worker", "worker": 1, "state": "lost", "cause": "exit code -9", "time": T0},
        {"type": "worker", "worker": 1, "state": "up", "time": T0 + 2},
        {"type": "advisor", "time": T0 + 3, "window_s": 30, "current": {"mode": "colocated"}, "switch_to": None,
         "decision": "stay: colocated is predicted best"},
    ]  # fmt: skip
    trace = to_chrome_trace(ev)
    assert [(track_of(trace, x), x["name"], x["ts"]) for x in by_ph(trace, "i")] == [
        ("workers/worker 1", "worker 1 lost", 0.0),
        ("workers/worker 1", "worker 1 up", 2_000_000.0),
        ("server/advisor", "advisor: stay: colocated is predicted best", 3_000_000.0),
    ]
    assert by_ph(trace, "i")[0]["args"] == {"worker": 1, "state": "lost", "cause": "exit code -9"}


def test_unknown_and_broken_events_are_skipped_and_the_trace_round_trips():
    ev = [{"type": "from-the-future", "time": T0 - 5}, {"type": "step", "time": T0}, "not a dict",
          {"type": "step_start", "worker": 0, "time": T0, "prefill_tokens": 1, "decodes": 0, "prefilling": []},
          *disagg_request()]  # fmt: skip
    trace = to_chrome_trace(ev, title="round trip")
    assert trace["otherData"]["skipped"] == 3 and trace["otherData"]["title"] == "round trip"
    assert json.loads(json.dumps(trace)) == trace
    assert trace == to_chrome_trace(disagg_request(), title="round trip") | {"otherData": trace["otherData"]}
    # tracks are numbered in order: workers by id, then links, then the server's
    names = track_names(trace)
    assert [names[k] for k in sorted(names, key=lambda k: k[1])] == ["worker 0", "worker 1", "worker 0 -> worker 1"]
    assert to_chrome_trace([])["traceEvents"] == []


@pytest.mark.slow
def test_trace_command_records_a_disagg_server(tmp_path):
    from tests.helpers import serving

    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "disagg",
                 "--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "shm") as server:  # fmt: skip
        for prompt in ([5, 17, 300, 42] * 4, [7, 8, 9] * 5):
            status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                           "ignore_eos": True})  # fmt: skip
            assert status == 200, body
        out = tmp_path / "trace.json"
        cmd = [sys.executable, "-m", "minipd", "trace", "--url", server.url, "--seconds", "2", "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert str(out) in done.stdout and "slices" in done.stdout
    trace = json.loads(out.read_text())
    steps = [x for x in by_ph(trace, "X") if x["cat"] == "step"]
    assert {track_of(trace, x) for x in steps} == {"workers/worker 0", "workers/worker 1"}
    kv = [x for x in by_ph(trace, "X") if x["cat"] == "kv"]
    assert len(kv) == 2 and {track_of(trace, x) for x in kv} == {"links/worker 0 -> worker 1"}
    assert all(x["dur"] >= 0 and x["args"]["end_seen"] for x in kv)
    assert trace["otherData"]["flows"] == 2
