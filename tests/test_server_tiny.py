"""The real server (main process + worker processes) on the tiny random model."""

import asyncio
import glob
import json
import os
import re
import signal
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minipd.bench.server_process import ServerProcess, http
from minipd.models.loader import tiny_random_config
from tests.helpers import serving, wait_for_idle_workers

pytestmark = pytest.mark.slow
TINY_KV_BYTES_PER_TOKEN = tiny_random_config().kv_bytes_per_token(4)


@pytest.fixture(scope="module")
def server():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1") as s:
        yield s


def completion(server, prompt, **kw):
    status, body = server.post("/v1/completions", {"prompt": prompt, "temperature": 0, **kw})
    assert status == 200, body
    return body


def test_models_and_health(server):
    status, body = server.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny-random" and body["data"][0]["root"] == "tiny-random"
    assert server.get("/health")[0] == 200


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])  # fmt: skip
def test_bad_input_gets_a_400_and_the_server_keeps_serving(server, body, param):
    status, err = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 400
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    assert completion(server, "still alive?", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_unknown_model_and_too_long_prompt(server):
    status, err = server.post("/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, err = server.post("/v1/completions", {"prompt": [5] * 20000})
    assert status == 400 and "context" in err["error"]["message"]


def test_modes_give_the_same_tokens_and_disagg_moves_the_prompts_kv(server):
    prompts = [[5 + i, 17, 300 + i, 42] * (i + 1) for i in range(4)]
    texts = {}
    for mode in ("colocated", "chunked", "disagg", "colocated"):
        chunks = {} if mode == "colocated" else {"chunk_tokens": 3}  # colocated refuses a setting it has not
        status, got = server.post("/admin/mode", {"mode": mode, **chunks})
        assert status == 200 and got["mode"] == mode
        outs = [completion(server, p, max_tokens=6, ignore_eos=True) for p in prompts]
        texts.setdefault(mode, [o["choices"][0]["text"] for o in outs])
        assert [o["choices"][0]["text"] for o in outs] == texts["colocated"]
        if mode == "disagg":
            for p, o in zip(prompts, outs):
                t = server.get(f"/v1/requests/{o['id']}/timeline")[1]
                assert t["prefill_worker"] != t["decode_worker"]
                assert t["kv_transfer"]["bytes"] == len(p) * TINY_KV_BYTES_PER_TOKEN
                assert t["events"]["transfer_start"] <= t["events"]["transfer_end"]
    # a live switch does not wait for a prefill worker's last send to be collected: its blocks come back just after
    workers = wait_for_idle_workers(server, 10)
    assert all(w["kv_blocks_used"] == 0 and w["kv_blocks_seated"] == 0 for w in workers)


def test_a_disagg_request_that_ends_at_its_first_token_takes_no_decode_seat(server):
    """max_tokens 1 and completions' echo-only scoring (lm-eval's loglikelihood) end on the prefill
    worker: a decode seat would never be written into, and its release counted as a failed handoff."""

    def counts():
        out = {}
        for fam in text_string_to_metric_families(server.get("/metrics")[1]):
            for s in fam.samples:
                if s.name in ("minipd:kv_handoffs_total", "minipd:seats_reserved_total", "minipd:disagg_placements_total"):
                    key = (s.name, s.labels.get("outcome") or s.labels.get("path"))
                    out[key] = out.get(key, 0) + s.value
        return out

    assert server.post("/admin/mode", {"mode": "disagg"})[0] == 200
    try:
        before = counts()
        one = completion(server, [5, 17, 300, 42] * 3, max_tokens=1)
        scored = completion(server, [6, 18, 301, 43] * 3, max_tokens=0, echo=True, logprobs=1)
        two = completion(server, [5, 17, 300, 42] * 3, max_tokens=2, ignore_eos=True)
        after = counts()
        for reply in (one, scored):
            t = server.get(f"/v1/requests/{reply['id']}/timeline")[1]
            assert t["path"] == "prefill_only" and t["prefill_worker"] == 0
            assert "seat_reserved" not in t["events"] and t["kv_transfer"]["bytes"] == 0
        assert scored["usage"]["completion_tokens"] == 0 and one["usage"]["completion_tokens"] == 1
        t = server.get(f"/v1/requests/{two['id']}/timeline")[1]
        assert t["path"] == "remote" and t["kv_transfer"]["bytes"] > 0
        grown = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        assert grown == {("minipd:seats_reserved_total", None): 1, ("minipd:kv_handoffs_total", "imported"): 1,
                         ("minipd:disagg_placements_total", "remote"): 1,
                         ("minipd:disagg_placements_total", "prefill_only"): 2}, grown  # no seat_failed
    finally:
        assert server.post("/admin/mode", {"mode": "colocated"})[0] == 200
    workers = wait_for_idle_workers(server, 10)
    assert all(w["kv_blocks_used"] == 0 and w["kv_blocks_seated"] == 0 for w in workers)
    assert one["choices"][0]["text"] == completion(server, [5, 17, 300, 42] * 3, max_tokens=1)["choices"][0]["text"]


def test_bfloat16_disagg_moves_bfloat16_kv_and_gives_colocated_tokens():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--dtype", "bfloat16") as s:
        prompts = [[5 + i, 17, 300 + i, 42] * (i + 1) for i in range(3)]
        texts = {}
        for mode in ("colocated", "disagg"):
            assert s.post("/admin/mode", {"mode": mode})[0] == 200
            outs = [completion(s, p, max_tokens=8, ignore_eos=True) for p in prompts]
            texts[mode] = [o["choices"][0]["text"] for o in outs]
        assert texts["disagg"] == texts["colocated"]
        for p, o in zip(prompts, outs):
            t = s.get(f"/v1/requests/{o['id']}/timeline")[1]
            assert t["prefill_worker"] != t["decode_worker"]
            assert t["kv_transfer"]["bytes"] == len(p) * tiny_random_config().kv_bytes_per_token(2)


def test_metrics_parse_and_move(server):
    def counters():
        text = server.get("/metrics")[1]
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith(("_total", "_count")):
                    out[s.name] = out.get(s.name, 0) + s.value
        return out

    before = counters()
    completion(server, "count me", max_tokens=3, ignore_eos=True)
    after = counters()
    assert after["minipd:generation_tokens_total"] - before.get("minipd:generation_tokens_total", 0) == 3
    assert after["minipd:time_to_first_token_seconds_count"] > before.get("minipd:time_to_first_token_seconds_count", 0)
    assert after["minipd:e2e_request_latency_seconds_count"] > before.get("minipd:e2e_request_latency_seconds_count", 0)


async def _stream_texts(url, n, **kw):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

    async def one(i):
        parts, usage = [], None
        stream = await client.completions.create(model="tiny-random", prompt=f"request number {i}", stream=True,
                                                 stream_options={"include_usage": True}, temperature=0, **kw)  # fmt: skip
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage
        return "".join(parts), usage

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_openai_client_streams_with_usage(server):
    results = await _stream_texts(server.url, 6, max_tokens=5, extra_body={"ignore_eos": True})
    for text, usage in results:
        assert usage.completion_tokens == 5 and text
    async with aiohttp.ClientSession() as session:  # a client that reads the charset (requests) gets UTF-8, as vLLM's
        async with session.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            await r.read()


@pytest.mark.asyncio
@pytest.mark.parametrize("choices", [1, 3])
async def test_client_disconnect_frees_the_blocks(server, choices):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    stream = await client.completions.create(model="tiny-random", prompt="long one", stream=True, n=choices,
                                             max_tokens=3000, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    await stream.close()
    await client.close()
    # off the loop: whatever the close left for the loop to do runs while the server is watched
    await asyncio.to_thread(wait_for_idle_workers, server, timeout=20)


@pytest.mark.asyncio
async def test_backpressure_waits_for_a_decode_seat():
    """Decode KV room for 2 requests: the 3rd is not prefilled until a seat frees; all complete."""
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "disagg",
                 "--kv-cache-tokens", "64", "--block-size", "16") as s:  # fmt: skip
        prompts = [[7 + i] * 30 for i in range(3)]  # 30 prompt tokens + 1 -> 2 blocks of 16: 2 seats fit in 4

        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none")
        try:
            outs = await asyncio.gather(*(client.completions.create(
                model="tiny-random", prompt=p, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))  # fmt: skip
        finally:
            await client.close()
        assert all(o.usage.completion_tokens == 2 for o in outs)
        lines = [s.get(f"/v1/requests/{o.id}/timeline")[1] for o in outs]
        lines.sort(key=lambda t: t["events"]["prefill_start"])
        first_finish = min(t["events"]["finish"] for t in lines[:2])
        assert lines[2]["events"]["seat_reserved"] >= first_finish
        assert lines[2]["events"]["prefill_start"] >= first_finish


def test_tcp_transport_with_link_emulation_gives_the_same_tokens(server):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "disagg",
                 "--kv-transport", "tcp", "--kv-link-gbps", "0.01", "--kv-link-latency-ms", "20") as s:  # fmt: skip
        prompt = [11, 12, 13] * 40
        got = completion(s, prompt, max_tokens=5, ignore_eos=True)
        server.post("/admin/mode", {"mode": "colocated"})
        want = completion(server, prompt, max_tokens=5, ignore_eos=True)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        t = s.get(f"/v1/requests/{got['id']}/timeline")[1]
        size = len(prompt) * TINY_KV_BYTES_PER_TOKEN
        assert t["kv_transfer"]["bytes"] == size
        assert t["kv_transfer"]["seconds"] >= 0.02 + size * 8 / 0.01e9  # the emulated link was honoured


@pytest.mark.asyncio
async def test_three_workers_1p2d_and_2p1d_give_the_same_tokens():
    with serving("--model", "tiny-random", "--workers", "3", "--threads-per-worker", "1") as s:
        prompts = [[9 + i, 2, 4000 - i] * (i + 2) for i in range(6)]

        async def run_all():
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none")
            try:
                outs = await asyncio.gather(*(client.completions.create(
                    model="tiny-random", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                    for p in prompts))  # fmt: skip
                return [o.choices[0].text for o in outs], [o.id for o in outs]
            finally:
                await client.close()

        want, _ = await run_all()
        for p, d in ((1, 2), (2, 1)):
            assert s.post("/admin/mode", {"mode": "disagg", "prefill_workers": p, "decode_workers": d})[0] == 200
            got, ids = await run_all()
            assert got == want
            lines = [s.get(f"/v1/requests/{i}/timeline")[1] for i in ids]
            assert len({t["prefill_worker"] for t in lines}) == p
            assert len({t["decode_worker"] for t in lines}) == d
        status, err = s.post("/admin/mode", {"mode": "disagg", "prefill_workers": 2, "decode_workers": 2})
        assert status == 400 and "P + D" in err["error"]["message"]


@pytest.mark.asyncio
async def test_switch_while_requests_stream_drains_them_and_loses_none(server):
    prompts = [[20 + i, 30, 40] * (i + 1) for i in range(6)]

    async def one(client, p):
        out = await client.completions.create(model="tiny-random", prompt=p, max_tokens=40, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        return out.choices[0].text

    async def go(switch_to):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        try:
            tasks = [asyncio.ensure_future(one(client, p)) for p in prompts[:3]]
            await asyncio.sleep(0.05)
            switch = asyncio.get_running_loop().run_in_executor(
                None, lambda: server.post("/admin/mode", {"mode": switch_to}))
            await asyncio.sleep(0.05)
            tasks += [asyncio.ensure_future(one(client, p)) for p in prompts[3:]]  # arrive during the switch
            status, _ = await switch
            assert status == 200
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    server.post("/admin/mode", {"mode": "colocated"})
    want = [completion(server, p, max_tokens=40, ignore_eos=True)["choices"][0]["text"] for p in prompts]
    assert await go("disagg") == want
    assert server.get("/admin/mode")[1]["mode"] == "disagg"
    assert await go("chunked") == want


def test_a_transport_that_cannot_work_on_the_device_is_refused():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "minipd", "serve", "--model", "tiny-random", "--kv-transport",
                          "cuda-ipc", "--device", "cpu"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "does not work with --device cpu" in out.stderr


@pytest.mark.asyncio
async def test_overload_gets_429_and_the_rest_complete():
    with serving("--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1",
                 "--max-num-seqs", "1", "--max-waiting", "1") as s:  # fmt: skip
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)

        async def one(i):
            try:
                out = await client.completions.create(model="tiny-random", prompt=f"n{i}", max_tokens=30,
                                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
                return out.usage.completion_tokens
            except openai.RateLimitError as err:
                assert err.code == "rate_limit_exceeded", err.body  # OpenAI's code (was null)
                return err.status_code

        try:
            results = await asyncio.gather(*(one(i) for i in range(5)))
        finally:
            await client.close()
        assert results.count(429) >= 1 and results.count(30) >= 2, results
        assert set(results) <= {429, 30}
        assert completion(s, "after the rush", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_workers_end_and_clean_up_when_the_main_process_is_killed():
    s = ServerProcess("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1")
    assert len(glob.glob(f"/dev/shm/minipd_{s.proc.pid}-*_cache*")) == 2  # the two workers' KV caches
    s.stop(signal.SIGKILL)  # no chance to clean up: the workers must notice and go
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and s.leftovers() != ([], []):
        time.sleep(0.1)
    assert s.leftovers() == ([], [])


def test_ctrl_c_stops_cleanly():
    s = ServerProcess("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "disagg")
    completion(s, [1, 2, 3], max_tokens=3)
    assert s.stop(signal.SIGINT) == 0
    assert s.leftovers() == ([], [])


def test_a_handoff_past_its_lease_fails_the_request_and_frees_both_sides():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "disagg",
                 "--kv-transport", "tcp", "--kv-link-gbps", "0.00002", "--kv-transfer-timeout", "0.5") as s:  # fmt: skip
        status, err = s.post("/v1/completions", {"prompt": [5] * 10, "max_tokens": 5, "temperature": 0})
        assert status == 503 and "did not finish within 0.5 s" in err["error"]["message"]
        assert err["error"]["code"] == "kv_handoff_timeout"  # the router, the writer or the reader sees it first (defect: the writer said kv_handoff_failed)
        wait_for_idle_workers(s, timeout=10)  # the slow sender finishes its 5 KB, then lets go of the blocks
        assert s.get("/health")[0] == 200


@pytest.mark.asyncio
async def test_logprobs_through_the_openai_client_are_the_same_whichever_worker_samples(server):
    """In disagg the first token is sampled by the prefill worker and the rest by the decode worker:
    each token's logprobs arrive with it, in OpenAI's shapes, as in colocated (to float rounding)."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    got = {}
    try:
        for mode in ("colocated", "disagg"):
            assert server.post("/admin/mode", {"mode": mode})[0] == 200
            done = await client.completions.create(model="tiny-random", prompt=[5, 17, 300, 42] * 3, max_tokens=5,
                                                   temperature=0, logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
            chat = await client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                        stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            content = [x async for c in chat if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
            got[mode] = (done.choices[0].logprobs, content, done.choices[0].text)
    finally:
        server.post("/admin/mode", {"mode": "colocated"})
        await client.close()
    for lp, content, text in got.values():
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and "".join(lp.tokens) == text
        assert all(len(top) in (2, 3) and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
        assert len(content) == 4 and all(len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token for x in content)
    (a, ca, _), (b, cb, _) = got["colocated"], got["disagg"]
    assert a.tokens == b.tokens and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert [x.token for x in ca] == [x.token for x in cb]
    assert [x.logprob for x in ca] == pytest.approx([x.logprob for x in cb], abs=1e-4)


@pytest.mark.asyncio
async def test_n_choices_are_separate_replies_seeded_one_after_another_streamed_or_not(server):
    """As vLLM: choice i of a request with a seed is the reply that seed + i gives alone."""
    prompt, kw = [9, 8, 7, 6, 5], {"max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    alone = [completion(server, prompt, seed=40 + i, max_tokens=6, temperature=1.0, ignore_eos=True)["choices"][0]["text"]
             for i in range(3)]  # fmt: skip
    body = completion(server, prompt, seed=40, n=3, max_tokens=6, temperature=1.0, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and [c["text"] for c in body["choices"]] == alone
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 18, "total_tokens": 23}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    try:
        stream = await client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                                      n=2, seed=5, stream=True, stream_options={"include_usage": True},
                                                      logprobs=True, **kw)  # fmt: skip
        texts, ends, lps, usage = ["", ""], [None, None], [0, 0], None
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                ends[c.index] = c.finish_reason or ends[c.index]
                lps[c.index] += len(c.logprobs.content) if c.logprobs else 0
            usage = chunk.usage or usage
        whole = await client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                                     n=2, seed=5, **kw)  # fmt: skip
    finally:
        await client.close()
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    assert ends == ["length", "length"] and lps == [6, 6] and usage.completion_tokens == 12
    wait_for_idle_workers(server, 10)


@pytest.mark.asyncio
async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks_streamed_or_not_in_every_mode(server):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 1. The prompt's tokens come first
    (the first without a logprob), the same whichever worker prefilled it and whether streamed."""
    prompt = [5, 17, 300, 42, 8, 99]
    kw = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    got = {}
    try:
        for mode in ("colocated", "disagg"):
            assert server.post("/admin/mode", {"mode": mode})[0] == 200
            body = completion(server, **{k: v for k, v in kw.items() if k != "temperature"})
            status, raw = await asyncio.to_thread(http, "POST", server.url + "/v1/completions", {**kw, "stream": True})
            got[mode] = body["choices"][0], raw
    finally:
        server.post("/admin/mode", {"mode": "colocated"})
    plain = completion(server, prompt, max_tokens=1)["choices"][0]["text"]
    for choice, raw in got.values():
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
        assert choice["text"] == "".join(lp["tokens"]) and choice["text"].endswith(plain)
        assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None
        assert all(str(t) in row for t, row in zip(prompt[1:], choice["prompt_logprobs"][1:]))
        chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
        parts = [c["choices"][0] for c in chunks]
        assert "".join(c["text"] for c in parts) == choice["text"]
        merged = {k: [x for c in parts if c["logprobs"] for x in c["logprobs"][k]] for k in lp}
        assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
        assert merged["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    a, b = got["colocated"][0]["logprobs"], got["disagg"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and a["token_logprobs"][1:] == pytest.approx(b["token_logprobs"][1:], abs=1e-4)


@pytest.mark.asyncio
async def test_echo_with_max_tokens_0_scores_the_prompt_and_makes_no_reply(server):
    """Defect (a new-user pass): OpenAI's legacy scoring request, and vLLM's, echo with max_tokens 0,
    was a 400. The reply is the prompt, its tokens' logprobs as with max_tokens 1, no token of its
    own: finish_reason "length", 0 completion tokens, streamed or not; without echo 0 stays a 400."""
    prompt = [5, 17, 300, 42, 8, 99]
    kw = {"echo": True, "logprobs": 2, "return_token_ids": True}
    one = completion(server, prompt, max_tokens=1, **kw)["choices"][0]
    body = completion(server, prompt, max_tokens=0, **kw)
    zero = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    assert (zero["finish_reason"], zero["stop_reason"], zero["token_ids"]) == ("length", None, [])
    assert zero["logprobs"]["tokens"] == one["logprobs"]["tokens"][: len(prompt)]
    assert zero["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1 : len(prompt)], abs=1e-4)
    assert zero["text"] == "".join(zero["logprobs"]["tokens"]) and one["text"].startswith(zero["text"])
    assert len(one["text"]) > len(zero["text"])
    status, raw = await asyncio.to_thread(http, "POST", server.url + "/v1/completions",
                                          {"prompt": prompt, **kw, "max_tokens": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert status == 200 and "".join(c["text"] for c in parts) == zero["text"]
    assert [t for c in parts if c.get("logprobs") for t in c["logprobs"]["tokens"]] == zero["logprobs"]["tokens"]
    assert parts[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 0
    for bad in ({"prompt": prompt, "max_tokens": 0}, {"prompt": prompt, "max_tokens": 0, "echo": False},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "echo": True}):  # fmt: skip
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        status, err = server.post(path, bad)
        assert status == 400 and err["error"]["param"] == "max_tokens", (bad, err)
    wait_for_idle_workers(server, 10)


@pytest.mark.asyncio
async def test_a_one_token_prompt_echoes_with_logprobs_and_gets_one_null_prompt_logprob(server):
    """A one-token prompt has no prompt token to score: echo with logprobs is [null] (it was a 500),
    prompt_logprobs is [null] as vLLM's (it was []), streamed or not."""
    kw = {"prompt": [42], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 1}
    choice = completion(server, **kw)["choices"][0]
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == 3
    assert choice["prompt_logprobs"] == [None]
    status, raw = await asyncio.to_thread(http, "POST", server.url + "/v1/completions", {**kw, "stream": True})
    parts = [json.loads(line[6:])["choices"][0] for line in raw.split("\n") if line.startswith("data: {")]
    assert status == 200 and parts[0]["prompt_logprobs"] == [None]
    assert [t for c in parts if c["logprobs"] for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "prompt_logprobs": 0})[1]  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_vllms_output_fields_are_honoured_not_ignored(server, tokenizer):
    """Defect: include_stop_str_in_output, skip_special_tokens, return_tokens_as_token_ids and
    truncate_prompt_tokens were taken and ignored."""
    prompt = [5, 17, 300, 42, 8, 99]
    base = completion(server, prompt, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    stop = next(base[i : i + 3] for i in range(len(base) // 2, len(base)) if base[i : i + 3].strip())
    at = base.find(stop)
    kw = {"max_tokens": 16, "ignore_eos": True, "stop": [stop]}
    assert completion(server, prompt, **kw)["choices"][0]["text"] == base[:at]
    kept = completion(server, prompt, include_stop_str_in_output=True, **kw)["choices"][0]
    assert kept["text"] == base[: at + len(stop)] and kept["finish_reason"] == "stop"

    eos = tokenizer.eos_token_id
    stopped = completion(server, prompt, max_tokens=2, logit_bias={str(eos): 100}, skip_special_tokens=False)
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"  # as vLLM
    ends = {"max_tokens": 2, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    assert completion(server, prompt, **ends)["choices"][0]["text"] == ""
    shown = completion(server, prompt, skip_special_tokens=False, **ends)["choices"][0]["text"]
    assert shown == tokenizer.decode([eos, eos], skip_special_tokens=False) == "<|im_end|><|im_end|>"

    lp = completion(server, prompt, max_tokens=3, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"]) and len(lp["tokens"]) == 3
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    status, chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})  # fmt: skip
    assert status == 200 and all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])

    cut = completion(server, prompt, max_tokens=4, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == completion(server, prompt[-3:], max_tokens=4)["choices"][0]["text"]
    long = completion(server, [7] * 5000, max_tokens=2, truncate_prompt_tokens=10)  # longer than the context
    assert long["usage"]["prompt_tokens"] == 10
    status, chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 50}],
                                                        "max_tokens": 1, "truncate_prompt_tokens": 5})  # fmt: skip
    assert status == 200 and chat["usage"]["prompt_tokens"] == 5


def test_a_reply_of_several_choices_has_a_timeline_under_its_own_id(server):
    """Defect: with n > 1 the response's id had no timeline (only its choices' ids, which it never names)."""
    body = completion(server, [5, 6, 7], max_tokens=3, n=2, ignore_eos=True)
    status, t = server.get(f"/v1/requests/{body['id']}/timeline")
    assert status == 200 and len(t["choices"]) == 2
    assert t["choices"][1] == server.get(f"/v1/requests/{body['id']}-1/timeline")[1]
    assert all(len(c["token_times"]) == 3 for c in t["choices"])


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_reply(server):
    """vLLM's stop_reason (it was missing): the stop string, or the stop_token_ids token, or null."""
    prompt = [5, 17, 300, 42, 8, 99]
    base = completion(server, prompt, max_tokens=16, ignore_eos=True, logprobs=0)["choices"][0]
    assert base["stop_reason"] is None and base["finish_reason"] == "length"
    stop = next(base["text"][i : i + 3] for i in range(len(base["text"]) // 2, len(base["text"])) if base["text"][i : i + 3].strip())
    assert completion(server, prompt, max_tokens=16, ignore_eos=True, stop=[stop])["choices"][0]["stop_reason"] == stop
    ids = completion(server, prompt, max_tokens=16, ignore_eos=True, return_tokens_as_token_ids=True, logprobs=0)
    fifth = int(ids["choices"][0]["logprobs"]["tokens"][4].removeprefix("token_id:"))
    got = completion(server, prompt, max_tokens=16, ignore_eos=True, stop_token_ids=[fifth])["choices"][0]
    assert got["stop_reason"] == fifth and got["finish_reason"] == "stop"
    status, raw = http("POST", server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                               "ignore_eos": True, "stop": [stop], "stream": True})  # fmt: skip
    last = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")][-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])  # in every chunk, as vLLM
    status, chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert "stop_reason" in chat["choices"][0]
    eos = 2  # the default tokenizer's <|im_end|>: eos stops first, as vLLM checks it first (then stop_reason is null)
    both = completion(server, prompt, max_tokens=4, logit_bias={str(eos): 100}, stop_token_ids=[eos])["choices"][0]
    assert both["finish_reason"] == "stop" and both["stop_reason"] is None
    ignored = completion(server, prompt, max_tokens=4, logit_bias={str(eos): 100}, stop_token_ids=[eos], ignore_eos=True)
    assert ignored["choices"][0]["stop_reason"] == eos


@pytest.mark.asyncio
async def test_several_prompts_in_one_completions_request_each_get_their_choices(server):
    """OpenAI's and vLLM's batch of prompts (lm-eval's local-completions sends them): choice
    index = prompt index * n + choice; usage counts each prompt once. It was refused."""
    a, b = [5, 17, 300], [42, 8, 99, 7]
    one_a = completion(server, a, max_tokens=4, ignore_eos=True)["choices"][0]["text"]
    one_b = completion(server, b, max_tokens=4, ignore_eos=True)["choices"][0]["text"]
    both = completion(server, [a, b], max_tokens=4, ignore_eos=True, n=2, echo=True)
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in both["choices"]]
    echo_a, echo_b = (texts[0][: -len(one_a)], texts[2][: -len(one_b)])
    assert texts == [echo_a + one_a] * 2 + [echo_b + one_b] * 2 and echo_a != echo_b
    assert both["usage"] == {"prompt_tokens": 7, "completion_tokens": 16, "total_tokens": 23}
    status, raw = await asyncio.to_thread(http, "POST", server.url + "/v1/completions", {
        "prompt": [a, b], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    status, raw = await asyncio.to_thread(http, "POST", server.url + "/v1/completions", {
        "prompt": [a, b], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    lines = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    per_choice = [(c["choices"][0]["index"], c["usage"]) for c in lines if c["choices"]]
    assert {i: u["prompt_tokens"] for i, u in per_choice} == {0: 3, 1: 4}  # as vLLM: each choice's own usage
    assert [u["completion_tokens"] for i, u in per_choice if i == 1] == sorted(u["completion_tokens"] for i, u in per_choice if i == 1)
    assert max(u["completion_tokens"] for i, u in per_choice if i == 0) == 4 and lines[-1]["usage"]["completion_tokens"] == 8
    streamed = ["", ""]
    for c in chunks:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert status == 200 and streamed == [one_a, one_b] and chunks[-1]["usage"]["prompt_tokens"] == 7
    status, texts = server.post("/v1/completions", {"prompt": ["Hello there", "Bye"], "max_tokens": 2})
    assert status == 200 and len(texts["choices"]) == 2


def test_chat_echo_prepends_the_last_message_when_it_is_the_assistants(server):
    """vLLM's chat echo (it was refused): the reply starts with the last message's content when that
    message is the assistant's (the reply continues its role); otherwise nothing is echoed."""
    kw = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! I am"}]
    plain = server.post("/v1/chat/completions", {"messages": said, **kw})[1]["choices"][0]["message"]["content"]
    echoed = server.post("/v1/chat/completions", {"messages": said, "echo": True, **kw})[1]
    assert echoed["choices"][0]["message"]["content"] == "Hello! I am" + plain
    asked = [{"role": "user", "content": "hi"}]
    alone = server.post("/v1/chat/completions", {"messages": asked, **kw})[1]["choices"][0]["message"]["content"]
    assert server.post("/v1/chat/completions", {"messages": asked, "echo": True, **kw})[1]["choices"][0]["message"]["content"] == alone
    status, raw = http("POST", server.url + "/v1/chat/completions", {"messages": said, "echo": True, "stream": True, **kw})
    parts = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.split("\n") if line.startswith("data: {")]
    assert status == 200 and "".join(d.get("content") or "" for d in parts) == "Hello! I am" + plain


def test_fields_real_clients_send_are_accepted(server):
    status, body = server.post("/v1/chat/completions", {
        "model": "tiny-random", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "ignore_eos": True, "repetition_penalty": 1.0, "logprobs": None, "seed": 3, "stop": ["\n\n\n"],
        "max_completion_tokens": 4, "temperature": 0.7, "top_p": 0.9, "n": 1, "presence_penalty": 0,
        "frequency_penalty": 0.0, "stream": False, "stream_options": None, "best_of": 1,
    })  # fmt: skip
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    again = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "seed": 3, "max_completion_tokens": 4,
        "temperature": 0.7, "top_p": 0.9})[1]  # fmt: skip
    assert again["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]  # same seed
    penalized = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 4, "temperature": 0,
        "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 2})  # fmt: skip
    assert penalized[0] == 200 and penalized[1]["usage"]["completion_tokens"] == 4


def test_an_api_key_guards_v1_and_admin_but_not_health_metrics_or_the_page():
    with serving("--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1", "--api-key", "sesame") as s:
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": [1]}),
                                   ("POST", "/v1/chat/completions", {"messages": []}), ("GET", "/admin/mode", None),
                                   ("POST", "/admin/mode", {"mode": "chunked"}), ("GET", "/admin/workers", None),
                                   ("GET", "/admin/events", None), ("GET", "/v1/requests/x/timeline", None)):  # fmt: skip
            for key in (None, "wrong"):
                status, err = http(method, s.url + path, body, api_key=key)
                assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, key)
                assert set(err["error"]) == {"message", "type", "param", "code"}
        for path in ("/health", "/metrics", "/", "/static/app.js"):
            assert http("GET", s.url + path)[0] == 200, path
        assert s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200  # with the key
        assert s.get("/admin/mode")[1] == {"mode": "colocated"}


@pytest.mark.asyncio
async def test_other_streams_do_not_stall_while_huge_prompts_are_refused(server):
    """Defect: a 4 MB prompt was tokenized on the event loop: 7.1 s before its 400, and every
    other stream stopped for those 7.1 s."""
    import aiohttp

    huge = "lorem ipsum dolor sit amet " * 160_000  # 4.3 MB: refused before it is tokenized
    long_ = "the quick brown fox jumps over the lazy dog " * 8_000  # 350 kB: tokenized off the loop, too long
    times, statuses = [], []
    async with aiohttp.ClientSession() as session:

        async def stream():
            body = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        times.append(time.monotonic())

        async def hostile():
            while len(times) < 20:
                await asyncio.sleep(0.01)
            for path, body in [("/v1/completions", {"prompt": huge}), ("/v1/completions", {"prompt": long_}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_}]})]:  # fmt: skip
                started = time.monotonic()
                async with session.post(server.url + path, json=body) as resp:
                    statuses.append((resp.status, time.monotonic() - started))
            return time.monotonic()

        streaming = asyncio.create_task(stream())
        hostile_from = time.monotonic()
        hostile_until = await hostile()
        await streaming
    assert [s for s, _ in statuses] == [400] * 4 and all(t < 2.0 for _, t in statuses), statuses
    during = [b - a for a, b in zip(times, times[1:]) if hostile_from <= b and a <= hostile_until]
    assert during and max(during) < 0.5, max(during)


def test_return_token_ids_gives_the_prompt_and_reply_ids_as_vllm(server):
    """vLLM's return_token_ids (it was refused): completions' choices carry prompt_token_ids and
    token_ids, chat's response prompt_token_ids and its choices token_ids; a stream sends each
    chunk's ids, also where the text is empty (a model without a tokenizer streams ids only)."""
    prompt = [5, 17, 300, 42, 8, 99]
    named = completion(server, prompt, max_tokens=6, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    want = [int(t.removeprefix("token_id:")) for t in named["choices"][0]["logprobs"]["tokens"]]
    got = completion(server, prompt, max_tokens=6, ignore_eos=True, return_token_ids=True)["choices"][0]
    assert got["prompt_token_ids"] == prompt and got["token_ids"] == want
    assert "token_ids" not in completion(server, prompt, max_tokens=2)["choices"][0]
    status, raw = http("POST", server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                               "ignore_eos": True, "stream": True, "return_token_ids": True})  # fmt: skip
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.split("\n") if line.startswith("data: {")]
    assert status == 200 and [t for c in chunks for t in c["token_ids"]] == want
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    status, chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                        "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert status == 200 and len(chat["choices"][0]["token_ids"]) == 3 and len(chat["prompt_token_ids"]) > 3
    status, err = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "return_token_ids": "yes"})
    assert status == 400 and err["error"]["param"] == "return_token_ids"


def test_a_stream_sends_a_chunk_for_every_step_even_where_the_text_is_empty(server):
    """As vLLM: tokens whose text is empty (skipped special tokens, a model without a tokenizer)
    still get their chunk, so a client sees each token when it is made, not all at the end."""
    status, raw = http("POST", server.url + "/v1/completions", {
        "prompt": [5, 17, 300], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"2": 100},
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    made = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert status == 200 and made == [1, 2, 3, 4] and all(c["choices"][0]["text"] == "" for c in chunks if c["choices"])


def test_an_echoed_streams_first_chunk_carries_the_prompt_ids_and_usage(server):
    """Defect: with echo (or prompt_logprobs) the first chunk, the prompt's, had neither
    prompt_token_ids (return_token_ids) nor usage (continuous_usage_stats); the ids came in the next."""
    prompt = [5, 17, 300]
    for extra in ({"echo": True}, {"prompt_logprobs": 0}):
        status, raw = http("POST", server.url + "/v1/completions", {
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra})  # fmt: skip
        chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
        first = chunks[0]
        assert status == 200 and first["choices"][0]["prompt_token_ids"] == prompt, extra
        assert "usage" in first and all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:] if c["choices"])


def test_each_worker_freezes_its_startup_heap_and_reports_its_collections(server):
    """Defect: a full garbage collection walked torch's and the model's objects in the middle of a
    decode step (70-90 ms in a tiny-model worker; 0.4-0.5 s in the server process under 23 streams,
    which froze every reply at once, in CI). The workers freeze what they built before serving
    (minipd/heap.py), and say how long their collections stopped them."""
    status, _ = server.post("/v1/completions", {"prompt": [5, 17, 300], "max_tokens": 3, "ignore_eos": True})
    assert status == 200
    deadline = time.monotonic() + 10
    while True:
        workers = server.get("/admin/workers")[1]["workers"]
        if all(w["gc"] for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for w in workers:
        gc = w["gc"]
        assert gc and gc["frozen_objects"] > 10_000, w  # torch alone is far more
        assert gc["collections"] >= gc["full_collections"] >= 0 and gc["longest_full_seconds"] <= gc["seconds"] + 1e-6
    status, text = server.get("/metrics")
    assert status == 200
    text = text if isinstance(text, str) else text.decode()
    for w in workers:
        assert f'minipd:worker_gc_longest_full_collection_seconds{{model_name="tiny-random",worker="{w["id"]}"}}' in text
        assert f'minipd:worker_gc_seconds_total{{model_name="tiny-random",worker="{w["id"]}"}}' in text
    assert re.search(r"# TYPE minipd:worker_gc_seconds(_total)? counter", text)  # (a new-user helper: it was a gauge)


def test_each_worker_row_says_where_peers_put_its_kv(server):
    """Confusing (a new-user helper): with --kv-transport shm, GET /admin/workers showed only a tcp
    `kv_address`, which reads as if the KV went over tcp. That socket carries the handoffs' notes
    (and, with tcp, the KV itself); with shm the KV is written into a /dev/shm segment, named now."""
    body = server.get("/admin/workers")[1]
    assert body["kv_transport"] == "shm"
    for w in body["workers"]:
        assert w["kv_address"].startswith("tcp://127.0.0.1:")
        segment = w["kv_shm_segment"]
        assert segment and glob.glob(f"/dev/shm/{segment.lstrip('/')}"), w


def test_silent_and_half_sent_connections_cannot_lock_clients_out():
    """Defect (a hostile-client helper): 20,000 sockets that sent nothing, or half a request head,
    stayed open for good and used up the server's open files; then every client was refused. `serve`
    now closes a connection that waits past --timeout-keep-alive, and past --max-connections closes
    the oldest one waiting for a request."""
    import socket

    with serving("--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1",
                 "--timeout-keep-alive", "2", "--max-connections", "40") as server:  # fmt: skip
        def fds() -> int:
            return len(os.listdir(f"/proc/{server.proc.pid}/fd"))

        before = fds()
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
        time.sleep(0.5)
        status, body = server.get("/health")
        assert status == 200, body
        assert fds() <= before + 40 + 5, (before, fds())
        status, _ = server.post("/v1/completions", {"prompt": [5, 17], "max_tokens": 2})
        assert status == 200
        for s in silent:
            s.close()
        time.sleep(0.5)
        # alone now (the limit closes no one): only --timeout-keep-alive can end it
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        half.settimeout(6)
        t = time.monotonic()
        for i in range(4):  # a header line every half second does not keep it open
            try:
                half.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                break
            time.sleep(0.5)
        try:
            assert half.recv(1) == b""
        except ConnectionResetError:
            pass
        assert 1.5 < time.monotonic() - t < 6
        half.close()


def test_clients_that_stop_reading_their_streams_cannot_lock_others_out():
    """Defect (a hostile-client helper): 8 streaming clients that never read (20 logprobs a token, a
    4 KB receive buffer) held their connections for good, so past --max-connections 8 every other
    client got a 503 for as long as they stayed (210 s and more). Now --send-timeout closes a
    connection whose reply has not moved for that long, and its request ends."""
    import socket

    with serving("--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1",
                 "--max-connections", "8", "--send-timeout", "2") as server:  # fmt: skip
        body = json.dumps({"prompt": [5 + i % 200 for i in range(1000)], "max_tokens": 3000, "stream": True,
                           "logprobs": 20, "echo": True, "ignore_eos": True}).encode()  # a MB at once: the echo's  # fmt: skip
        stalled = []
        for _ in range(8):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
            stalled.append(s)
        try:
            deadline = time.monotonic() + 60
            while True:  # their replies stop moving once the sockets fill; 2 s later they are closed
                status, answer = server.get("/v1/models")
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert status == 200, answer

            def running() -> list[str]:
                text = server.get("/metrics")[1]
                return [line for line in text.splitlines() if line.startswith("minipd:num_requests_running")]

            while any(not line.endswith(" 0.0") for line in running()) and time.monotonic() < deadline:
                time.sleep(0.5)  # their requests ended with their connections, long before 3,000 tokens
            assert running() and all(line.endswith(" 0.0") for line in running()), running()
            assert "--send-timeout" in server.output()
        finally:
            for s in stalled:
                s.close()
