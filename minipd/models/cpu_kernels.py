"""minipd's CPU kernels (csrc/): attention read in place from the paged cache (decode, and a
flash-attention-style prefill for float32), a linear layer for the few rows of a decode step, and
the fused element-wise steps of a layer. Built once for the CPU they run on (kernel_build names
the build and runs it in a child before the workers spawn), with the machine's compiler through
torch.utils.cpp_extension, and registered with torch.library as torch.ops.minipd.*. If they cannot
be built, the portable PyTorch paths are used (slower, same results up to float rounding)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from minipd.models import blocked_choice, kernel_build

log = logging.getLogger("minipd.kernel")
_state: dict = {}
SMALL_LINEAR_MAX_ROWS = 8
# rows up to which small_linear beats oneDNN's product on prepacked weights (scripts/bench_small_linear.py):
# on the AVX-512 EPYC oneDNN packed is as fast from 3 rows; on the AVX2 EPYC small_linear is faster at
# every row count to 8. Other ISAs are unmeasured: the kernel's own limit.
ROWS_BESIDE_PACKED = {"avx512": 2}
# builds whose product on column-blocked weights (csrc/blocked_linear.cpp) runs every float32 product
# of a Linear, in place of small_linear and oneDNN's prepacked product: on the AVX-512 EPYC (Zen 4)
# it read the default model's weights 1.5x faster than small_linear at 1-2 rows, 1.7x faster than
# oneDNN packed at 8 and 1.1x at 32, and multiplied as fast as oneDNN packed at 64-2,048 rows
# (scripts/bench_small_linear.py). Elsewhere (kernel_build.MEASURED_BLOCKED_ISAS) it is measured
# once per build against the paths it would replace (blocked_choice.py).
BLOCKED_ISAS = ("avx512",)
PREFILL_HEAD_DIMS = (16, 32, 48, 64, 128, 192, 256)
# rows from which MKL's float32 product (F.linear) beats oneDNN's on prepacked weights: on the AVX2
# EPYC (no AVX-512) oneDNN is 4-15% faster to 256 rows, even to 8% behind at 512, MKL 10-12% faster
# from 1,024 (scripts/bench_prefill_linear.py). With AVX-512, MKL takes a path without it on AMD
# CPUs: oneDNN at every size there (see linear.py).
MKL_FROM_ROWS_WITHOUT_AVX512 = 512


def available() -> bool:
    if "ok" not in _state:
        _state["ok"] = _build()
    return _state["ok"]


def error() -> str:
    return _state.get("error", "")


def kernel_isa() -> str | None:
    """The instruction set the kernels were built for (csrc/vec.h): avx512, avx2, neon or scalar;
    None when they were not built."""
    return str(torch.ops.minipd.kernel_isa()) if available() else None


def small_linear_available() -> bool:
    """The kernels that need vectors to pay (small_linear, paged_prefill): built for a vector ISA
    and run on a CPU that reports it."""
    if "small_linear" not in _state:
        _state["small_linear"] = kernel_build.vector_kernels_usable(kernel_isa(), kernel_build.cpu_flags())
    return _state["small_linear"]


def native_bfloat16() -> bool:
    return bool(kernel_build.bfloat16_instructions(kernel_build.cpu_flags()))


def bfloat16_dot() -> bool:
    """small_linear multiplies bfloat16 with the CPU's dot-product instruction (built with AVX512-BF16
    or ARM's BF16);
    otherwise it widens bfloat16 to float32 in registers."""
    return available() and bool(torch.ops.minipd.bfloat16_dot())


def prefill_bfloat16_dot() -> bool:
    """Prefill attention multiplies bfloat16 in vdpbf16ps, p rounded to bfloat16 for p * V, and
    decode attention the keys' dot products (both built for AVX512-BF16); otherwise they widen it."""
    return available() and bool(torch.ops.minipd.prefill_bfloat16_dot())


BLOCKED_ENV = kernel_build.BLOCKED_ENV  # 1 or 0: blocked_linear on or off wherever the vector kernels run


def blocked_linear_rows() -> int:
    """Rows up to which a float32 Linear with prepacked weights multiplies them in column blocks with
    minipd's blocked_linear: every product (sys.maxsize) on BLOCKED_ISAS or with MINIPD_BLOCKED_LINEAR=1,
    none (0), or as far as blocked_choice.py measured it faster on this CPU."""
    isa = kernel_isa()
    if not kernel_build.vector_kernels_usable(isa, kernel_build.cpu_flags()):
        return 0
    forced = os.environ.get(BLOCKED_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{BLOCKED_ENV}={forced!r}: expected 1 (on), 0 (off) or unset (the ISA's default)")
    if forced:
        return sys.maxsize if forced == "1" else 0
    if isa in BLOCKED_ISAS:
        return sys.maxsize
    if "blocked" not in _state:
        measured = isa in kernel_build.MEASURED_BLOCKED_ISAS
        _state["blocked"] = blocked_choice.rows_of(blocked_choice.choice()) if measured else 0
    return _state["blocked"]


def blocked_linear_in_use() -> bool:
    """Whether blocked_linear runs any product here (blocked_linear_rows)."""
    return blocked_linear_rows() > 0


def blocked_bfloat16() -> bool:
    """blocked_linear multiplies bfloat16 too: in vdpbf16ps where built for AVX512-BF16
    (blocked_bfloat16_dot), else widened to float32 in registers."""
    return available() and bool(torch.ops.minipd.blocked_bfloat16())


def blocked_bfloat16_dot() -> bool:
    """blocked_linear's bfloat16 blocks take K in pairs for vdpbf16ps (built for AVX512-BF16)."""
    return available() and bool(torch.ops.minipd.blocked_bfloat16_dot())


def block_columns() -> int:
    """Output columns per block of blocked_weight: a layer is blocked only if it has a multiple."""
    return int(torch.ops.minipd.block_columns())


def small_rows_beside_packed() -> int:
    return ROWS_BESIDE_PACKED.get(kernel_isa() or "", SMALL_LINEAR_MAX_ROWS)


def onednn_max_rows() -> int:
    """Rows up to which a float32 product goes through oneDNN (more: MKL, through F.linear)."""
    flags = kernel_build.cpu_flags()
    if "avx2" in flags and "avx512f" not in flags:
        return MKL_FROM_ROWS_WITHOUT_AVX512 - 1
    return sys.maxsize


def paged_prefill_available(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and head_dim in PREFILL_HEAD_DIMS and small_linear_available()


def _build() -> bool:
    if os.environ.get("MINIPD_NO_KERNEL"):
        return False
    try:
        _load(kernel_build.extension_name(), kernel_build.build_directory())
        return hasattr(torch.ops.minipd, "paged_attention")
    except Exception as err:  # no compiler, no headers, no ninja: the portable path still works
        _state["error"] = _one_line(err)
        log.warning("the CPU kernels could not be built (%s); %s", _state["error"], kernel_build.PORTABLE)
        return False


def _one_line(err: Exception) -> str:
    """The line that says why, out of torch's message and ninja's output (commands, progress)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    said = [line for line in lines[1:] if not line.startswith(("[", "FAILED:", "ninja:")) and " -o " not in line]
    return next((line for line in said if "error" in line.lower()), said[0] if said else lines[0])[:300]


def _load(name: str, folder: Path) -> None:
    library = folder / f"{name}.so"
    if library.is_file():  # built before the workers spawned: no lock, no ninja
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # cut short by a killed link: ninja builds it again
            pass
    ninja = kernel_build.ninja_path()
    if ninja is None:
        raise RuntimeError(kernel_build.NINJA_MISSING)
    if shutil.which("ninja") is None:  # torch runs `ninja`: found next to this python only
        os.environ["PATH"] = os.pathsep.join([str(Path(ninja).parent), os.environ.get("PATH", "")])
    folder.mkdir(parents=True, exist_ok=True)
    if note := kernel_build.wait_for_lock(folder / "lock"):
        log.warning("minipd: %s", note)
    from torch.utils.cpp_extension import load

    sources = [str(p) for p in sorted(kernel_build.CSRC.glob("*.cpp"))]
    load(
        name=name,
        sources=sources,
        extra_cflags=kernel_build.cflags(),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


if __name__ == "__main__":  # the build, in the child kernel_build.build_in_child() starts
    print("ok" if available() else error())
    if available() and kernel_build.blocked_choice_due(kernel_isa()):
        blocked_linear_in_use()  # measured here, before the workers spawn, and kept with the build
    sys.exit(0 if available() else 1)
