"""The live switch on a real server (main process + 2 worker processes, tiny model): replies that
stream while the mode changes move to a worker that can decode them, at a token boundary, and
their text is the text of a run that never switched, greedy and seeded, in every transport. A move
that fails on the way (KV lost on the wire, a worker killed) is redone, and nothing is left."""

import asyncio
import os
import signal
import time

import pytest

from tests.helpers import serving, stream_completions, wait_for_idle_workers

pytestmark = pytest.mark.slow
TINY = ("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1")
PROMPTS = [[5 + i, 17, 29, 41 + i] * (3 + 2 * i) for i in range(8)]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 99}
MAX_TOKENS = 250
LONG_REPLY = 1500  # long enough that seats 0.5 s late cannot outlast it


async def streams_with_a_switch(server, body: dict, after_tokens: int = 8, prompts=PROMPTS, **extra):
    """Stream every prompt (greedy, and the first four seeded as well); once each stream has
    `after_tokens` tokens, switch with `body`. Returns (greedy results, seeded results, switch answer)."""
    seeded = prompts[:4]
    counts = [0] * (len(prompts) + len(seeded))
    ready = asyncio.Event()

    def on_token(offset):
        def count(i):
            counts[offset + i] += 1
            if min(counts) >= after_tokens:
                ready.set()

        return count

    async def switch():
        await asyncio.wait_for(ready.wait(), 60)
        return await asyncio.get_running_loop().run_in_executor(None, server.post, "/admin/mode", body)

    greedy, seeded, answer = await asyncio.gather(
        stream_completions(server.url, prompts, MAX_TOKENS, on_token(0), **extra),
        stream_completions(server.url, seeded, MAX_TOKENS, on_token(len(prompts)), **SEEDED, **extra),
        switch(),
    )
    return greedy, seeded, answer


def texts(results):
    """Each reply's text and token ids (the ids alone tell replies apart where there is no tokenizer)."""
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return [(r["text"], r["token_ids"]) for r in results]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_switches_under_live_traffic_move_replies_without_changing_a_token(transport):
    with serving(*TINY, "--kv-transport", transport) as server:

        async def reference():
            return (texts(await stream_completions(server.url, PROMPTS, MAX_TOKENS)),
                    texts(await stream_completions(server.url, PROMPTS[:4], MAX_TOKENS, **SEEDED)))  # fmt: skip

        want_greedy, want_seeded = asyncio.run(reference())
        for body, must_move in (
            ({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, True),  # worker 0's replies leave it
            ({"mode": "colocated"}, False),  # every reply's worker can still decode: nothing moves
            ({"mode": "chunked", "chunk_tokens": 64, "workers": 1}, True),  # worker 1 goes idle
            ({"mode": "colocated", "workers": 2}, False),
        ):
            greedy, seeded, (status, answer) = asyncio.run(streams_with_a_switch(server, body))
            assert status == 200, answer
            switch = answer["switch"]
            assert switch["changed"] and switch["not_moved"] == 0, switch
            assert (switch["moved"] > 0) == must_move, switch
            if must_move:
                assert switch["bytes"] > 0 and switch["serving_after_seconds"] < 1.0, switch
            assert texts(greedy) == want_greedy, body
            assert texts(seeded) == want_seeded, body
            assert server.get("/admin/mode")[1]["last_switch"] == switch
            if must_move:
                moved = [t for r in greedy
                         if (t := server.get(f"/v1/requests/{r['id']}/timeline")[1])["moves"]]  # fmt: skip
                assert moved and all(m["outcome"] == "moved" for t in moved for m in t["moves"])
                assert all(m["tokens"] > len(PROMPTS[0]) for t in moved for m in t["moves"])  # prompt and reply so far
            wait_for_idle_workers(server, 20)
        same = server.post("/admin/mode", {"mode": "colocated", "workers": 2})[1]["switch"]
        assert same["changed"] is False and "nothing changed" in same["note"]


def test_on_the_default_model_replies_moved_by_live_switches_keep_every_token():
    """The same as above with real weights (its logits are peaked, tiny-random's nearly flat): 250
    greedy and seeded tokens per reply, a switch that moves half the replies, then one that moves
    them all onto one worker; every reply equals the server's run that never switched."""
    with serving("--workers", "2", "--threads-per-worker", "1") as server:

        async def reference():
            return (texts(await stream_completions(server.url, PROMPTS, MAX_TOKENS)),
                    texts(await stream_completions(server.url, PROMPTS[:4], MAX_TOKENS, **SEEDED)))  # fmt: skip

        want_greedy, want_seeded = asyncio.run(reference())
        for body in ({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1},
                     {"mode": "chunked", "chunk_tokens": 32, "workers": 1}):  # fmt: skip
            greedy, seeded, (status, answer) = asyncio.run(streams_with_a_switch(server, body))
            assert status == 200 and answer["switch"]["moved"] > 0 and answer["switch"]["not_moved"] == 0, answer
            assert texts(greedy) == want_greedy, body
            assert texts(seeded) == want_seeded, body
            wait_for_idle_workers(server, 20)
            server.post("/admin/mode", {"mode": "colocated", "workers": 2})


def test_a_move_whose_kv_is_lost_on_the_wire_is_redone_and_the_text_is_unchanged():
    env = {**os.environ, "MINIPD_FAULTS": "drop_kv_part_on_token=4,kv_faults_first_attempt=1"}
    prompts = [[4, 9, 12, 15] * 6, [4, 7, 12, 15] * 6]  # a move of either loses a part of its KV
    with serving(*TINY, "--kv-transport", "tcp", env=env) as server:
        want = texts(asyncio.run(stream_completions(server.url, prompts, MAX_TOKENS)))
        wait_for_idle_workers(server, 20)  # the reference's replies released before the placement below
        greedy, seeded, (status, answer) = asyncio.run(streams_with_a_switch(
            server, {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, prompts=prompts))  # fmt: skip
        assert status == 200 and answer["switch"]["moved"] + answer["switch"]["not_moved"] > 0, answer
        assert texts(greedy) == want
        # the replies on worker 0 move, greedy or seeded: which of the four were placed there is a race
        # between the two clients (CI failed once with no greedy reply moved; the cause is not settled)
        timelines = [server.get(f"/v1/requests/{r['id']}/timeline")[1] for r in greedy + seeded]
        hit = [t for t in timelines if any(m["outcome"] == "failed" for m in t["moves"])]
        assert hit and all(t["redos"] and "move failed" in t["redos"][0]["cause"] for t in hit), timelines
        wait_for_idle_workers(server, 20)


def test_a_worker_killed_during_a_move_costs_no_reply():
    """The target dies while the KV is on the (slow, emulated) link: the request is redone from its
    prompt and the tokens sent; the client sees the same text."""
    with serving(*TINY, "--kv-transport", "tcp", "--kv-link-gbps", "0.0002") as server:
        prompts = PROMPTS[:2]
        want = texts(asyncio.run(stream_completions(server.url, prompts, MAX_TOKENS)))
        decode_pid = server.get("/admin/workers")[1]["workers"][1]["pid"]

        async def kill_when_moving():
            while True:
                workers = server.get("/admin/workers")[1]["workers"]
                if any(k.startswith("in:") for k in workers[1]["handoffs"]):
                    os.kill(decode_pid, signal.SIGKILL)
                    return
                await asyncio.sleep(0.01)

        async def go():
            run = asyncio.ensure_future(streams_with_a_switch(
                server, {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, prompts=prompts))  # fmt: skip
            await asyncio.wait_for(kill_when_moving(), 60)
            return await run

        greedy, _, (status, answer) = asyncio.run(go())
        assert texts(greedy) == want
        assert status == 200 and answer["switch"]["not_moved"] >= 1, answer
        time.sleep(0.5)
        wait_for_idle_workers(server, 60)


def _pid_and_incarnation(server, worker_id):
    w = server.get("/admin/workers")[1]["workers"][worker_id]
    return w["pid"], w["incarnation"]


def _wait_back(server, worker_id, incarnation, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        w = server.get("/admin/workers")[1]["workers"][worker_id]
        if w["state"] == "up" and w["incarnation"] > incarnation:
            return w
        assert time.monotonic() < deadline, w
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["drain_endpoint", "sigterm"])
def test_a_worker_restarted_for_a_new_setting_costs_nobody_their_reply(how):
    """`POST /admin/workers/1/drain {"restart": true}`, or SIGTERM to worker 1 alone: its running
    replies move to worker 0 and go on token for token; then it stops and starts again."""
    # replies long enough to be running when the signal lands: with a decode batch in one call the
    # tiny model's 250 tokens could end within the 0.2 s below (a CI failure: nothing to move)
    long = 4 * MAX_TOKENS
    with serving(*TINY) as server:
        want = texts(asyncio.run(stream_completions(server.url, PROMPTS, long)))
        pid, incarnation = _pid_and_incarnation(server, 1)

        async def go():
            started = asyncio.Event()
            run = asyncio.ensure_future(stream_completions(server.url, PROMPTS, long, lambda i: started.set()))
            await started.wait()
            await asyncio.sleep(0.2)
            if how == "sigterm":
                os.kill(pid, signal.SIGTERM)
                answer = None
            else:
                answer = await asyncio.get_running_loop().run_in_executor(
                    None, server.post, "/admin/workers/1/drain", {"restart": True})  # fmt: skip
            return await run, answer

        results, answer = asyncio.run(go())
        assert texts(results) == want
        if answer is not None:
            status, outcome = answer
            assert status == 200 and outcome["moved"] > 0 and outcome["left"] == 0 and outcome["stopped"], outcome
        timelines = [server.get(f"/v1/requests/{r['id']}/timeline")[1] for r in results]
        drained = [[mv for mv in t["moves"] if mv["reason"] == "drain"] for t in timelines]
        assert any(drained) and all(mv["source"] == 1 for moves in drained for mv in moves)
        # each drained reply's last move took it; one that outgrew its seat on the way (a slow moment on a
        # shared machine: more than SLACK_TOKENS tokens while its seat was sought) is refused and asked again
        for moves in filter(None, drained):
            assert moves[-1]["outcome"] == "moved", moves
            assert all(mv["outcome"] == "refused" and "outgrew its seat" in mv["detail"] for mv in moves[:-1]), moves
        assert not any(t["redos"] for t in timelines), "a reply was redone instead of moved"
        back = _wait_back(server, 1, incarnation)
        assert not back["draining"] and "stopped on request" in back["exit_cause"]
        wait_for_idle_workers(server, 20)


def test_a_drained_worker_gets_no_new_request_until_it_is_resumed():
    with serving(*TINY) as server:
        status, outcome = server.post("/admin/workers/1/drain", {})
        assert status == 200 and outcome["moved"] == 0 and not outcome["stopped"]
        assert server.get("/admin/workers")[1]["workers"][1]["draining"]
        results = asyncio.run(stream_completions(server.url, PROMPTS[:4], 8))
        assert all(server.get(f"/v1/requests/{r['id']}/timeline")[1]["decode_worker"] == 0 for r in results)
        assert server.post("/admin/workers/1/resume", {})[0] == 200
        results = asyncio.run(stream_completions(server.url, PROMPTS[:4], 8))
        assert {server.get(f"/v1/requests/{r['id']}/timeline")[1]["decode_worker"] for r in results} == {0, 1}
        assert server.post("/admin/workers/7/drain", {})[0] == 404
        assert server.post("/admin/workers/1/drain", {"restart": "yes"})[0] == 400


def test_per_request_disaggregation_prefills_short_prompts_on_the_decode_worker():
    short, long = [[3, 4, 5] * 3, [6, 7, 8] * 4], [[9, 10, 11] * 40, [12, 13, 14] * 50]
    with serving(*TINY, "--mode", "disagg", "--local-prefill-tokens", "64") as server:
        got = asyncio.run(stream_completions(server.url, short + long, 20))
        timelines = [server.get(f"/v1/requests/{r['id']}/timeline")[1] for r in got]
        assert [t["path"] for t in timelines] == ["local"] * 2 + ["remote"] * 2
        assert all(t["prefill_worker"] == t["decode_worker"] == 1 for t in timelines[:2])  # the decode worker's own
        assert all(t["kv_transfer"]["bytes"] == 0 for t in timelines[:2])
        assert all(t["prefill_worker"] == 0 and t["kv_transfer"]["bytes"] > 0 for t in timelines[2:])
        metrics = server.get("/metrics")[1]
        assert 'minipd:disagg_placements_total{model_name="tiny-random",path="local"} 2.0' in metrics
        assert 'minipd:disagg_placements_total{model_name="tiny-random",path="remote"} 2.0' in metrics
        status, body = server.post("/admin/mode", {"mode": "colocated"})
        assert status == 200
        assert texts(asyncio.run(stream_completions(server.url, short + long, 20))) == texts(got)
        assert server.post("/admin/mode", {"mode": "disagg", "local_prefill_tokens": -1})[0] == 400


def test_a_move_that_outlives_its_lease_is_redone_and_leaves_no_block():
    """The link to the target goes silent for longer than --kv-transfer-timeout during the move."""
    env = {**os.environ, "MINIPD_FAULTS": "kv_outage_on_token=4,kv_outage_s=2.5,kv_faults_first_attempt=1"}
    prompts = [[4, 9, 12, 15] * 6, [4, 7, 12, 15] * 6]
    with serving(*TINY, "--kv-transport", "tcp", "--kv-transfer-timeout", "1.5", env=env) as server:
        want = texts(asyncio.run(stream_completions(server.url, prompts, MAX_TOKENS)))
        wait_for_idle_workers(server, 20)  # the reference's replies released before the placement below
        greedy, seeded, (status, answer) = asyncio.run(streams_with_a_switch(
            server, {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, prompts=prompts))  # fmt: skip
        assert status == 200 and answer["switch"]["moved"] + answer["switch"]["not_moved"] > 0, answer
        assert texts(greedy) == want
        timelines = [server.get(f"/v1/requests/{r['id']}/timeline")[1] for r in greedy]
        causes = [x["cause"] for t in timelines for x in t["redos"]]
        assert any("within 1.5 s" in c for c in causes), causes  # the writer's lease or the router's, whichever ends first
        wait_for_idle_workers(server, 30)


def _crowd_then_resume(server, max_tokens: int = MAX_TOKENS) -> tuple[list[dict], list[dict]]:
    """Drain worker 1, stream PROMPTS (all on worker 0), resume worker 1 once each has 5 tokens."""
    assert server.post("/admin/workers/1/drain", {})[0] == 200

    async def go():
        counts = [0] * len(PROMPTS)
        ready = asyncio.Event()

        def count(i):
            counts[i] += 1
            if min(counts) >= 5:
                ready.set()

        run = asyncio.ensure_future(stream_completions(server.url, PROMPTS, max_tokens, count))
        await asyncio.wait_for(ready.wait(), 60)
        status, _ = await asyncio.get_running_loop().run_in_executor(None, server.post, "/admin/workers/1/resume", {})
        assert status == 200
        return await run

    results = asyncio.run(go())
    return results, [server.get(f"/v1/requests/{r['id']}/timeline")[1] for r in results]


def test_rebalancing_moves_replies_to_a_worker_that_came_back_empty():
    """Worker 1 is drained, so every reply starts on worker 0; it is resumed while they stream. With
    --rebalance-ratio the crowded worker hands half its replies (those with the most left to make)
    to the empty one at a token boundary, and every text is the one of a run that never moved."""
    with serving(*TINY, "--rebalance-ratio", "1.5", "--rebalance-interval", "0.1") as server:
        want = texts(asyncio.run(stream_completions(server.url, PROMPTS, MAX_TOKENS)))
        shown = server.get("/admin/mode")[1]["rebalance"]
        assert shown["ratio"] == 1.5 and shown["interval_s"] == 0.1
        rounds = shown["rounds"]  # replies ending unevenly may already have moved some
        results, timelines = _crowd_then_resume(server)
        assert texts(results) == want
        asked = [mv for t in timelines for mv in t["moves"] if mv["reason"] == "rebalance"]
        moved = [mv for mv in asked if mv["outcome"] == "moved"]
        assert len(moved) >= len(PROMPTS) // 2, asked  # at least the first round: half of them
        assert all(mv["source"] == 0 and mv["target"] == 1 for mv in moved), moved
        assert all(mv["outcome"] in ("moved", "ended") for mv in asked), asked  # "ended": before its seat came
        assert all(sum(mv["reason"] == "rebalance" for mv in t["moves"]) <= 1 for t in timelines)  # once at most
        assert not any(t["redos"] for t in timelines), "a reply was redone instead of moved"
        assert server.get("/admin/mode")[1]["rebalance"]["rounds"] >= rounds + 1
        wait_for_idle_workers(server, 20)


def test_a_reply_that_outgrew_its_seat_while_the_seat_came_is_moved_with_a_bigger_one():
    """Defect (CI, a loaded machine): the seat of a rebalancing move came so late that the reply had
    made more than the seat's slack of tokens meanwhile; the source refused the move and the reply
    stayed on the crowded worker. Seats now come 0.5 s late (a reply makes far more than the slack
    meanwhile): the move is asked again with a seat sized by how much the reply grew, and moves."""
    env = {**os.environ, "MINIPD_FAULTS": "slow_seat_s=0.5"}
    with serving(*TINY, "--rebalance-ratio", "1.5", "--rebalance-interval", "0.1", env=env) as server:
        want = texts(asyncio.run(stream_completions(server.url, PROMPTS, LONG_REPLY)))
        results, timelines = _crowd_then_resume(server, LONG_REPLY)
        assert texts(results) == want
        asked = [mv for t in timelines for mv in t["moves"] if mv["reason"] == "rebalance"]
        moved = [mv for mv in asked if mv["outcome"] == "moved"]
        assert len(moved) >= len(PROMPTS) // 2, asked
        # a later round may pick a reply that then ends before its seat comes 0.5 s later: "ended"
        assert all(mv["outcome"] in ("moved", "ended") for mv in asked), asked
        assert any(mv["attempts"] > 1 for mv in moved), moved  # the fault did make a seat too small
        assert not any(t["redos"] for t in timelines)
        wait_for_idle_workers(server, 20)


def test_without_rebalancing_a_worker_that_came_back_stays_empty_until_new_requests():
    with serving(*TINY) as server:
        assert "rebalance" not in server.get("/admin/mode")[1]
        results, timelines = _crowd_then_resume(server)
        texts(results)
        assert all(not t["moves"] and t["decode_worker"] == 0 for t in timelines)


def test_a_prompt_half_read_when_its_worker_turns_to_decode_is_read_on_in_chunks():
    """Defect (found by a helper on the default model): switching chunked -> disagg while a
    1,777-token prompt was half read made the new decode worker read the other 1,399 tokens in one
    7.3 s step; its replies stalled that long, and the switch answered only after it."""
    from tests.test_reliability import events_since

    with serving(*TINY, "--mode", "chunked", "--chunk-tokens", "16", env={"MINIPD_FAULTS": "slow_step_s=0.02"}) as server:
        prompts = [[7 + i, 11, 13, 17] * 300 for i in range(2)]  # one per worker, 75 chunks of 16 each
        switched = []

        async def run():
            async def switch():
                await asyncio.sleep(0.5)
                answer = await asyncio.get_running_loop().run_in_executor(None, server.post, "/admin/mode", {"mode": "disagg"})
                switched.append(time.time())
                return answer

            return await asyncio.gather(stream_completions(server.url, prompts, 8), switch())

        started = time.time()
        results, (status, answer) = asyncio.run(run())
        assert status == 200, answer
        texts(results)
        steps = [e for e in events_since(server, started) if e["type"] == "step" and e["worker"] == 1]
        after = [e for e in steps if e["time"] >= switched[0]]
        assert after and max(e["prefill_tokens"] for e in steps) <= 16, [e["prefill_tokens"] for e in after]
