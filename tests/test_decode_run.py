"""A run of decode steps taken at once must be exactly the steps the scheduler makes one by one:
the same batches, the same tokens, the same blocks (ids, order, bookings), and it must stop before
anyone would leave or a block would run short."""

from __future__ import annotations

import copy
import random

import pytest

from minipd.engine.block_manager import BlockManager
from minipd.engine.decode_run import plan_decode_run
from minipd.engine.scheduler import Scheduler, SchedulerConfig
from minipd.engine.sequence import Sequence
from minipd.sampling_params import SamplingParams

TOKEN = 7


def step(s: Scheduler):
    batch = s.schedule()
    left = s.postprocess(batch, [TOKEN if w else None for w in batch.samples()])
    return batch, left


def state(s: Scheduler):
    seqs = sorted((*s.running, *s.waiting), key=lambda q: q.request_id)
    return ([(q.request_id, q.token_ids, q.num_computed_tokens, q.block_table, q.status) for q in seqs],
            list(s.blocks._free), dict(s.blocks._booked), s.blocks.num_booked)  # fmt: skip


def busy_scheduler(policy: str, seed: int) -> Scheduler:
    """Replies at different points of their blocks, some with booked headroom (seated, as a decode
    worker's are), in a cache that may run short."""
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(policy=policy, chunk_tokens=64, max_num_seqs=32, max_model_len=400,
                                  eos_token_ids=(0,)), BlockManager(rng.choice([40, 90, 400]), 4))  # fmt: skip
    for i in range(rng.randint(2, 9)):
        params = SamplingParams(max_tokens=rng.randint(3, 60), temperature=0, stop_token_ids=[99] if i % 3 else [])
        prompt = [1] * rng.randint(1, 30)
        if rng.random() < 0.4:  # a seated import: prompt and first token in place, headroom booked
            key = f"r{i}"
            need = -(-(len(prompt) + 1) // 4)
            if s.blocks.add_seat(key, need, rng.randint(0, 4)) is None:
                continue
            seq = Sequence.new(key, prompt, params)
            seq.token_ids.append(TOKEN)
            seq.num_computed_tokens = len(prompt)
            seq.block_table = s.blocks.claim_seat(key)
            s.add_imported(seq)
        else:
            s.add(Sequence.new(f"r{i}", prompt, params))
    return s


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_a_planned_run_is_the_schedulers_own_steps(policy):
    runs = 0
    for seed in range(60):
        s = busy_scheduler(policy, seed)
        for _ in range(200):
            if not s.num_unfinished:
                break
            batch = s.schedule()
            twin = copy.deepcopy(s)  # before anything samples: the run begins with this step
            bound = min(min(q.num_prompt_tokens + q.params.max_tokens, 400) - len(q.token_ids) for q in s.running)
            run = plan_decode_run(s, batch, TOKEN, limit=1000)
            sampled = [TOKEN if w else None for w in batch.samples()]
            twin_batch = type(batch)([twin.find(q.request_id) for q in batch.seqs], list(batch.num_new_tokens))
            left = s.postprocess(batch, sampled)  # (a run's first step: no one leaves)
            if run is None:
                continue
            assert not left and run.steps >= 2
            runs += 1
            # the twin takes the same first step, then steps one by one: each step the same batch
            ids = [q.request_id for q in batch.seqs]
            twin.postprocess(twin_batch, sampled)
            for i in range(1, run.steps):
                run.grow(i, i + 1)
                b, twin_left = step(twin)
                assert [q.request_id for q in b.seqs] == ids and b.num_new_tokens == [1] * len(ids)
                assert not twin_left or i == run.steps - 1  # replies leave in the run's last step only
            run.advance(run.steps - 2, TOKEN)
            left = s.postprocess(run.last_batch(), [TOKEN] * len(ids))
            assert [q.request_id for q in left] == [q.request_id for q in twin_left]
            assert state(s) == state(twin)
            s.blocks.check_integrity()
            # a run as long as the replies allow ends where one of them leaves; a shorter one was cut for blocks
            if run.steps == bound:
                assert left
            else:  # so the replies' own steps run short of blocks before `bound`
                preempted = False
                for _ in range(bound - run.steps):
                    preempted = preempted or bool(step(twin)[0].preempted)
                assert run.steps < bound and not left and preempted
    assert runs > 20


def test_no_run_while_a_prompt_waits_or_a_step_reads_one():
    s = Scheduler(SchedulerConfig(policy="chunked", chunk_tokens=4, eos_token_ids=(0,)), BlockManager(64, 4))
    s.add(Sequence.new("a", [1] * 3, SamplingParams(max_tokens=50, temperature=0)))
    batch = s.schedule()  # its whole prompt
    assert plan_decode_run(s, batch, TOKEN, 100) is None
    s.postprocess(batch, [TOKEN])
    s.add(Sequence.new("b", [1] * 9, SamplingParams(max_tokens=50, temperature=0)))
    batch = s.schedule()  # a's reply beside b's first chunk
    assert plan_decode_run(s, batch, TOKEN, 100) is None
    s.postprocess(batch, [TOKEN if w else None for w in batch.samples()])
    while any(q.num_uncomputed_tokens > 1 for q in s.running):
        step(s)
    batch = s.schedule()
    run = plan_decode_run(s, batch, TOKEN, 100)
    assert run is not None and run.steps == min(50 - len(q.output_token_ids) for q in s.running)
    assert plan_decode_run(s, batch, 0, 100) is None  # the token would be eos: a reply leaves at once
