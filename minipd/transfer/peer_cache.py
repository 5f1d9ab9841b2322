"""Writing a prompt's KV straight into a peer worker's KV cache (its blocks reserved as a seat).

On CPU the decode worker's cache lives in a named shared-memory segment that the prefill worker
maps once; on CUDA the prefill worker opens a CUDA IPC handle to it. The copy goes block run by
block run, cache to cache, with no staging buffer."""

from __future__ import annotations

import torch

from minipd.engine.handoff import KVSlots
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
            view = tensor_view(segment, shape, getattr(torch, dtype))
            view.view(torch.uint8).view(-1)[::4096].sum()  # map every page now, not during a handoff
            self._open[name] = (segment, view)
        return self._open[name][1]

    def drop(self, name: str) -> None:
        """Forget a peer's cache (the peer is gone; a new one gets a new name)."""
        segment, _ = self._open.pop(name, (None, None))
        try:
            if segment is not None:
                segment.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does

    def close(self) -> None:
        for segment, _ in self._open.values():
            try:
                if segment is not None:
                    segment.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        self._open.clear()


def tensor_view(segment, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    count = 1
    for d in shape:
        count *= d
    return torch.frombuffer(segment.buf, dtype=dtype, count=count).view(shape)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block lists are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: KVSlots, dst_cache: torch.Tensor, dst_blocks: list[int], hook=None) -> None:
    """Copy the KV of src's tokens into dst_blocks of dst_cache, block run by block run.
    hook(): called before each run (tests use it to slow the copy down)."""
    bs = src.block_size
    n_blocks = -(-src.num_tokens // bs)
    if len(dst_blocks) < n_blocks:
        raise ValueError(f"the seat has {len(dst_blocks)} blocks; the KV needs {n_blocks}")
    kv, layers, _, heads, dim = src.cache.shape
    s = src.cache.view(kv, layers, -1, bs, heads, dim)
    d = dst_cache.view(kv, layers, -1, bs, heads, dim)
    for a, b, n in block_runs(src.blocks[:n_blocks], dst_blocks[:n_blocks]):
        if hook is not None:
            hook()
        d[:, :, b : b + n].copy_(s[:, :, a : a + n])
