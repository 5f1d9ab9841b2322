"""Other Llama-family checkpoints, as Hugging Face folders (config.json + safetensors):
random-weight models built with transformers, saved, loaded by minipd, compared with `generate`."""

import pytest
import torch

from minipd import LLM, SamplingParams

CONFIGS = {
    "llama3-rope-scaling": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64},
                                                rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2-qkv-bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_folder_matches_transformers_generate(tmp_path, name):
    import transformers

    cls, extra = CONFIGS[name]
    cfg = getattr(transformers, cls)(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     eos_token_id=None, bos_token_id=None, **extra)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)  # large enough that greedy tokens differ from step to step
    hf.save_pretrained(tmp_path)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 120)), [7] * 33]
    with torch.no_grad():
        want = []
        for p in prompts:
            x = torch.tensor([p])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
            want.append(y[0, len(p):].tolist())
    llm = LLM(model=str(tmp_path), policy="chunked", chunk_tokens=16, kv_cache_tokens=1024)
    assert llm.tokenizer is None
    got = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in got] == want
    assert len(set(want[1])) > 1


def test_bfloat16_runs_and_batching_does_not_change_it(tiny_model):
    llm = LLM(model="tiny-random", dtype="bfloat16", policy="chunked", chunk_tokens=8)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 8 for t in together)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16


def test_a_checkpoint_missing_a_projection_is_refused_by_name():
    from minipd.models.files import tiny_random_config
    from minipd.models.llama import LlamaForCausalLM, stack_projections

    model = LlamaForCausalLM(tiny_random_config(vocab_size=64))
    hf = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert stack_projections({"a.q_proj.weight": torch.ones(2, 3), "a.k_proj.weight": torch.zeros(1, 3),
                              "a.v_proj.weight": torch.zeros(1, 3)})["a.qkv_proj.weight"].shape == (4, 3)  # fmt: skip
    parts = {}
    for name, tensor in list(hf.items()):  # unstack into the checkpoint's own names
        if ".qkv_proj." in name:
            q, k, v = tensor.split([64, 32, 32])
            del hf[name]
            parts.update({name.replace("qkv_proj", "q_proj"): q, name.replace("qkv_proj", "k_proj"): k,
                          name.replace("qkv_proj", "v_proj"): v})  # fmt: skip
    hf.update(parts)
    model.load_hf_weights(dict(hf))  # complete: loads
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.\{q_proj,k_proj,v_proj\}\.weight"):
        model.load_hf_weights(hf)
