"""Runs of identical decode steps: when a step reads one token of every running reply and nothing
waits, the scheduler will schedule the very same batch again at every following step, until a reply
leaves, a block runs short, or something arrives. The simulator takes such a run in one event
instead of one per step (a fleet's time is mostly spent there), and it must be exactly the steps
the scheduler would have made: the plan below says which, in the scheduler's own order. Replies may
leave only in a run's last step, which the scheduler's own postprocess() ends (last_batch).

Torch-free, like the scheduler it reads."""

from __future__ import annotations

from dataclasses import dataclass

from minipd.engine.scheduler import ScheduledBatch, Scheduler
from minipd.engine.sequence import Sequence


@dataclass(slots=True)
class DecodeRun:
    """`steps` steps of the same batch, the first of them the one the scheduler just made, no reply
    leaving before the last. A sequence takes a block as a step starts when the token it reads is
    past its table: at step `first`, then every block_size steps; by_residue[r] holds (first, seq)
    for first % block_size == r, in the order Scheduler._add_decodes grows them."""

    scheduler: Scheduler
    seqs: list[Sequence]
    steps: int
    by_residue: list[list[tuple[int, Sequence]]]

    def grow(self, start: int, stop: int) -> None:
        """What schedule() does to the blocks as steps start..stop-1 (0-based, 1 or later) begin."""
        blocks = self.scheduler.blocks
        bs, by_residue, growing = blocks.block_size, self.by_residue, []
        for step in range(start, stop):
            growing += [seq for first, seq in by_residue[step % bs] if first <= step]
        if growing:
            for seq, block in zip(growing, blocks.allocate_each([seq.request_id for seq in growing])):
                seq.block_table.append(block)

    def blocks_beyond_bookings(self, start: int, stop: int) -> int:
        """Blocks beyond their owners' bookings that steps start..stop-1 take as they begin: what must
        stay available for the run to go on (a seat granted meanwhile may take it)."""
        blocks = self.scheduler.blocks
        bs, total = blocks.block_size, 0
        for residue in self.by_residue:
            for first, seq in residue:
                k = first if first >= start else first + -(-(start - first) // bs) * bs  # its first growth from start
                if k < stop:
                    total += max(0, (stop - 1 - k) // bs + 1 - blocks.booked_by(seq.request_id))
        return total

    def last_batch(self) -> ScheduledBatch:
        """The run's last step as schedule() would make it (once its blocks are grown), for postprocess()."""
        n = len(self.seqs)
        return ScheduledBatch(list(self.seqs), [1] * n, num_single=n)

    def advance(self, steps: int, token: int) -> None:
        """What postprocess() does after `steps` of the run's steps but its last, each sampling `token`
        for every sequence (none leaves)."""
        tokens = [token] * steps
        for seq in self.seqs:
            seq.num_computed_tokens += steps
            seq.token_ids += tokens


def plan_decode_run(scheduler: Scheduler, batch: ScheduledBatch, token: int, limit: int) -> DecodeRun | None:
    """The run that `batch` (just scheduled) starts, at most `limit` steps, if every step samples
    `token` and nothing is added, aborted or taken from the blocks meanwhile; None if it is one step.
    It ends at the first step in which a reply leaves (a stop token, its length, a handoff), or before."""
    seqs = batch.seqs
    if (scheduler.waiting or batch.num_single != len(seqs) or len(seqs) != len(scheduler.running)
            or batch.single_prefills or batch.preempted or limit < 2):  # fmt: skip
        return None
    config, blocks = scheduler.config, scheduler.blocks
    bs = blocks.block_size
    max_len = min(config.max_model_len, blocks.num_blocks * bs)
    is_eos = token in config.eos_token_ids
    steps = limit
    firsts = []
    for seq in seqs:  # (the simulator's hot loop: kept plain)
        p = seq.params
        if seq.hand_off or (is_eos and not p.ignore_eos) or token in p.stop_token_ids:
            return None  # it leaves after this step
        num_tokens = len(seq.token_ids)
        leaves_after = seq.num_prompt_tokens + p.max_tokens - num_tokens
        if max_len - num_tokens < leaves_after:
            leaves_after = max_len - num_tokens
        if leaves_after < steps:
            steps = leaves_after
            if steps < 2:
                return None
        # step i reads token computed + i: a new block when that index is past the table (step 0's is taken)
        first = len(seq.block_table) * bs - seq.num_computed_tokens
        firsts.append(first)
    if len(seqs) * -(-steps // bs) > blocks.num_available:  # perhaps short of blocks: counted exactly
        while True:  # every block the run takes must be there (no preemption): the run is shortened until it is
            beyond_bookings = 0
            for seq, first in zip(seqs, firsts):
                if first < steps:
                    taken = -(-(steps - first) // bs)
                    beyond_bookings += max(0, taken - blocks.booked_by(seq.request_id))
            if beyond_bookings <= blocks.num_available:
                break
            steps //= 2
            if steps < 2:
                return None
    by_residue: list[list[tuple[int, Sequence]]] = [[] for _ in range(bs)]
    for seq, first in zip(seqs, firsts):
        if first < steps:
            by_residue[first % bs].append((first, seq))
    return DecodeRun(scheduler, list(seqs), steps, by_residue)
