from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    policy: str = "prefill_first"
    role: str = "both"
    chunk_tokens: int = 512
    block_size: int = 16
    kv_cache_tokens: int = 16384
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    threads: int | None = None
    quantization: str | None = None  # "int8": weight-only int8 linears (opt-in)
    prepack: bool = True  # cpu: layers' weights also in a faster layout (AVX-512: column blocks; else oneDNN's, float32)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device.startswith("cuda"):
            self.device = _cuda_device(self.device)
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.quantization == "int8" and self.device != "cpu":
            raise ValueError(f"quantization int8 runs on cpu only (its int8 matmul is untested on {self.device})")
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ValueError("need block_size >= 1 and kv_cache_tokens >= block_size")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


def _cuda_device(device: str) -> str:
    """'cuda' -> 'cuda:N' with N the current card, so that every use (set_device among them) names one."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but torch sees no CUDA device")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device cuda:{index} was asked for but torch sees {torch.cuda.device_count()} CUDA devices")
    return f"cuda:{index}"
