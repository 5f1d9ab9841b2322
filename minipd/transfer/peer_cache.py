"""Writing a prompt's KV straight into a peer worker's KV cache (its blocks reserved as a seat).

On CPU the decode worker's cache lives in a named shared-memory segment that the prefill worker
maps once; on CUDA the prefill worker opens a CUDA IPC handle to it. The copy goes block run by
block run, cache to cache, with no staging buffer."""

from __future__ import annotations

import torch

from minipd.transfer import shm


class PeerCaches:
    def __init__(self):
        self._open: dict[str, tuple[object, torch.Tensor]] = {}

    def get(self, name: str, shape: list[int], dtype: str, cuda_handle: bytes | None = None) -> torch.Tensor:
        if cuda_handle is not None:
            if name not in self._open:
                from minipd.transfer.cuda_ipc import open_handle

                self._open[name] = (None, open_handle(cuda_handle))
            return self._open[name][1]
        if name not in self._open:
            segment = shm.open_segment(name)
            view = shm.tensor_view(segment, shape, getattr(torch, dtype))
            view.view(torch.uint8).view(-1)[::4096].sum()  # map every page now, not during a handoff
            self._open[name] = (segment, view)
        return self._open[name][1]

    def close(self) -> None:
        for segment, _ in self._open.values():
            try:
                if segment is not None:
                    segment.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        self._open.clear()


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block lists are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src_cache: torch.Tensor, src_blocks: list[int], dst_cache: torch.Tensor, dst_blocks: list[int],
                num_tokens: int, block_size: int) -> None:  # fmt: skip
    """Copy the KV of the first num_tokens from src blocks to dst blocks, cache to cache."""
    n_blocks = -(-num_tokens // block_size)
    if len(dst_blocks) < n_blocks:
        raise ValueError(f"the seat has {len(dst_blocks)} blocks; the KV needs {n_blocks}")
    kv, layers, _, heads, dim = src_cache.shape
    src = src_cache.view(kv, layers, -1, block_size, heads, dim)
    dst = dst_cache.view(kv, layers, -1, block_size, heads, dim)
    for s, d, n in block_runs(src_blocks[:n_blocks], dst_blocks[:n_blocks]):
        dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
