import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipd.engine.block_manager import BlockManager, OutOfBlocks, blocks_for
from minipd.engine.scheduler import Scheduler, SchedulerConfig
from minipd.engine.sequence import Sequence
from minipd.sampling_params import SamplingParams


def test_allocate_free_refcount():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    assert bm.num_used == 3 and bm.num_free == 5
    bm.incref(a[:1])
    bm.free(a)
    assert bm.num_used == 1  # the shared block is still held
    bm.free(a[:1])
    assert bm.num_used == 0
    with pytest.raises(ValueError):
        bm.free(a[:1])
    with pytest.raises(OutOfBlocks):
        bm.allocate(9)
    bm.check_integrity()


def test_a_seat_allocates_ahead_then_is_claimed_or_released():
    bm = BlockManager(10, 4)
    seat = bm.add_seat("r1", 6)
    assert len(seat) == 6 and bm.num_free == 4 and bm.num_seated == 6
    assert bm.add_seat("r2", 5) is None and bm.num_free == 4  # no room: nothing taken
    with pytest.raises(ValueError):
        bm.add_seat("r1", 1)
    assert bm.claim_seat("r1") == seat and bm.num_seated == 0 and bm.num_used == 6
    bm.free(seat)
    bm.add_seat("r3", 3)
    assert bm.release_seat("r3") == 3 and bm.release_seat("r3") == 0
    assert bm.num_used == 0
    bm.check_integrity()


def test_headroom_booked_with_a_seat_is_kept_for_its_owner():
    bm = BlockManager(10, 4)
    assert bm.add_seat("a", 2, headroom=5) is not None
    assert bm.num_free == 8 and bm.num_available == 3
    assert bm.add_seat("b", 2, headroom=2) is None  # 4 > 3 available: the booking is respected
    assert not bm.can_allocate(4) and bm.can_allocate(4, owner="a")
    bm.claim_seat("a")
    grown = bm.allocate(4, owner="a")  # taken out of a's booking
    assert bm.num_booked == 1 and bm.num_available == 3
    other = bm.allocate(3)
    assert not bm.can_allocate(1) and bm.can_allocate(1, owner="a")
    bm.drop_booking("a")
    assert bm.num_booked == 0 and bm.num_available == 1
    bm.free(grown + other)
    bm.check_integrity()


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["prefill_first", "chunked"]),
       num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4, 16]))  # fmt: skip
def test_random_arrivals_finishes_aborts_keep_integrity(seed, policy, num_blocks, block_size):
    """Drive the real scheduler with a fake model: random arrivals, token outputs and aborts.
    check_integrity() must hold after every step, and all blocks must come back at the end."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(policy=policy, chunk_tokens=rng.choice([1, 3, 8, 64]),
                                      max_num_seqs=8, eos_token_ids=(0,)), bm)  # fmt: skip
    capacity = num_blocks * block_size
    ids = 0
    for step in range(5000):
        if step < 200 and rng.random() < 0.3:
            n = rng.randint(1, max(1, capacity // 2))
            p = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0)
            sched.add(Sequence.new(str(ids), [rng.randint(1, 9) for _ in range(n)], p))
            ids += 1
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        batch = sched.schedule()
        for seq in batch.seqs:
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens
        tokens = [rng.randint(0, 9) if s else None for s in batch.samples()]
        for seq in sched.postprocess(batch, tokens):
            assert seq.is_finished and not seq.block_table
        bm.check_integrity()
        used = sum(len(s.block_table) for s in sched.running)
        assert used == bm.num_used
        if step >= 200 and not sched.num_unfinished:
            break
    assert sched.num_unfinished == 0, "requests were left behind"
    assert bm.num_used == 0


def test_allocate_each_is_allocate_one_for_each_owner_in_turn():
    def blocks():
        b = BlockManager(12, 4)
        b.allocate(3)
        b.book("a", 2)
        b.book("c", 1)
        return b

    owners = ["a", "b", "a", "c", "a", "b"]
    one_by_one, at_once = blocks(), blocks()
    expected = [i for o in owners for i in one_by_one.allocate(1, o)]
    assert at_once.allocate_each(owners) == expected
    assert (list(at_once._free), at_once._booked, at_once.num_booked) == \
        (list(one_by_one._free), one_by_one._booked, one_by_one.num_booked)  # fmt: skip
    at_once.check_integrity()
    at_once.book("c", 1)
    with pytest.raises(OutOfBlocks):  # 3 free, 1 of them booked by "c": "b" may take 2
        at_once.allocate_each(["b", "c", "b", "b"])
    assert at_once.num_free == 3 and at_once.num_booked == 1  # nothing taken
    assert len(at_once.allocate_each(["b", "c", "b"])) == 3 and at_once.num_free == 0
    at_once.check_integrity()
