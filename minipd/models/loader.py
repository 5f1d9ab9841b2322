"""Load a model's weights into minipd's Llama (files are found by models/files.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from minipd.models.files import ModelNotFound, read_config, resolve, tiny_random_config
from minipd.models.llama import LlamaForCausalLM
from minipd.models.rope import RotaryEmbedding


def load_model(model: str | None, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    folder = resolve(model)
    if folder is None:
        cfg = tiny_random_config()
        torch.manual_seed(0)
        net = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    else:
        cfg = read_config(folder)
        with torch.device("meta"):
            net = LlamaForCausalLM(cfg)
        net = net.to_empty(device="cpu")
        net.tie_weights()
        net.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        net.load_hf_weights(_read_safetensors(folder))
    return net.to(device=device, dtype=dtype).eval()


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise ModelNotFound(f"no .safetensors weights in {folder}")
    return weights
