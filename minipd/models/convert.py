"""Turn a GGUF file into a Hugging Face-style folder (safetensors, config, tokenizer), through
transformers. Run as `python -m minipd.models.convert FILE.gguf OUT_DIR` by the server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    tied = cfg.get("tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


if __name__ == "__main__":
    convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
