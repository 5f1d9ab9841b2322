from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Hands out KV blocks by id. Torch-free: it only counts.

    A reservation sets blocks aside for a future owner (a decode seat in disagg):
    they are not free for anyone else, and `allocate(..., reservation=key)` draws on them.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reserved: dict[str, int] = {}
        self._num_reserved = 0

    @property
    def num_free(self) -> int:
        """Blocks anyone may take now (free minus reserved)."""
        return len(self._free) - self._num_reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    def usage(self) -> float:
        return (self.num_used + self._num_reserved) / self.num_blocks

    def can_allocate(self, n: int, reservation: str | None = None) -> bool:
        return n <= self.num_free + self._reserved.get(reservation, 0)

    def allocate(self, n: int, reservation: str | None = None) -> list[int]:
        if not self.can_allocate(n, reservation):
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        if reservation is not None and reservation in self._reserved:
            from_reservation = min(n, self._reserved[reservation])
            self._reserved[reservation] -= from_reservation
            self._num_reserved -= from_reservation
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

    def reserve(self, key: str, n: int) -> bool:
        """Set n blocks aside for `key`; False (nothing reserved) if there is no room."""
        if key in self._reserved:
            raise ValueError(f"reservation {key!r} already exists")
        if n > self.num_free:
            return False
        self._reserved[key] = n
        self._num_reserved += n
        return True

    def release(self, key: str) -> int:
        """Give back what is left of a reservation; returns how many blocks that was."""
        n = self._reserved.pop(key, 0)
        self._num_reserved -= n
        return n

    def has_reservation(self, key: str) -> bool:
        return key in self._reserved

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        for i, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {i} has ref count {rc}"
            assert (rc == 0) == (i in free), f"block {i}: ref count {rc} but free={i in free}"
        assert len(self._free) + self.num_used == self.num_blocks
        assert self._num_reserved == sum(self._reserved.values()) and self._num_reserved >= 0
        assert self._num_reserved <= len(self._free), "more reserved than free"
