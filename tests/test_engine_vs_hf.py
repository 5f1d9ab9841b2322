"""Greedy float32 output of the default model equals transformers `generate`, token for token."""

import pytest

from minipd.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.helpers import run_disaggregated, run_staggered

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)

pytestmark = pytest.mark.slow


def test_hf_reference_is_long_enough(hf_greedy):
    assert len(hf_greedy) >= 5
    assert sum(len(o) for o in hf_greedy) >= 5 * 8


@pytest.mark.parametrize(
    "policy,chunk",
    [("prefill_first", 512), ("chunked", 16), ("chunked", 64), ("chunked", 512)],
)
def test_continuous_batching_matches_hf(default_model, chat_prompt_ids, hf_greedy, policy, chunk):
    engine = make_engine(default_model, policy=policy, chunk_tokens=chunk, kv_cache_tokens=4096)
    got = run_staggered(engine, chat_prompt_ids, GREEDY, join_every=3)
    assert got == hf_greedy
    assert engine.blocks.num_used == 0
    engine.blocks.check_integrity()


def test_plain_weights_without_prepacking_match_hf(default_model, chat_prompt_ids, hf_greedy):
    """--no-prepack: every product from the plain weights (the small-row kernel up to 8 rows)."""
    engine = make_engine(default_model, prepack=False, kv_cache_tokens=4096)
    try:
        assert all(m.packed is None for m in default_model.modules() if hasattr(m, "packed"))
        assert run_staggered(engine, chat_prompt_ids, GREEDY, join_every=3) == hf_greedy
    finally:
        make_engine(default_model, kv_cache_tokens=64)  # packs again, for the tests after this one


def test_export_import_matches_hf(default_model, chat_prompt_ids, hf_greedy):
    """Prefill on one engine, hand the KV to a second engine, decode there."""
    prefill = make_engine(default_model, role="prefill", kv_cache_tokens=4096)
    decode = make_engine(default_model, role="decode", kv_cache_tokens=4096)
    assert run_disaggregated(prefill, decode, chat_prompt_ids, GREEDY) == hf_greedy
    for e in (prefill, decode):
        assert e.blocks.num_used == 0 and e.blocks.num_seated == 0
        e.blocks.check_integrity()
