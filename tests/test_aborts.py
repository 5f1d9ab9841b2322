"""1,000 requests abandoned by their clients at random points (queued, waiting for a seat,
prefilling, transferring, decoding), with mode switches in between: afterwards no KV block is
used, seated or booked on any worker, and every worker's block accounting checks out."""

import asyncio
import os
import random

import aiohttp
import pytest

from tests.helpers import serving, wait_for_idle_workers

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("MINIPD_TEST_SEED", "0"))
MODES = [{"mode": "disagg", "prefill_workers": 1, "decode_workers": 2}, {"mode": "colocated"},
         {"mode": "disagg", "prefill_workers": 2, "decode_workers": 1}, {"mode": "chunked", "chunk_tokens": 16}]  # fmt: skip


async def one(session, url, rng: random.Random) -> str:
    body = {"prompt": [rng.randint(5, 4000) for _ in range(rng.randint(1, 120))], "temperature": 0,
            "max_tokens": rng.randint(1, 60), "ignore_eos": True, "stream": rng.random() < 0.7}  # fmt: skip
    try:
        async with asyncio.timeout(rng.uniform(0.0, 0.6)):  # then the client hangs up
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                return "completed" if resp.status == 200 else f"http {resp.status}"
    except TimeoutError:
        return "abandoned"


async def traffic(url: str, seed: int, n: int, switch_to: dict | None) -> list[str]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.ensure_future(one(session, url, rng)))
            await asyncio.sleep(rng.uniform(0, 0.01))
        if switch_to is not None:  # switch while these are in flight
            async with session.post(url + "/admin/mode", json=switch_to) as resp:
                assert resp.status == 200, await resp.text()
        return list(await asyncio.gather(*tasks))


@pytest.mark.asyncio
async def test_a_thousand_abandoned_requests_leave_no_block_behind():
    with serving("--model", "tiny-random", "--threads-per-worker", "1", "--workers", "3", "--mode", "disagg",
                 "--prefill-workers", "1", "--decode-workers", "2", "--kv-cache-tokens", "2048",
                 env={"MINIPD_FAULTS": "slow_step_s=0.003,slow_kv_copy_s=0.01"}) as s:  # fmt: skip
        outcomes = []
        for round_ in range(10):
            outcomes += await traffic(s.url, SEED + round_, 100, MODES[round_ % len(MODES)] if round_ % 2 else None)
        assert len(outcomes) == 1000
        assert set(outcomes) <= {"completed", "abandoned", "http 429"}, set(outcomes)
        assert outcomes.count("abandoned") > 300 and outcomes.count("completed") > 30  # AVX2 machines: about 60
        workers = await asyncio.to_thread(wait_for_idle_workers, s, timeout=30)
        assert all(w["kv_blocks_seated"] == 0 and w["kv_blocks_booked"] == 0 for w in workers)
        assert s.get("/health")[1]["status"] == "ok"
        log = s.output()
        assert "Traceback" not in log and " ERROR " not in log
