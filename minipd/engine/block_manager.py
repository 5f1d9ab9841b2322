from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Hands out KV blocks by id. Torch-free: it only counts.

    A reservation allocates blocks ahead for a future owner (a decode seat in disagg: the
    prefill worker writes the prompt's KV straight into these blocks). `claim` hands them to
    the owner; `release` frees them if the owner never comes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reserved: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks not free, reserved ones included."""
        return self.num_blocks - len(self._free)

    @property
    def num_reserved(self) -> int:
        return sum(len(ids) for ids in self._reserved.values())

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref_counts[i] <= 0:
                raise ValueError(f"block {i} is not allocated")
            self._ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref_counts[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)

    def reserve(self, key: str, n: int) -> list[int] | None:
        """Allocate n blocks ahead for `key`; None (nothing taken) if there is no room."""
        if key in self._reserved:
            raise ValueError(f"reservation {key!r} already exists")
        if not self.can_allocate(n):
            return None
        self._reserved[key] = self.allocate(n)
        return list(self._reserved[key])

    def claim(self, key: str) -> list[int]:
        """The reserved blocks, now owned by the caller (who frees them later)."""
        return self._reserved.pop(key)

    def release(self, key: str) -> int:
        """Free a reservation nobody claimed; returns how many blocks that was."""
        ids = self._reserved.pop(key, [])
        self.free(ids)
        return len(ids)

    def reserved_blocks(self, key: str) -> list[int]:
        return self._reserved[key]

    def has_reservation(self, key: str) -> bool:
        return key in self._reserved

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        for i, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {i} has ref count {rc}"
            assert (rc == 0) == (i in free), f"block {i}: ref count {rc} but free={i in free}"
        assert len(self._free) + self.num_used == self.num_blocks
        reserved = [i for ids in self._reserved.values() for i in ids]
        assert len(reserved) == len(set(reserved)) and not free.intersection(reserved)
