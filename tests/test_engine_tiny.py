"""Engine behaviour on a tiny random-weight Llama (fast)."""

import random

import pytest
import torch

from minipd.engine.sampler import sample
from minipd.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.helpers import run_disaggregated, run_staggered


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(3, 4000) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def reference(tiny_model, ps, params):
    """Each prompt alone, prefilled whole: the plainest way to run it."""
    outs = []
    for p in ps:
        e = make_engine(tiny_model)
        outs += run_staggered(e, [p], params)
    return outs


@pytest.mark.parametrize("policy,chunk", [("prefill_first", 512), ("chunked", 1), ("chunked", 5), ("chunked", 32)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_equals_one_at_a_time(tiny_model, policy, chunk, temperature):
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=123, ignore_eos=True)
    ps = prompts()
    engine = make_engine(tiny_model, policy=policy, chunk_tokens=chunk)
    got = run_staggered(engine, ps, params, join_every=2, check=lambda e: e.blocks.check_integrity())
    assert got == reference(tiny_model, ps, params)
    assert engine.blocks.num_used == 0


def test_preemption_under_a_small_kv_cache_gives_the_same_tokens(tiny_model):
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True)
    ps = prompts(5, seed=1)
    engine = make_engine(tiny_model, kv_cache_tokens=160, block_size=8)
    preempted = []

    def watch(e):
        preempted.append(e.last_step.num_preempted)
        e.blocks.check_integrity()

    got = run_staggered(engine, ps, params, join_every=1, check=watch)
    assert sum(preempted) > 0, "the cache was meant to be too small for everyone at once"
    assert got == reference(tiny_model, ps, params)
    assert engine.blocks.num_used == 0


def test_seeded_sampling_survives_the_handoff(tiny_model):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    ps = prompts(4, seed=2)
    expected = reference(tiny_model, ps, params)
    prefill, decode = make_engine(tiny_model, role="prefill"), make_engine(tiny_model, role="decode")
    assert run_disaggregated(prefill, decode, ps, params) == expected
    assert prefill.blocks.num_used == 0 and decode.blocks.num_used == 0


def test_abort_mid_decode_frees_everything(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used == 0


def test_bad_requests_are_refused(tiny_model):
    engine = make_engine(tiny_model, kv_cache_tokens=64)
    with pytest.raises(ValueError):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("x", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("x", list(range(3, 100)), SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)


def test_sampler_top_k_one_is_greedy_and_seeds_reproduce():
    logits = torch.randn(3, 100)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 3, [0, 0, 0]) == greedy
    p = SamplingParams(temperature=1.0, seed=42)
    a = sample(logits, [p] * 3, [0, 1, 2])
    assert a == sample(logits, [p] * 3, [0, 1, 2])
    draws = {tuple(sample(logits, [SamplingParams(temperature=1.0, seed=s)] * 3, [0, 0, 0])) for s in range(20)}
    assert len(draws) > 1


def test_sampler_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=s)], [0])[0] for s in range(50)}
    assert seen == {0}
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.85, seed=s)], [0])[0] for s in range(200)}
    assert seen == {0, 1}


def test_sampler_min_p_drops_tokens_far_below_the_best():
    """As vLLM: after temperature, a token less likely than min_p times the best one is not drawn."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    seen = {sample(logits, [SamplingParams(temperature=1.0, min_p=0.5, seed=s)], [0])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.4
    seen = {sample(logits, [SamplingParams(temperature=1.0, min_p=0.3, top_k=3, seed=s)], [0])[0] for s in range(300)}
    assert seen == {0, 1, 2}
    with pytest.raises(ValueError):
        SamplingParams(min_p=1.5)


def test_logit_bias_moves_a_tokens_chances_as_openai_defines_it(tiny_model):
    ps = prompts(2, seed=9)
    plain, _ = _run_with_logprobs(make_engine(tiny_model), ps, SamplingParams(max_tokens=4, temperature=0.0))
    favourite, banned = 1234, plain[0][0]
    params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={favourite: 100.0})
    forced, lps = _run_with_logprobs(make_engine(tiny_model), ps, SamplingParams(**{**params.to_dict(), "logprobs": 1}))
    assert forced == [[favourite] * 4] * 2 and all(top[0][0] != favourite for _, top in lps[0])  # logprobs: the model's
    without, _ = _run_with_logprobs(make_engine(tiny_model), ps[:1],
                                    SamplingParams(max_tokens=4, temperature=0.0, logit_bias={banned: -100}))  # fmt: skip
    assert without[0][0] != banned
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={5: 101})


def test_llm_with_one_bad_prompt_leaves_nothing_behind():
    from minipd import LLM

    llm = LLM(model="tiny-random", kv_cache_tokens=256)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [], [8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].token_ids) == 3


def test_int8_weights_are_close_and_opt_in(tiny_model):
    from minipd.models.linear import Linear, quantize_int8
    from minipd.models.loader import load_model

    model = load_model("tiny-random", torch.float32, "cpu")
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    x = torch.randn(3, layer.in_features)
    want = layer(x)
    quantize_int8(model)
    got = layer(x)
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert all(m.int8 is None for m in tiny_model.modules() if isinstance(m, Linear))  # float32 stays the default


def _run_with_logprobs(engine, prompts_, params):
    """Like run_staggered, all at once: each prompt's tokens and their logprobs entries."""
    for i, p in enumerate(prompts_):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    tokens, lps = {str(i): [] for i in range(len(prompts_))}, {str(i): [] for i in range(len(prompts_))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            lps[out.request_id] += out.logprobs or [None] * len(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts_))], [lps[str(i)] for i in range(len(prompts_))]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_tokens_logprobs_equal_those_of_a_fresh_prefill_of_the_text_before_it(tiny_model, temperature):
    """The logprobs a decode step reports are the model's own: the same as a prefill of the prompt
    and the tokens so far reports for its next token, and independent of the sampling settings."""
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=3)
    ps = prompts(3, seed=4)
    outs, lps = _run_with_logprobs(make_engine(tiny_model, policy="chunked", chunk_tokens=16), ps, params)
    for prompt, out, lp in zip(ps, outs, lps):
        assert len(lp) == len(out) == 6
        for i, (token, (chosen, top)) in enumerate(zip(out, lp)):
            assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert all(v <= 0 for _, v in top) and chosen <= top[0][1] + 1e-6
            if temperature == 0:
                assert top[0][0] == token and chosen == pytest.approx(top[0][1], abs=1e-6)
            once = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
            _, [[(fresh_chosen, fresh_top)]] = _run_with_logprobs(make_engine(tiny_model), [prompt + out[:i]], once)
            assert [t for t, _ in fresh_top] == [t for t, _ in top]
            assert [v for _, v in fresh_top] == pytest.approx([v for _, v in top], abs=1e-4)
            if token in dict(top):
                assert chosen == pytest.approx(dict(top)[token], abs=1e-6)


def test_only_the_requests_that_ask_get_logprobs_and_zero_means_the_sampled_token_alone(tiny_model):
    ps = prompts(3, seed=5)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=n) for n in (None, 0, 2)]
    outs, lps = _run_with_logprobs(make_engine(tiny_model), ps, params)
    assert lps[0] == [None] * 3
    assert all(top == [] and chosen <= 0 for chosen, top in lps[1]) and all(len(top) == 2 for _, top in lps[2])
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_penalties_change_the_logits_as_vllm_defines_them():
    from minipd.engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0], [2.0, -1.0, 0.5, 3.0, 1.0]])
    history = ([0, 1, 2, 2], 2)  # prompt 0, 1; reply 2, 2
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    apply_penalties(logits, params, [history, history])
    assert logits[0].tolist() == [1.0, -2.0, 0.25, 3.0, 1.0]  # prompt and reply tokens, by sign
    assert logits[1].tolist() == [2.0, -1.0, 0.5 - 2 * 0.5 - 0.25, 3.0, 1.0]  # the reply's tokens only
    untouched = torch.tensor([[1.0, 2.0]])
    apply_penalties(untouched, [SamplingParams()], [([0, 1], 1)])
    assert untouched.tolist() == [[1.0, 2.0]]


def test_a_reply_is_sampled_from_its_logits_less_the_penalties_of_its_own_prompt_and_reply(tiny_model, monkeypatch):
    """What the sampler is given, step by step, is the model's logits with the penalties of this
    request's prompt and reply so far; the greedy token is the best of those."""
    import minipd.engine.model_runner as runner_module

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.7)  # fmt: skip
    prompt = [7, 7, 300, 12, 7]
    engine = make_engine(tiny_model)
    model, raw, given = engine.runner.model, [], []

    def model_then_keep(*args):
        raw.append(model(*args).clone())
        return raw[-1]

    def sample_then_keep(scores, ps, index):
        given.append(scores.clone())
        return real_sample(scores, ps, index)

    real_sample = runner_module.sample
    monkeypatch.setattr(engine.runner, "model", model_then_keep)
    monkeypatch.setattr(runner_module, "sample", sample_then_keep)
    [out], _ = _run_with_logprobs(engine, [prompt], params)
    assert len(given) == len(raw) == 8
    for i, (logits, scores) in enumerate(zip(raw, given)):
        want = logits[0].clone()
        reply = out[:i]
        for t in set(prompt + reply):
            want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
        for t in set(reply):
            want[t] -= 1.5 * reply.count(t) + 0.5
        assert torch.allclose(scores[0], want, atol=1e-6) and out[i] == int(want.argmax())


def test_seeded_sampling_with_penalties_is_the_same_batched_alone_and_after_a_handoff(tiny_model):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=-0.5, repetition_penalty=1.3)  # fmt: skip
    ps = prompts(4, seed=7)
    expected = reference(tiny_model, ps, params)
    engine = make_engine(tiny_model, policy="chunked", chunk_tokens=8)
    assert run_staggered(engine, ps, params, join_every=2) == expected
    prefill, decode = make_engine(tiny_model, role="prefill"), make_engine(tiny_model, role="decode")
    assert run_disaggregated(prefill, decode, ps, params) == expected
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0.0)


def test_min_tokens_holds_back_the_stop_tokens_until_then(tiny_model):
    """As vLLM: before min_tokens the eos and stop_token_ids cannot be sampled; after, they stop."""
    ps = prompts(2, seed=8)
    plain, _ = _run_with_logprobs(make_engine(tiny_model), ps, SamplingParams(max_tokens=12, temperature=0.0))
    stops = [out[1] for out in plain]  # each reply's second token
    for prompt, stop in zip(ps, stops):
        early, _ = _run_with_logprobs(make_engine(tiny_model), [prompt],
                                      SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))  # fmt: skip
        assert early == [[plain[ps.index(prompt)][0], stop]]
        held, _ = _run_with_logprobs(make_engine(tiny_model), [prompt],
                                     SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop], min_tokens=5))  # fmt: skip
        assert len(held[0]) >= 5 and stop not in held[0][:5]
        assert held[0][-1] == stop or len(held[0]) == 12
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=3, min_tokens=4)


@pytest.mark.parametrize("policy,chunk", [("prefill_first", 512), ("chunked", 5)])
def test_prompt_logprobs_score_each_prompt_token_as_a_prefill_of_the_text_before_it_would(tiny_model, policy, chunk):
    prompt = prompts(1, seed=10)[0][:20]
    engine = make_engine(tiny_model, policy=policy, chunk_tokens=chunk)
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    firsts = []
    while engine.has_unfinished():
        firsts += [out.prompt_logprobs for out in engine.step() if out.prompt_logprobs is not None]
    [entries] = firsts  # with the first token only
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        token, logprob, rank, top = entries[i]
        _, [[(chosen, fresh_top)]] = _run_with_logprobs(make_engine(tiny_model), [prompt[:i]],
                                                        SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))  # fmt: skip
        assert token == prompt[i] and [t for t, _ in top] == [t for t, _ in fresh_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in fresh_top], abs=1e-4)
        assert rank >= 1 and (rank <= 3) == (token in [t for t, _ in top])
        if token in dict(top):
            assert logprob == pytest.approx(dict(top)[token], abs=1e-6) and [t for t, _ in top].index(token) + 1 == rank
