from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minipd.engine.block_manager import BlockManager, blocks_for
from minipd.engine.sequence import Sequence, SequenceStatus

POLICIES = ("prefill_first", "chunked")
PREFILL_FLOOR_SHARE = 4  # chunked: a step carries at least chunk_tokens / 4 prompt tokens, however many replies
ROLES = ("both", "prefill", "decode")


@dataclass(slots=True)
class SchedulerConfig:
    policy: str = "prefill_first"
    role: str = "both"
    chunk_tokens: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.chunk_tokens < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("chunk_tokens, max_num_seqs and max_num_batched_tokens must be >= 1")
        self.eos_token_ids = tuple(self.eos_token_ids)


@dataclass(slots=True)
class StepShape:
    prefill_tokens: int = 0  # prompt (or recomputed) tokens read
    prefill_attention: int = 0  # (query, key) pairs those tokens attend to
    decodes: int = 0  # sequences that advance by one token
    decode_context: int = 0  # tokens the decodes attend to, together
    prefilling: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_single: int = 0  # the first seqs read their one uncomputed token: each of them samples
    single_context: int = 0  # ... the context the decodes among them attend to, less one each
    single_prefills: list[int] = field(default_factory=list)  # ... and which of them read a prompt's last token

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def shape(self) -> StepShape:
        """What the step costs depends on (the simulator's step-time model is fitted on these)."""
        out = StepShape()
        seqs, k = self.seqs, self.num_single
        for i in self.single_prefills:  # the first k were counted as they were scheduled
            s = seqs[i]
            out.prefilling.append(s.request_id)
            out.prefill_tokens += 1
            out.prefill_attention += s.num_computed_tokens + 1
        decode_context = self.single_context
        for s, n in zip(seqs[k:], self.num_new_tokens[k:]):
            computed = s.num_computed_tokens
            if n > 1 or computed < s.num_prompt_tokens:
                out.prefilling.append(s.request_id)
                out.prefill_tokens += n
                out.prefill_attention += n * computed + n * (n + 1) // 2
            else:
                decode_context += computed
        out.decodes = len(seqs) - len(out.prefilling)
        out.decode_context = decode_context + out.decodes
        return out

    def samples(self) -> list[bool]:
        """Which sequences reach the end of their known tokens this step, and so sample one."""
        return [s.num_computed_tokens + n == len(s.token_ids) for s, n in zip(self.seqs, self.num_new_tokens)]


class Scheduler:
    """Continuous batching with one accounting model: num_computed_tokens catches up with
    num_tokens. Policies only decide how many tokens each request gets this step."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.handoffs: dict[str, Sequence] = {}
        self.num_preempted = 0  # since start

    # ---- admission -------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, max_tokens: int = 1) -> None:
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens; this model's context is {limit} tokens"
            )
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if num_prompt_tokens + 1 > capacity:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens; the KV cache holds {capacity} tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_prompt_tokens)
        if seq.hand_off is None:
            seq.hand_off = self.config.role == "prefill"
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_imported(self, seq: Sequence) -> None:
        """Decode side of a handoff: KV for the prompt is already in seq.block_table."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.handoffs.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.find(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.HANDOFF:
            seq.finish_reason = "abort"  # its KV may be on its way out: release_handoff frees it
            return seq
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    def freeze_for_move(self, request_id: str) -> bool:
        """A move at a token boundary: a decoding request leaves the running set now, its KV held
        for export (True); one still reading its prompt (or waiting) hands off after its next token (False)."""
        seq = self.find(request_id)
        if seq is None or seq.status is SequenceStatus.HANDOFF:
            raise ValueError(f"request {request_id!r} is not running here")
        if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1:
            self.running.remove(seq)
            seq.status = SequenceStatus.HANDOFF
            self.handoffs[request_id] = seq
            return True
        seq.hand_off = True
        return False

    def release_handoff(self, request_id: str) -> None:
        seq = self.handoffs.pop(request_id)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "handoff"

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self.config.policy == "chunked":
            return self._schedule_chunked()
        return self._schedule_prefill_first()

    def _schedule_prefill_first(self) -> ScheduledBatch:
        """Prompts are read whole, before any running reply goes on: the stall, on purpose."""
        batch = ScheduledBatch()
        token_cap = self.config.max_num_batched_tokens
        for seq in [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]:
            if batch.seqs and batch.num_tokens + seq.num_uncomputed_tokens > token_cap:
                break
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, seq.num_uncomputed_tokens, batch):
                batch.add(seq, seq.num_uncomputed_tokens)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            if batch.seqs and batch.num_tokens + n > token_cap:
                break
            if not self._admit(seq, n):
                break
            batch.add(seq, n)
        if batch.seqs:
            return batch
        self._add_decodes(batch)
        return batch

    def _schedule_chunked(self) -> ScheduledBatch:
        """Every running reply gets its token each step; prompts get the rest of the budget in
        chunks, and never less than a floor, so neither a reply nor a prompt starves."""
        batch = ScheduledBatch()
        self._add_decodes(batch)
        chunk = self.config.chunk_tokens
        budget = max(chunk - len(batch.seqs), max(1, chunk // PREFILL_FLOOR_SHARE))
        for seq in [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(seq.num_uncomputed_tokens, budget)
            if self._grow(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._admit(seq, n):
                break
            batch.add(seq, n)
            budget -= n
        return batch

    def _add_decodes(self, batch: ScheduledBatch) -> None:
        """A step's first sequences: every running one with one token to read."""
        # the simulator runs this for every reply and step of a fleet: the common case stays inline,
        # and the step's shape is counted on the way (ScheduledBatch.shape)
        block_size, running = self.blocks.block_size, SequenceStatus.RUNNING
        seqs, counts = batch.seqs, batch.num_new_tokens
        context = 0
        for seq in self.running.copy():  # a copy: _grow may preempt
            computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids)
            if num_tokens - computed != 1 or seq.status is not running:
                continue  # more to read (a prompt), or preempted earlier in this loop
            if computed < len(seq.block_table) * block_size or self._grow(seq, 1, batch):
                seqs.append(seq)
                counts.append(1)
                if num_tokens > seq.num_prompt_tokens:
                    context += computed
                else:  # the last token of its prompt
                    batch.single_prefills.append(len(seqs) - 1)
        batch.num_single = len(seqs)
        batch.single_context = context

    def _admit(self, seq: Sequence, n: int) -> bool:
        """Take a waiting sequence in (its first n tokens now) only if the blocks for all it must read
        are free: taken in for its first chunk alone, it would preempt itself at the next chunk, and a
        reply preempted for room would be read again and thrown out at every step."""
        bs = self.blocks.block_size
        need = blocks_for(seq.num_computed_tokens + n, bs) - len(seq.block_table)
        whole = blocks_for(len(seq.token_ids), bs) - len(seq.block_table)
        if not self.blocks.can_allocate(max(need, whole), seq.request_id):
            return False
        self.waiting.popleft()
        seq.block_table += self.blocks.allocate(need, seq.request_id)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Make room for n more tokens of a running seq, preempting the newest others if needed.
        Returns False if seq itself had to be preempted."""
        if seq.num_computed_tokens + n <= len(seq.block_table) * self.blocks.block_size:
            return True  # its blocks already hold them (most decode steps)
        need = blocks_for(seq.num_computed_tokens + n, self.blocks.block_size) - len(seq.block_table)
        while not self.blocks.can_allocate(need, seq.request_id):
            victim = self.running[-1]
            if victim in batch.seqs:
                return False  # everyone left is already in this step; try again next step
            self._preempt(victim, batch)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.blocks.allocate(need, seq.request_id)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.num_preempted += 1
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    # ---- after the model ran ------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance accounting; append sampled tokens. Returns sequences that left the running set
        this step (finished, or handed off)."""
        done = []
        eos = self.config.eos_token_ids
        max_len = min(self.config.max_model_len, self.blocks.num_blocks * self.blocks.block_size)
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            seq.num_computed_tokens += n
            if token is None:
                continue
            token_ids, p = seq.token_ids, seq.params
            token_ids.append(token)
            num_tokens = len(token_ids)
            if (token in eos and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
                seq.stop_reason = None if token in eos and not p.ignore_eos else token
            elif num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= max_len:
                reason = "length"
            elif seq.hand_off:
                self.running.remove(seq)
                seq.status = SequenceStatus.HANDOFF
                self.handoffs[seq.request_id] = seq
                done.append(seq)
                continue
            else:
                continue
            self.running.remove(seq)
            self._finish(seq, reason)
            done.append(seq)
        return done

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence) -> None:
        self.blocks.drop_booking(seq.request_id)
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
