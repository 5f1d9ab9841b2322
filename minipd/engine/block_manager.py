from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Hands out KV blocks by id. Torch-free: it only counts.

    A seat is a set of blocks allocated ahead for a request whose KV a peer will write (the decode
    side of a handoff). A seat may also book headroom: blocks promised to that request's later
    growth, which no one else may take, so that decoding never has to preempt (vLLM's watermark,
    SGLang's reserved decode tokens). Blocks booked by an owner are taken first when it grows.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._seats: dict[str, list[int]] = {}
        self._booked: dict[str, int] = {}  # owner -> blocks promised but not yet allocated
        self._num_booked = 0  # their sum, kept: it is read at every allocation

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks not free, seats included."""
        return self.num_blocks - len(self._free)

    @property
    def num_seated(self) -> int:
        return sum(len(ids) for ids in self._seats.values())

    @property
    def num_booked(self) -> int:
        return self._num_booked

    @property
    def num_available(self) -> int:
        """Free blocks that nobody has booked."""
        return len(self._free) - self._num_booked

    def booked_by(self, owner: str) -> int:
        return self._booked.get(owner, 0)

    def can_allocate(self, n: int, owner: str | None = None) -> bool:
        return n <= self.num_available + self._booked.get(owner, 0)

    def allocate(self, n: int, owner: str | None = None) -> list[int]:
        if not self.can_allocate(n, owner):
            raise OutOfBlocks(f"need {n} blocks, {self.num_available} available")
        if owner in self._booked:
            self._use_booking(owner, n)
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def allocate_each(self, owners: list[str]) -> list[int]:
        """One block for each owner in turn: allocate(1, owner) for each, in one call (all or none)."""
        free, refs, booked, ids = self._free, self._ref_counts, self._booked, []
        wanted: dict[str, int] = {}
        for owner in owners:
            wanted[owner] = wanted.get(owner, 0) + 1
        beyond_bookings = sum(max(0, n - booked.get(owner, 0)) for owner, n in wanted.items())
        if beyond_bookings > self.num_available:
            raise OutOfBlocks(f"need {beyond_bookings} blocks beyond bookings, {self.num_available} available")
        for owner in owners:
            if owner in booked:
                self._use_booking(owner, 1)
            i = free.popleft()
            refs[i] = 1
            ids.append(i)
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

    def book(self, owner: str, n: int) -> None:
        """Promise n more free blocks to `owner`'s growth."""
        if n > self.num_available:
            raise OutOfBlocks(f"cannot book {n} blocks, {self.num_available} available")
        if n > 0:
            self._booked[owner] = self._booked.get(owner, 0) + n
            self._num_booked += n

    def drop_booking(self, owner: str) -> None:
        self._num_booked -= self._booked.pop(owner, 0)

    def _use_booking(self, owner: str, n: int) -> None:
        had = self._booked[owner]
        if had > n:
            self._booked[owner] = had - n
            self._num_booked -= n
        else:
            del self._booked[owner]
            self._num_booked -= had

    # ---- seats ----------------------------------------------------------------------
    def add_seat(self, key: str, n: int, headroom: int = 0) -> list[int] | None:
        """Allocate n blocks now for `key` and book `headroom` more for its growth.
        None (nothing taken) if there is no room for both."""
        if key in self._seats or key in self._booked:
            raise ValueError(f"seat {key!r} already exists")
        if n + headroom > self.num_available:
            return None
        self._seats[key] = self.allocate(n)
        self.book(key, headroom)
        return list(self._seats[key])

    def claim_seat(self, key: str) -> list[int]:
        """The seat's blocks, now owned by the caller (who frees them later); its booking stays
        with `key`, which must be the owner's name when it grows."""
        return self._seats.pop(key)

    def release_seat(self, key: str) -> int:
        """Free a seat nobody claimed and its booking; returns how many blocks that was."""
        ids = self._seats.pop(key, [])
        self.drop_booking(key)
        self.free(ids)
        return len(ids)

    def seat_blocks(self, key: str) -> list[int]:
        return self._seats[key]

    def has_seat(self, key: str) -> bool:
        return key in self._seats

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        for i, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {i} has ref count {rc}"
            assert (rc == 0) == (i in free), f"block {i}: ref count {rc} but free={i in free}"
        assert len(self._free) + self.num_used == self.num_blocks
        seated = [i for ids in self._seats.values() for i in ids]
        assert len(seated) == len(set(seated)) and not free.intersection(seated)
        assert all(b > 0 for b in self._booked.values()), "an empty booking was kept"
        assert self._num_booked == sum(self._booked.values()), "the booked count drifted"
        assert self.num_booked <= len(self._free), "more blocks booked than free"
