"""nn.Linear, except that on a CPU with AVX-512 (or AVX2 and NEON where it measured faster:
cpu_kernels.blocked_linear_in_use()) every float32 product runs on a copy of the weights
in column blocks (csrc/blocked_linear.cpp: at the memory's speed for a decode step's few rows, at
the core's FLOP rate for a prefill's many); elsewhere, and for bfloat16, the few rows of a decode
step go through minipd's CPU kernel, which streams the weights at close to memory speed (AVX-512,
AVX2 or NEON; see csrc/small_linear.cpp), the many rows of a prefill go through oneDNN (on AMD CPUs MKL's float32
GEMM takes a path without AVX-512: 100 GFLOP/s against oneDNN's 240 on one core there) except,
on a CPU without AVX-512, from the rows where MKL's AVX2 GEMM is the faster
(cpu_kernels.onednn_max_rows), and that it can hold its weights as int8 (weight-only
quantization, opt-in)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from minipd.models import cpu_kernels


class Linear(nn.Linear):
    small_rows = 0  # rows up to which the small-row kernel runs (0: off); set by use_cpu_kernels()
    onednn_rows = 0  # rows up to which a product runs in oneDNN (0: never); set by use_cpu_kernels()
    widen = False  # bfloat16 weights widened to float32 for a product of many rows; set by use_cpu_kernels()
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (prefill), or None
    blocked: torch.Tensor | None = None  # the weight in blocked_linear's column blocks, or None
    blocked_rows = sys.maxsize  # rows up to which a product runs on the blocks; set by use_cpu_kernels()
    int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (weights (N, K) int8, per-row scales bf16), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), *self.int8).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.blocked is not None and x.dim() == 2 and x.shape[0] <= self.blocked_rows:
            return torch.ops.minipd.blocked_linear(x, self.blocked, self.bias)
        if x.dim() == 2 and 0 < x.shape[0] <= self.small_rows:
            return torch.ops.minipd.small_linear(x, self.weight, self.bias)
        if x.dim() == 2 and 0 < x.shape[0] <= self.onednn_rows:
            w = self.weight if self.packed is None else self.packed
            return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")
        if self.widen:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def use_cpu_kernels(model: nn.Module, on: bool = True, prepack: bool = True) -> bool:
    """Turn minipd's CPU kernels on (or off) for a float32 or bfloat16 CPU model, where they are
    built: the small-row kernel in every Linear and the fused element-wise steps (RMSNorm,
    SiLU * up, rotary embedding) in every module that has a `fused` switch (both dtypes), and
    oneDNN (float32).
    With prepack, where blocked_linear is in use (AVX-512, cpu_kernels.BLOCKED_ISAS; elsewhere where
    it measured faster, blocked_choice.py), each float32
    Linear, the LM head too, keeps a copy of its weight in blocked_linear's column blocks and runs
    every product on it, or, where it measured faster only for a decode step's rows, the products of
    up to cpu_kernels.blocked_linear_rows() rows (the rest as below, so each Linear but the head then
    holds three copies of its weight). Elsewhere each float32 Linear but the LM head (it is the embedding, tied)
    keeps a copy of its weight in oneDNN's blocked layout: prefill's products run 5-14% faster from it (up to
    cpu_kernels.onednn_max_rows(); beyond, MKL's product on the plain weights), and on
    AVX-512 from 3 rows on oneDNN reads it as fast as the small-row kernel reads the plain weights,
    or faster (on AVX2 it does not: cpu_kernels.ROWS_BESIDE_PACKED; scripts/bench_small_linear.py);
    the cost is a second copy of the layers' weights in memory. On a CPU without bfloat16
    instructions, a bfloat16 product of many rows widens the weights to float32 for the call
    (PyTorch's bfloat16 product runs 6x slower there than float32). Returns whether the
    small-row kernel is on."""
    p = next(model.parameters())
    cpu = on and p.device.type == "cpu"
    cpu32 = cpu and p.dtype == torch.float32
    bf16 = cpu and p.dtype == torch.bfloat16
    small = (cpu32 or bf16) and cpu_kernels.small_linear_available()
    onednn = cpu32 and torch.backends.mkldnn.is_available()
    fused = (cpu32 or bf16) and cpu_kernels.available()
    widen = bf16 and not cpu_kernels.native_bfloat16()
    blocked_rows = cpu_kernels.blocked_linear_rows() if (cpu32 or bf16) and prepack else 0
    blocks = blocked_rows > 0 and (cpu32 or cpu_kernels.blocked_bfloat16())
    # bfloat16 widened in the blocks: slower than MKL on widened weights from 512 rows (Zen 1 AVX2)
    if blocks and bf16 and not cpu_kernels.blocked_bfloat16_dot():
        blocked_rows = min(blocked_rows, cpu_kernels.MKL_FROM_ROWS_WITHOUT_AVX512 - 1)
    blocks_take_all = blocks and blocked_rows == sys.maxsize  # else oneDNN's packed copy takes the rows beyond
    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if isinstance(m, Linear):
            block = blocks and m.int8 is None and m.out_features % cpu_kernels.block_columns() == 0
            block = block and (cpu32 or m.in_features % 2 == 0)  # bfloat16 blocks take K in pairs
            if block and (m.blocked is None or m.blocked.dtype != m.weight.dtype):
                m.blocked = torch.ops.minipd.blocked_weight(m.weight.detach())
            elif not block:
                m.blocked = None
            pack = onednn and prepack and m.int8 is None and m is not head and not (block and blocks_take_all)
            if pack and m.packed is None:
                m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1024)
            elif not pack:
                m.packed = None
            m.small_rows = (cpu_kernels.small_rows_beside_packed() if pack else cpu_kernels.SMALL_LINEAR_MAX_ROWS) if small else 0
            m.onednn_rows = cpu_kernels.onednn_max_rows() if onednn else 0
            m.blocked_rows = blocked_rows
            m.widen = widen
        if hasattr(type(m), "fused"):
            m.fused = fused
    if hasattr(model, "plan_decode_layers"):
        model.plan_decode_layers()
    return small


def quantize_int8(model: nn.Module) -> None:
    """Weight-only int8, one symmetric scale per output row; activations in bfloat16. Opt-in:
    float32 stays the default and the one that matches transformers token for token."""
    for m in model.modules():
        if isinstance(m, Linear):
            w = m.weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            m.int8 = ((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16))
            m.blocked = m.packed = None  # int8 runs first: the faster layouts' copies would only hold memory
    if hasattr(model, "plan_decode_layers"):  # int8 layers run in Python: the one-call decode stops
        model.plan_decode_layers()
