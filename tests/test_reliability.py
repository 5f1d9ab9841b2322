"""The process fabric under faults, on real worker processes and the tiny model: killed and hung
workers, failing steps, lost messages, aborts inside a copy, disconnects, deadlines, shutdown."""

import asyncio
import glob
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import serving, stream_completions, wait_for_health, wait_for_idle_workers

pytestmark = pytest.mark.slow
TINY = ("--model", "tiny-random", "--threads-per-worker", "1")
PROMPTS = [[20 + i, 31, 400 + i] * (i + 2) for i in range(8)]


def completion(server, prompt, **kw):
    return server.post("/v1/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True, **kw})


@pytest.mark.parametrize("mode,transport,victim", [
    ("disagg", "shm", "prefill"), ("disagg", "shm", "decode"),
    ("disagg", "tcp", "prefill"), ("disagg", "tcp", "decode"),
    ("colocated", "shm", 0),
])  # fmt: skip
@pytest.mark.asyncio
async def test_a_worker_killed_mid_stream_is_replaced_and_its_requests_redone(mode, transport, victim):
    with serving(*TINY, "--workers", "2", "--mode", mode, "--kv-transport", transport,
                 env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:  # fmt: skip
        want = await stream_completions(s.url, PROMPTS, 40)
        assert all(r["error"] is None for r in want)
        pid = s.worker_pid(victim)
        seen = [0]
        kill_at = 1 if victim == "prefill" else 60

        def on_token(i):
            seen[0] += 1
            if seen[0] == kill_at:
                os.kill(pid, signal.SIGKILL)

        started = time.monotonic()
        got = await asyncio.wait_for(stream_completions(s.url, PROMPTS, 40, on_token), 60)
        assert time.monotonic() - started < 30
        for g, w in zip(got, want):
            assert g["error"] is None, g["error"]  # a replacement comes: every request is redone
            assert g["text"] == w["text"]
        wait_for_health(s, "ok", timeout=30)
        assert s.worker_pid(victim) != pid
        assert completion(s, [1, 2, 3], max_tokens=3)[0] == 200
        wait_for_idle_workers(s, timeout=10)
        redone = [s.get(f"/v1/requests/{g['id']}/timeline")[1]["redos"] for g in got]
        if victim != "prefill":
            assert any(redone), "the killed worker held requests; some must have been redone"
        assert all("died" in r["cause"] for rs in redone for r in rs)


@pytest.mark.asyncio
async def test_a_request_that_cannot_be_redone_ends_with_an_error_event():
    with serving(*TINY, "--workers", "1", "--max-worker-restarts", "0", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        pid = s.worker_pid(0)
        seen = [0]

        def on_token(i):
            seen[0] += 1
            if seen[0] == 5:
                os.kill(pid, signal.SIGKILL)

        got = await asyncio.wait_for(stream_completions(s.url, PROMPTS[:2], 200, on_token), 30)
        assert all("no worker is alive" in g["error"] and "SIGKILL" in g["error"] for g in got)
        status, body = s.get("/health")
        assert status == 503 and body["dead_workers"] == [0]
        status, err = completion(s, [1, 2], max_tokens=2)
        assert status == 503 and "died" in err["error"]["message"]


@pytest.mark.asyncio
async def test_a_hung_worker_is_killed_and_replaced():
    with serving(*TINY, "--workers", "2", "--worker-timeout", "2", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        pid = s.worker_pid(1)
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
        got = await asyncio.wait_for(stream_completions(s.url, PROMPTS[:4], 30), 30)
        assert all(g["error"] is None for g in got)
        wait_for_health(s, "ok", timeout=30)
        assert s.worker_pid(1) != pid
        assert "SIGKILL" in s.get("/admin/workers")[1]["workers"][1]["exit_cause"]


def test_a_mode_switch_is_refused_at_once_while_a_worker_is_stopped_and_works_once_it_is_back():
    """Defect (a hostile-client helper): with a worker stopped by SIGSTOP, POST /admin/mode waited
    for it until --worker-timeout replaced it (a minute), new requests held at the door meanwhile; and
    half the new requests were placed on the stopped worker, to wait for its replacement too."""
    with serving(*TINY, "--workers", "2") as s:
        pid = s.worker_pid(1)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for_health(s, "degraded", timeout=15)
            started = time.monotonic()
            status, err = s.post("/admin/mode", {"mode": "disagg"})
            assert status == 503 and "worker 1 has shown no sign of life" in err["error"]["message"], err
            assert time.monotonic() - started < 3
            assert s.get("/admin/mode")[1]["mode"] == "colocated"
            for _ in range(4):  # new requests go to the worker that answers, not to wait for a replacement
                started = time.monotonic()
                status, body = completion(s, [1, 2], max_tokens=2)
                assert status == 200 and time.monotonic() - started < 5, body
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for_health(s, "ok", timeout=15)
        assert s.post("/admin/mode", {"mode": "disagg"})[0] == 200
        assert s.worker_pid(1) == pid


def test_a_step_longer_than_the_worker_timeout_is_not_taken_for_a_hang():
    """Defect: a worker said nothing while it stepped, so a long prompt on a slow CPU (5,000 tokens
    on one thread with --worker-timeout 3) got its worker killed, four times, and a 500."""
    with serving(*TINY, "--workers", "1", "--worker-timeout", "1", env={"MINIPD_FAULTS": "slow_step_s=2.5"}) as s:
        pid = s.worker_pid(0)
        status, body = completion(s, [1, 2, 3], max_tokens=2)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        worker = s.get("/admin/workers")[1]["workers"][0]
        assert worker["pid"] == pid and worker["restarts"] == 0


def test_a_step_past_the_step_timeout_is_a_hang_inside_the_model():
    with serving(*TINY, "--workers", "1", "--worker-timeout", "1", "--step-timeout", "2", "--max-worker-restarts", "1",
                 env={"MINIPD_FAULTS": "slow_step_s=4"}) as s:  # fmt: skip
        pid = s.worker_pid(0)
        status, err = completion(s, [1, 2, 3], max_tokens=2)
        # its one worker hung twice and is left dead: the server has no worker, a 503 naming why
        assert status == 503 and err["error"]["code"] == "no_worker", err
        assert err["error"]["message"].startswith("no worker is alive") and "--step-timeout" in err["error"]["message"]
        worker = s.get("/admin/workers")[1]["workers"][0]
        assert worker["pid"] != pid or worker["state"] != "up"


def test_a_loop_stuck_outside_a_step_is_killed_although_its_heartbeat_goes_on():
    with serving(*TINY, "--workers", "2", "--worker-timeout", "2", "--max-worker-restarts", "1",
                 env={"MINIPD_FAULTS": "hang_on_token=777"}) as s:  # fmt: skip
        pids = [s.worker_pid(0), s.worker_pid(1)]
        started = time.monotonic()
        status, err = completion(s, [777, 1, 2], max_tokens=3)
        assert status == 500 and "stuck outside a step" in err["error"]["message"], err
        assert err["error"]["code"] == "too_many_redos"  # a fault: every attempt lost its worker
        assert time.monotonic() - started < 30
        assert completion(s, [1, 2, 3], max_tokens=3)[0] in (200, 503)  # a worker may still be restarting
        workers = s.get("/admin/workers")[1]["workers"]
        assert any(w["pid"] not in pids for w in workers) or any(w["state"] != "up" for w in workers)


def test_switching_mode_with_a_handoff_in_flight_neither_kills_nor_hangs():
    """Defect: after a request ended, its prefill worker could still be sending its KV; SetMode then
    made the worker's set_role raise, the worker died and every later request waited forever."""
    with serving(*TINY, "--workers", "2", "--mode", "disagg", "--kv-transport", "tcp", "--kv-link-latency-ms",
                 "1500") as s:  # fmt: skip
        pids = [s.worker_pid(0), s.worker_pid(1)]
        # a stop string that the first token meets ends the request while its KV is on the (slow) link
        status, _ = completion(s, [5, 6, 7, 8], max_tokens=20, stop=[" "], ignore_eos=False)
        started = time.monotonic()
        status, body = s.post("/admin/mode", {"mode": "colocated"})
        assert status == 200 and body["mode"] == "colocated" and body["switch"]["changed"]
        assert time.monotonic() - started < 15
        assert completion(s, [1, 2, 3], max_tokens=4)[0] == 200
        assert [s.worker_pid(0), s.worker_pid(1)] == pids  # nobody died
        wait_for_idle_workers(s, timeout=10)


@pytest.mark.asyncio
async def test_a_failing_step_ends_only_its_requests():
    with serving(*TINY, "--workers", "1", env={"MINIPD_FAULTS": "fail_step_on_token=4242"}) as s:
        pid = s.worker_pid(0)
        got = await stream_completions(s.url, [[4242, 1, 2], [7, 8, 9]], 20)
        # the two ran in one step: both end with the step's error, the worker lives on
        assert all("engine step failed" in g["error"] for g in got if g["error"]) and got[0]["error"]
        assert completion(s, [7, 8, 9], max_tokens=5)[0] == 200
        assert s.worker_pid(0) == pid and s.get("/health")[1]["status"] == "ok"
        wait_for_idle_workers(s, timeout=10)


def test_the_message_pump_survives_a_message_it_cannot_handle():
    """Defect: one exception in the router's message handling stopped every delivery while
    /health said ok."""
    with serving(*TINY, "--workers", "1", env={"MINIPD_FAULTS": "bad_stats_on_token=999"}) as s:
        assert completion(s, [999, 1], max_tokens=3)[0] == 200
        assert completion(s, [5, 6], max_tokens=3)[0] == 200
        assert s.get("/health")[1]["status"] == "ok"
        assert "handling a WorkerStats" in s.output()


@pytest.mark.asyncio
async def test_an_abort_inside_an_in_place_copy_keeps_the_seat_until_the_copy_is_done():
    """Defect: the decode worker freed a seat on abort while the prefill worker was still copying
    the KV into those blocks (shm), so another request could be given blocks being overwritten."""
    with serving(*TINY, "--workers", "2", "--mode", "disagg", env={"MINIPD_FAULTS": "slow_kv_copy_s=1.0"}) as s:
        since = time.time()

        async def abort_during_copy():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                body = {"prompt": [5] * 40, "max_tokens": 10, "temperature": 0, "stream": True}
                async with session.post(s.url + "/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            await asyncio.sleep(0.3)  # the first token is out: the copy runs for 1 s
                            return  # the client goes away

        await abort_during_copy()
        # off the loop: whatever the disconnect left for the loop to do runs while the server is watched
        await asyncio.to_thread(wait_for_idle_workers, s, timeout=10)
        events = events_since(s, since)
        sent = [e for e in events if e.get("kind") == "kv_copied"]
        released = [e for e in events if e.get("kind") == "seat_released"]
        assert len(sent) == 1 and len(released) == 1, events
        assert released[0]["time"] >= sent[0]["time"]  # the seat went back only after the writer was done


def events_since(server, since: float) -> list[dict]:
    """What /admin/events has kept since `since` (read until it has replayed it all)."""
    import json

    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"GET /admin/events?since={since} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
    sock.settimeout(1.0)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        pass
    finally:
        sock.close()
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def test_a_seat_whose_prefill_never_arrives_is_released():
    with serving(*TINY, "--workers", "2", "--mode", "disagg", "--seat-timeout", "1",
                 env={"MINIPD_FAULTS": "ignore_request_on_token=777"}) as s:  # fmt: skip
        started = time.monotonic()
        status, err = completion(s, [777, 1, 2], max_tokens=3)
        assert status == 503 and "no KV arrived in its seat within 1 s" in err["error"]["message"]
        assert time.monotonic() - started < 5
        wait_for_idle_workers(s, timeout=5)
        assert completion(s, [1, 2, 3], max_tokens=3)[0] == 200


@pytest.mark.asyncio
async def test_seats_are_granted_in_batches():
    with serving(*TINY, "--workers", "2", "--mode", "disagg", env={"MINIPD_FAULTS": "slow_step_s=0.02"}) as s:
        got = await stream_completions(s.url, [[7, i] for i in range(24)], 10)
        assert all(g["error"] is None for g in got)
        seats = s.get("/admin/workers")[1]["seats"]
        assert seats["granted"] == 24 and seats["batches_sent"] < 24, seats


@pytest.mark.asyncio
async def test_a_non_streaming_client_that_goes_away_frees_everything_and_logs_no_error():
    """Defect: a non-streaming request never noticed its client had gone and ran to the end;
    a normal disconnect was logged as an ERROR with a traceback."""
    with serving(*TINY, "--workers", "2", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = b'{"prompt": [5, 6], "max_tokens": 3000, "temperature": 0, "ignore_eos": true}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 10
        while sum(w["inflight"] for w in s.get("/admin/workers")[1]["workers"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(w["inflight"] for w in s.get("/admin/workers")[1]["workers"]) == 1  # it runs
        sock.close()
        wait_for_idle_workers(s, timeout=5)  # 3000 steps of 10 ms would take 30 s
        await abandon_a_stream(s)
        await asyncio.to_thread(wait_for_idle_workers, s, timeout=5)  # the loop finishes the disconnect meanwhile
        log = s.output()
        assert "Traceback" not in log and " ERROR " not in log, log


async def abandon_a_stream(s):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {"prompt": [5, 6], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        async with session.post(s.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()


def test_max_tokens_is_bounded_and_checked_against_the_context():
    with serving(*TINY, "--workers", "1", "--default-max-tokens", "7", "--kv-cache-tokens", "512") as s:
        status, body = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert status == 200 and body["usage"]["completion_tokens"] == 7
        status, err = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_completion_tokens": 600})  # fmt: skip
        assert status == 400 and err["error"]["param"] == "max_completion_tokens"
        assert "maximum context length is 512 tokens" in err["error"]["message"]
        status, err = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": -1})
        assert status == 400 and "None" not in err["error"]["message"] and err["error"]["param"] == "max_tokens"


@pytest.mark.asyncio
async def test_disaggregated_decode_does_not_preempt_at_the_configured_load():
    """Defect: a seat held only prompt + 1 tokens, so a full decode worker preempted its requests
    and re-prefilled them itself, bringing back the stall. Seats now book the reply's growth."""
    with serving(*TINY, "--workers", "2", "--mode", "disagg", "--kv-cache-tokens", "256", "--block-size", "16",
                 env={"MINIPD_FAULTS": "slow_step_s=0.005"}) as s:  # fmt: skip
        got = await stream_completions(s.url, [[9, i] * 10 for i in range(6)], 60)
        assert all(g["error"] is None for g in got)
        workers = wait_for_idle_workers(s, timeout=10)
        assert [w["preemptions"] for w in workers] == [0, 0]


def test_a_request_past_its_deadline_ends_with_an_error_and_frees_its_blocks():
    with serving(*TINY, "--workers", "1", "--request-timeout", "1", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        status, err = completion(s, [5, 6], max_tokens=2000)
        assert status == 503 and "did not finish within 1 s" in err["error"]["message"]
        wait_for_idle_workers(s, timeout=5)


@pytest.mark.asyncio
async def test_sigterm_lets_running_requests_finish_and_leaves_nothing_behind():
    with serving(*TINY, "--workers", "2", "--mode", "disagg", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        s.children_seen()
        task = asyncio.ensure_future(stream_completions(s.url, PROMPTS[:3], 100))
        await asyncio.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        status, err = await asyncio.to_thread(completion, s, [1], max_tokens=2)  # the streams go on meanwhile
        got = await task
        assert all(g["error"] is None and g["text"] for g in got)
        assert status == 503 and "shutting down" in err["error"]["message"]
        assert s.proc.wait(15) == 0


def test_the_main_process_never_loads_torch():
    with serving(*TINY, "--workers", "1") as s:
        assert completion(s, [1, 2], max_tokens=2)[0] == 200
        with open(f"/proc/{s.proc.pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps and "libtorch" in open(f"/proc/{s.worker_pid(0)}/maps").read()


def test_tcp_keeps_the_kv_caches_out_of_shared_memory():
    with serving(*TINY, "--workers", "2", "--mode", "disagg", "--kv-transport", "tcp") as s:
        assert completion(s, [1, 2, 3], max_tokens=2)[0] == 200
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"minipd_{s.proc.pid}-")]


def test_too_little_shared_memory_is_one_line_at_start():
    out = subprocess.run([sys.executable, "-m", "minipd", "serve", *TINY, "--kv-cache-tokens", str(10**9),
                          "--port", "0"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "/dev/shm" in out.stderr and "--kv-transport tcp" in out.stderr


@pytest.mark.asyncio
async def test_ctrl_c_in_the_terminal_drains_instead_of_killing_the_workers():
    """Defect: a terminal's Ctrl-C reaches the whole process group; the workers died of it, and
    the supervisor restarted them and redid every request instead of letting them finish."""
    with serving(*TINY, "--workers", "2", env={"MINIPD_FAULTS": "slow_step_s=0.01"}) as s:
        s.children_seen()
        task = asyncio.ensure_future(stream_completions(s.url, PROMPTS[:3], 100))
        await asyncio.sleep(0.5)
        os.killpg(s.proc.pid, signal.SIGINT)  # what a terminal does
        got = await task
        assert all(g["error"] is None and g["text"] for g in got)
        assert s.proc.wait(15) == 0
        log = s.output()
        assert "died" not in log and "restarting" not in log and "redoing" not in log, log


def test_two_servers_side_by_side_and_one_killed_hard():
    """Defect: segment names came from the main pid, so servers sharing /dev/shm (containers, all
    pid 1) failed to start after a hard kill and deleted each other's segments."""
    with serving(*TINY, "--workers", "2") as survivor, serving(*TINY, "--workers", "2") as victim:
        theirs = glob.glob(f"/dev/shm/minipd_{victim.proc.pid}-*_cache*")
        assert len(theirs) == 2 and len(glob.glob(f"/dev/shm/minipd_{survivor.proc.pid}-*_cache*")) == 2
        victim.children_seen()
        os.killpg(victim.proc.pid, signal.SIGKILL)  # main process and workers, no clean-up at all
        victim.proc.wait()
        for pid in victim.worker_pids:
            wait_gone(pid)
        assert all(os.path.exists(p) for p in theirs)  # a hard kill leaves them...
        assert completion(survivor, [1, 2, 3], max_tokens=3)[0] == 200
        with serving(*TINY, "--workers", "1") as third:  # ...and the next start removes them
            assert not any(os.path.exists(p) for p in theirs)
            assert "left by servers that were killed" in third.output()
            assert completion(survivor, [1, 2, 3], max_tokens=3)[0] == 200
        assert len(glob.glob(f"/dev/shm/minipd_{survivor.proc.pid}-*_cache*")) == 2


def test_a_worker_slow_to_start_writes_its_stacks_to_the_log_and_the_server_waits_for_it():
    """Defect: once, in CI, a server's workers never became ready and nothing said what they were
    waiting on. A worker not ready after --worker-timeout now dumps its threads (faulthandler)."""
    with serving(*TINY, "--workers", "1", "--worker-timeout", "2",
                 env={"MINIPD_FAULTS": "hang_at_start_s=6"}) as s:  # fmt: skip
        out = s.output()
        assert "[0] not ready after 2 s" in out
        assert "hread 0x" in out and "launch.py" in out and "in run_worker" in out  # where it was then
        assert completion(s, [1, 2, 3], max_tokens=3)[0] == 200


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_workers_start_stops_the_server_at_once(sig, tmp_path):
    """Defect: Ctrl-C (even twice) while the workers loaded did nothing until they were ready; a
    start that hangs waited its 300 s. Now the first signal stops the workers and the server."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "minipd", "serve", *TINY, "--workers", "2", "--port",
                             str(port.getsockname()[1])], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MINIPD_FAULTS": "hang_at_start_s=120"})  # fmt: skip
    port.close()
    try:
        deadline = time.monotonic() + 120
        while "test faults active" not in open(tmp_path / "server.log").read():  # the workers are spawned
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "server.log").read()
            time.sleep(0.2)
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        proc.send_signal(sig)
        proc.wait(timeout=8)  # not the 5 s grace and 2 x 2 s joins a ready worker may take (9 s before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = open(tmp_path / "server.log").read()
    assert "minipd: ready" not in out, out
    for pid in children:
        wait_gone(pid)
    assert glob.glob(f"/dev/shm/minipd_{proc.pid}-*") == []


def wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


def test_restarts_an_operator_asks_for_do_not_use_up_the_crash_budget():
    """Defect: each `drain {"restart": true}` counted as a crash, so the (N+1)th requested restart
    within the window left the worker dead for good and /health unhealthy."""
    with serving(*TINY, "--workers", "2", "--max-worker-restarts", "1") as s:
        for _ in range(3):
            incarnation = s.get("/admin/workers")[1]["workers"][1]["incarnation"]
            status, outcome = s.post("/admin/workers/1/drain", {"restart": True})
            assert status == 200 and outcome["stopped"], outcome
            deadline = time.monotonic() + 60
            while True:
                w = s.get("/admin/workers")[1]["workers"][1]
                if w["state"] == "up" and w["incarnation"] > incarnation:
                    break
                assert w["state"] != "dead" and time.monotonic() < deadline, w
                time.sleep(0.2)
        assert s.get("/health")[0] == 200
        # /admin/workers counted none of them (defect) while minipd:worker_restarts counted them all
        assert w["restarts"] == 3 and 'minipd:worker_restarts_total{model_name="tiny-random",worker="1"} 3.0' in s.get("/metrics")[1]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_a_command_started_ends_when_the_command_is_killed(tmp_path, how):
    """Defect (a new-user helper): `demo` stopped by SIGTERM (`timeout 90 python -m minipd demo ...`) left
    the server it had started running, with its workers and shared memory: that server has a session of
    its own, and nothing stopped it once its parent was gone."""
    starter = tmp_path / "starter.py"
    starter.write_text("import time\nfrom minipd.bench.server_process import ServerProcess\n"
                       f"s = ServerProcess({', '.join(map(repr, TINY))}, '--workers', '1')\n"
                       "print(s.proc.pid, *s.worker_pids, flush=True)\ntime.sleep(600)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(starter)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2, pids
        proc.send_signal(how)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while any(map(_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_running, pids)), pids
        assert glob.glob(f"/dev/shm/minipd_{pids[0]}-*") == []
    finally:
        proc.kill()
        proc.wait()
        for pid in pids if "pids" in locals() else []:  # what the defect left: not for the next test to meet
            if _running(pid):
                os.kill(pid, signal.SIGTERM)
