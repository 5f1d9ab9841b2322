"""Workloads: reproducible, arrivals at the asked rate, gamma burstiness, lengths in bounds."""

from __future__ import annotations

import numpy as np
import pytest

from minipd.bench.workloads import clip_to_model_len, make_workload, prompt_token_ids


def lengths(reqs):
    return np.array([r.prompt_len for r in reqs]), np.array([r.output_len for r in reqs])


def gaps(reqs):
    return np.diff([r.arrival for r in reqs])


def test_reproducible_from_the_seed():
    a = make_workload("mixed", num_prompts=200, rate=3, seed=7)
    assert a == make_workload("mixed", num_prompts=200, rate=3, seed=7)
    assert a != make_workload("mixed", num_prompts=200, rate=3, seed=8)
    assert [r.index for r in a] == list(range(200))
    b = make_workload("mixed", num_prompts=200, rate=9, seed=7)  # same requests, other arrival times
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]
    assert [r.arrival for r in a] != [r.arrival for r in b]


def test_poisson_arrivals_have_the_asked_mean_rate():
    reqs = make_workload("fixed", num_prompts=20000, rate=5.0, input_len=8, output_len=4)
    assert reqs[0].arrival == 0.0
    g = gaps(reqs)
    assert np.all(g >= 0)
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_changes_the_variance(burstiness):
    g = gaps(make_workload("fixed", num_prompts=20000, rate=5.0, burstiness=burstiness, input_len=8, output_len=4))
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)  # gamma: CV = 1/sqrt(shape)


def test_infinite_rate_and_duration_bounds():
    assert {r.arrival for r in make_workload("chat", num_prompts=10, rate=float("inf"))} == {0.0}
    with pytest.raises(ValueError):
        make_workload("chat", duration=5, rate=float("inf"))
    reqs = make_workload("chat", duration=200.0, rate=4.0, seed=3)
    assert all(r.arrival < 200.0 for r in reqs)
    assert len(reqs) == pytest.approx(800, rel=0.15)
    both = make_workload("chat", num_prompts=50, duration=200.0, rate=4.0, seed=3)
    assert len(both) == 50
    with pytest.raises(ValueError):
        make_workload("chat", rate=1.0)


def test_full_size_lengths_follow_the_published_shapes():
    p, o = lengths(make_workload("chat", num_prompts=5000, rate=1.0))
    assert p.min() >= 4 and p.max() <= 1024 and (p + o).max() <= 2048 and o.min() >= 4
    assert 120 < p.mean() < 200 and 250 < o.mean() < 400  # vLLM paper: means 161 and 338 before clipping
    p, o = lengths(make_workload("summarize", num_prompts=2000, rate=1.0))
    assert p.min() >= 1024 and 2000 < np.median(p) < 4500
    assert o.min() >= 32 and o.max() <= 512 and 100 < np.median(o) < 200


def test_lengths_fit_max_model_len():
    for name in ("chat", "summarize", "mixed"):
        p, o = lengths(make_workload(name, num_prompts=500, rate=1.0, max_model_len=1024))
        assert (p + o).max() <= 1024 and p.min() >= 1 and o.min() >= 1
    assert clip_to_model_len(8000, 150, 2048) == (1898, 150)
    assert clip_to_model_len(3000, 6000, 2048) == (1024, 1024)
    assert clip_to_model_len(10, 20, 2048) == (10, 20)


def test_quick_sizes_are_small():
    p, o = lengths(make_workload("chat", num_prompts=1000, rate=1.0, quick=True))
    assert p.min() >= 50 and p.max() <= 300 and o.min() >= 16 and o.max() <= 64
    p, o = lengths(make_workload("summarize", num_prompts=1000, rate=1.0, quick=True))
    assert p.min() >= 600 and p.max() <= 1500 and o.min() >= 16 and o.max() <= 32
    p, _ = lengths(make_workload("mixed", num_prompts=2000, rate=1.0, quick=True))
    assert np.mean(p >= 600) == pytest.approx(0.2, abs=0.04)  # summarize share of the mix


def test_fixed_workload():
    reqs = make_workload("fixed", num_prompts=5, rate=1.0, input_len=100, output_len=20)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(100, 20)}
    with pytest.raises(ValueError):
        make_workload("fixed", num_prompts=5, rate=1.0)
    with pytest.raises(ValueError):
        make_workload("nope", num_prompts=5, rate=1.0)


def test_prompt_token_ids_are_deterministic_and_safe():
    reqs = make_workload("chat", num_prompts=20, rate=1.0, quick=True)
    ids = prompt_token_ids(reqs[3], seed=0)
    assert len(ids) == reqs[3].prompt_len
    assert ids == prompt_token_ids(reqs[3], seed=0)
    assert ids != prompt_token_ids(reqs[3], seed=1)
    assert ids != prompt_token_ids(reqs[4], seed=0)[: len(ids)]
    assert min(ids) >= 100 and max(ids) < 49152 - 100
    small = prompt_token_ids(reqs[3], seed=0, vocab_size=256)
    assert all(isinstance(i, int) and 0 <= i < 256 for i in small)
