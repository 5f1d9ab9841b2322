"""minipd's CPU kernels (csrc/): attention read in place from the paged cache (decode, and a
flash-attention-style prefill for float32), a linear layer for the few rows of a decode step, and
the fused element-wise steps of a layer. Built once, on first use, with the machine's compiler
through torch.utils.cpp_extension (cached under ~/.cache/torch_extensions), and registered with
torch.library as torch.ops.minipd.*. If they cannot be built, the portable PyTorch paths are used
(slower, same results up to float rounding)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("minipd.kernel")
_state: dict = {}
SMALL_LINEAR_MAX_ROWS = 8


def available() -> bool:
    if "ok" not in _state:
        _state["ok"] = _build()
    return _state["ok"]


def small_linear_available() -> bool:
    if "small_linear" not in _state:
        _state["small_linear"] = available() and torch.ops.minipd.small_linear_supported()
    return _state["small_linear"]


PREFILL_HEAD_DIMS = (16, 32, 48, 64, 128, 192, 256)


def paged_prefill_available(dtype: torch.dtype, head_dim: int) -> bool:
    """The prefill kernel: float32, AVX-512 (the same build test as the small-row kernel)."""
    return dtype == torch.float32 and head_dim in PREFILL_HEAD_DIMS and small_linear_available()


def _build() -> bool:
    if os.environ.get("MINIPD_NO_KERNEL"):
        return False
    try:
        from torch.utils.cpp_extension import load

        files = sorted((Path(__file__).parent / "csrc").iterdir())
        sources = [str(p) for p in files if p.suffix == ".cpp"]
        digest = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()[:10]  # headers too
        load(name=f"minipd_cpu_kernels_{digest}", sources=sources, is_python_module=False, verbose=False,
             extra_cflags=["-O3", "-march=native", "-ffast-math", "-funroll-loops"])  # fmt: skip
        return hasattr(torch.ops.minipd, "paged_attention")
    except Exception as err:  # no compiler, no headers: the portable path still works
        log.warning("the paged-attention CPU kernel could not be built (%s); using the gather path", err)
        return False
