"""The router's choice, "the least loaded worker of a role, ties taken in turn", in O(log n) per
request instead of a scan of every worker: the simulator makes it for every request of fleets of
hundreds of workers."""

from __future__ import annotations

import bisect
import heapq


class LoadIndex:
    """Worker ids by load. `order(turn)` yields them as the router ranks them: by load, then from
    id `turn` on, cyclically (server/dispatch.py's key (load, (id - turn) % n))."""

    def __init__(self, ids: list[int]):
        self.load = {i: 0 for i in ids}
        self.buckets: dict[int, list[int]] = {0: sorted(ids)} if ids else {}
        self.loads: list[int] = [0] if ids else []  # a heap of loads that may have a bucket (stale ones skipped)

    def __bool__(self) -> bool:
        return bool(self.load)

    def add(self, worker_id: int, delta: int) -> None:
        old = self.load[worker_id]
        new = old + delta
        bucket = self.buckets[old]
        del bucket[bisect.bisect_left(bucket, worker_id)]
        if not bucket:
            del self.buckets[old]
        if new not in self.buckets:
            self.buckets[new] = []
            heapq.heappush(self.loads, new)
        bisect.insort(self.buckets[new], worker_id)
        self.load[worker_id] = new

    def first(self, turn: int) -> int:
        while self.loads[0] not in self.buckets:
            heapq.heappop(self.loads)
        return _from(self.buckets[self.loads[0]], turn)

    def order(self, turn: int):
        for load in sorted(self.buckets):
            bucket = self.buckets[load]
            i = bisect.bisect_left(bucket, turn)
            yield from bucket[i:]
            yield from bucket[:i]


def _from(bucket: list[int], turn: int) -> int:
    i = bisect.bisect_left(bucket, turn)
    return bucket[i] if i < len(bucket) else bucket[0]
