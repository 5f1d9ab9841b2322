"""CUDA IPC between worker processes on one node: a decode worker shares a handle to its KV cache
once; a prefill worker opens it and copies the prompt's KV device to device into the seat
(through NVLink or PCIe peer access when the two workers sit on different GPUs).

Uses torch.multiprocessing's own CUDA tensor sharing (reduce_tensor / its rebuild function)."""

from __future__ import annotations

import pickle

import torch


def export_handle(cache: torch.Tensor) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(cache)
    return pickle.dumps((rebuild, args))


def open_handle(handle: bytes) -> torch.Tensor:
    rebuild, args = pickle.loads(handle)  # from our own worker over a local socket
    return rebuild(*args)
