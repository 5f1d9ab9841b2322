"""nn.Linear, except that the few rows of a decode step go through minipd's CPU kernel, which
streams the weights at close to memory speed (float32, AVX-512; see csrc/small_linear.cpp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipd.models import cpu_kernels


class Linear(nn.Linear):
    small_rows = False  # set by use_cpu_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_rows and x.dim() == 2 and 0 < x.shape[0] <= cpu_kernels.SMALL_LINEAR_MAX_ROWS:
            return torch.ops.minipd.small_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_cpu_kernels(model: nn.Module) -> bool:
    """Turn the small-row kernel on for every Linear of a float32 CPU model, when it is built."""
    p = next(model.parameters())
    on = p.device.type == "cpu" and p.dtype == torch.float32 and cpu_kernels.small_linear_available()
    for m in model.modules():
        if isinstance(m, Linear):
            m.small_rows = on
    return on
