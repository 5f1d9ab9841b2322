"""The CUDA path, on a GPU only (scripts/gpu_check.sh runs these first on any machine with one)."""

import pytest
import torch

from minipd.engine.sampler import sample
from minipd.models.loader import load_model
from minipd.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.helpers import run_disaggregated, run_staggered

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]
PROMPTS = [[5 + i, 9, 300 + i] * (2 + 5 * i) for i in range(4)]


@pytest.fixture(scope="module")
def models():
    return load_model("tiny-random", torch.float32, "cpu"), load_model("tiny-random", torch.float32, "cuda:0")


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_greedy_on_cuda_equals_cpu(models, policy):
    cpu, gpu = models
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = run_staggered(make_engine(cpu, policy=policy, chunk_tokens=8), PROMPTS, params)
    got = run_staggered(make_engine(gpu, policy=policy, chunk_tokens=8, device="cuda:0"), PROMPTS, params)
    assert got == want


def test_seeded_sampling_on_cuda_draws_what_the_cpu_draws():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    params = [SamplingParams(temperature=1.0, seed=s, top_p=0.9) for s in (1, 2, 3)]
    for index in range(20):
        assert sample(logits.cuda(), params, [index] * 3) == sample(logits, params, [index] * 3)


def test_handoff_between_cuda_engines(models):
    _, gpu = models
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True)
    want = run_staggered(make_engine(gpu, device="cuda:0"), PROMPTS, params)
    prefill = make_engine(gpu, role="prefill", device="cuda:0")
    decode = make_engine(gpu, role="decode", device="cuda:0")
    assert run_disaggregated(prefill, decode, PROMPTS, params) == want


def test_a_live_switch_on_cuda_moves_replies_over_cuda_ipc_without_changing_a_token():
    """Issue 16's move in the cuda-ipc transport: two workers on one card, replies streaming while
    the mode changes; the moved replies' text is the text of a run that never moved."""
    import asyncio

    from tests.helpers import serving, stream_completions, wait_for_idle_workers
    from tests.test_live_switch import MAX_TOKENS, PROMPTS, SEEDED, TINY, streams_with_a_switch, texts

    with serving(*TINY, "--device", "cuda", "--gpus", "0,0", "--kv-transport", "cuda-ipc") as server:
        want_greedy = texts(asyncio.run(stream_completions(server.url, PROMPTS, MAX_TOKENS)))
        want_seeded = texts(asyncio.run(stream_completions(server.url, PROMPTS[:4], MAX_TOKENS, **SEEDED)))
        for body, must_move in (
            ({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1}, True),
            ({"mode": "chunked", "chunk_tokens": 64, "workers": 1}, True),
            ({"mode": "colocated", "workers": 2}, False),
        ):
            greedy, seeded, (status, answer) = asyncio.run(streams_with_a_switch(server, body, after_tokens=4))
            assert status == 200, answer
            switch = answer["switch"]
            assert switch["changed"] and switch["not_moved"] == 0, switch
            assert (switch["moved"] > 0) == must_move, switch
            assert texts(greedy) == want_greedy, body
            assert texts(seeded) == want_seeded, body
            wait_for_idle_workers(server, 20)
