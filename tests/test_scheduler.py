import subprocess
import sys

from minipd.engine.block_manager import BlockManager
from minipd.engine.scheduler import Scheduler, SchedulerConfig
from minipd.engine.sequence import Sequence, SequenceStatus
from minipd.sampling_params import SamplingParams

P = SamplingParams(max_tokens=4, temperature=0)


def make(policy="prefill_first", role="both", blocks=64, chunk=8, **kw):
    return Scheduler(SchedulerConfig(policy=policy, role=role, chunk_tokens=chunk, eos_token_ids=(0,), **kw),
                     BlockManager(blocks, 4))  # fmt: skip


def seq(rid, n, params=P):
    return Sequence.new(rid, list(range(1, n + 1)), params)


def run_step(s, token=7):
    batch = s.schedule()
    s.postprocess(batch, [token if w else None for w in batch.samples()])
    return batch


def test_scheduler_and_block_manager_do_not_import_torch():
    code = "import sys, minipd.engine.scheduler, minipd.engine.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prefill_first_stalls_decodes_for_a_new_prompt():
    s = make()
    s.add(seq("a", 5))
    run_step(s)  # a prefilled, first token sampled
    s.add(seq("b", 30))
    batch = run_step(s)
    assert [x.request_id for x in batch.seqs] == ["b"] and batch.num_new_tokens == [30]
    batch = run_step(s)
    assert sorted(x.request_id for x in batch.seqs) == ["a", "b"]
    assert batch.num_new_tokens == [1, 1]


def test_chunked_puts_decodes_first_then_fills_the_budget():
    s = make("chunked", chunk=8)
    s.add(seq("a", 5))
    run_step(s)
    s.add(seq("b", 30))
    batch = run_step(s)
    assert [x.request_id for x in batch.seqs] == ["a", "b"]
    assert batch.num_new_tokens == [1, 7]
    assert batch.samples() == [True, False]
    while s.find("b").in_prefill:
        batch = run_step(s)
        assert batch.num_tokens <= 8
    assert s.find("b").num_output_tokens == 1


def test_a_batch_says_how_many_of_its_first_sequences_each_sample():
    for policy in ("prefill_first", "chunked"):
        s = make(policy, chunk=8)
        s.add(seq("a", 5))
        s.add(seq("b", 3))
        s.add(seq("c", 30, SamplingParams(max_tokens=40, temperature=0)))
        shapes = set()
        for _ in range(12):
            batch = s.schedule()
            k = batch.num_single
            before = [x.num_uncomputed_tokens for x in batch.seqs]
            assert all(batch.samples()[:k]) and batch.num_new_tokens[:k] == [1] * k
            assert all(u > 1 for u in before[k:])  # the rest read prompt chunks
            shapes.add((k > 0, k < len(batch.seqs)))
            s.postprocess(batch, [7 if w else None for w in batch.samples()])
        assert (False, True) in shapes and (True, False) in shapes
        if policy == "chunked":
            assert (True, True) in shapes  # replies and a prompt chunk in one step


def test_prefill_role_hands_off_after_first_token():
    s = make(role="prefill")
    s.add(seq("a", 6))
    batch = s.schedule()
    done = s.postprocess(batch, [5])
    assert done[0].status is SequenceStatus.HANDOFF and done[0].token_ids[-1] == 5
    assert s.num_unfinished == 0 and s.blocks.num_used == 2  # KV kept for export
    s.release_handoff("a")
    assert s.blocks.num_used == 0


def test_prefill_role_finishes_when_first_token_is_eos():
    s = make(role="prefill")
    s.add(seq("a", 6))
    done = s.postprocess(s.schedule(), [0])
    assert done[0].is_finished and done[0].finish_reason == "stop" and s.blocks.num_used == 0


def test_preemption_recomputes_and_frees():
    s = make(blocks=4, max_num_seqs=4)  # 16 token slots
    s.add(seq("a", 7, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    s.add(seq("b", 7, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    preempted = False
    for _ in range(60):
        batch = run_step(s)
        preempted |= bool(batch.preempted)
        s.blocks.check_integrity()
        if not s.num_unfinished:
            break
    assert preempted and s.num_unfinished == 0 and s.blocks.num_used == 0


def test_abort_frees_blocks_and_booking():
    s = make()
    s.add(seq("a", 9))
    run_step(s)
    s.blocks.book("a", 2)  # as if it had come with a seat's headroom
    assert s.abort("a").finish_reason == "abort"
    assert s.blocks.num_used == 0 and s.blocks.num_booked == 0
    assert s.abort("nope") is None


def test_max_tokens_and_stop_token_ids():
    s = make()
    s.add(seq("a", 3, SamplingParams(max_tokens=2, temperature=0)))
    s.add(seq("b", 3, SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[7])))
    run_step(s)
    assert s.find("b") is None  # 7 is b's stop token
    run_step(s)
    assert s.num_unfinished == 0


def test_abort_during_a_handoff_keeps_the_blocks_until_released():
    s = make(role="prefill")
    s.add(seq("a", 6))
    s.postprocess(s.schedule(), [5])
    assert s.abort("a").finish_reason == "abort"
    assert s.blocks.num_used == 2  # a sender may still be reading them
    s.release_handoff("a")
    assert s.blocks.num_used == 0 and s.find("a") is None


def test_chunked_never_starves_a_reply_or_a_prompt():
    """More replies running than the budget: before the fix the newest replies and every prompt
    got nothing. Now every reply advances each step and a prompt gets at least a quarter."""
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    s = make("chunked", chunk=8, blocks=256, max_num_seqs=32)
    for i in range(12):
        s.add(seq(f"r{i}", 2, p))
    while any(x.in_prefill for x in (*s.running, *s.waiting)):
        run_step(s)
    s.add(seq("long", 40, p))
    batch = run_step(s)
    decoded = {x.request_id for x, n in zip(batch.seqs, batch.num_new_tokens) if n == 1}
    assert decoded == {f"r{i}" for i in range(12)}
    assert dict(zip([x.request_id for x in batch.seqs], batch.num_new_tokens))["long"] == 2  # 8 // 4


def test_a_move_freezes_a_decoding_request_now_and_one_in_its_prompt_after_its_first_token():
    s = make("chunked", chunk=8)
    s.add(seq("a", 5))
    run_step(s)  # a decodes from here on
    s.add(seq("b", 30))
    run_step(s)  # b has read part of its prompt
    assert s.freeze_for_move("a") is True
    assert s.find("a").status is SequenceStatus.HANDOFF and s.find("a") not in s.running
    assert s.freeze_for_move("b") is False  # b goes on reading its prompt, then hands off
    while s.find("b").status is not SequenceStatus.HANDOFF:
        run_step(s)
    assert s.find("b").num_output_tokens == 1 and s.num_unfinished == 0
    for rid in ("a", "b"):
        s.release_handoff(rid)
    assert s.blocks.num_used == 0


def shape_by_definition(batch):
    """Each sequence judged on its own: a prompt's tokens (or more than one) are prefill, else a decode."""
    prefilling, tokens, attention, decodes, context = [], 0, 0, 0, 0
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        if n > 1 or s.num_computed_tokens < s.num_prompt_tokens:
            prefilling.append(s.request_id)
            tokens += n
            attention += n * s.num_computed_tokens + n * (n + 1) // 2
        else:
            decodes += 1
            context += s.num_computed_tokens + 1
    return prefilling, tokens, attention, decodes, context


def test_a_steps_shape_counted_while_scheduling_is_its_shape_by_definition():
    """The decodes' context is summed as they are scheduled (the simulator's hot loop); a prompt's
    last token read alone is prefill, not a decode."""
    s = make(policy="chunked", chunk=9, blocks=256, max_num_seqs=16)
    s.add(seq("first", 10, SamplingParams(max_tokens=20, temperature=0)))  # 9 tokens, then its last alone
    kinds = set()
    for step in range(40):
        if step == 2:
            for i, n in enumerate([5, 9, 10, 3, 30]):
                s.add(seq(f"r{i}", n, SamplingParams(max_tokens=20, temperature=0)))
        batch = s.schedule()
        shape = batch.shape()
        assert (shape.prefilling, shape.prefill_tokens, shape.prefill_attention, shape.decodes,
                shape.decode_context) == shape_by_definition(batch)  # fmt: skip
        singles = batch.seqs[: batch.num_single]
        kinds |= {"single prefill" if x.num_computed_tokens < x.num_prompt_tokens else "decode" for x in singles}
        kinds |= {"chunk" for n in batch.num_new_tokens[batch.num_single :] if n > 1}
        s.postprocess(batch, [7 if w else None for w in batch.samples()])
    assert kinds == {"single prefill", "decode", "chunk"}


def test_a_prompt_is_not_taken_in_for_a_first_chunk_when_the_rest_cannot_follow():
    """Found by a hostile client (a decode worker preempting 40 times per reply, 635 in 30 s): a
    prompt, or a reply preempted for room and read again, was taken in when its first chunk fit; at
    its next chunk it preempted itself, and was taken in again at the next step, and so on."""
    s = make(policy="chunked", chunk=8, blocks=16)  # 4 tokens a block: 64 tokens
    s.add(seq("a", 20, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    for _ in range(3):
        run_step(s)
    s.add(seq("b", 48, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))  # 12 blocks: not while "a" holds 6
    steps_before_b = 0
    while s.num_unfinished:
        batch = run_step(s)
        steps_before_b += not any(q.request_id == "b" for q in batch.seqs)
        assert s.num_preempted == 0
    assert steps_before_b >= 8 and s.blocks.num_used == 0  # "b" waited for "a" to finish, then ran
