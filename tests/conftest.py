from __future__ import annotations

import pytest
import torch

from minipd.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.models.files import resolve
from minipd.models.loader import load_model
from minipd.tokenizer import load_tokenizer

torch.set_num_threads(2)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="session")
def default_model():
    return load_model(None, torch.float32, "cpu")


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer):
    out = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="session")
def hf_greedy(chat_prompt_ids):
    """Hugging Face transformers `generate`, float32, greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in chat_prompt_ids:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("tiny-random", torch.float32, "cpu")


def make_engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny-random" if model.config.num_layers == 2 else None, **kw), model=model)


@pytest.fixture(scope="session", autouse=True)
def server_logs_under_tmp_path(tmp_path_factory):
    from minipd.bench.server_process import ServerProcess

    ServerProcess.log_dir = str(tmp_path_factory.mktemp("server-logs"))
