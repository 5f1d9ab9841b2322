from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minipd.config import EngineConfig
from minipd.engine.block_manager import BlockManager, blocks_for
from minipd.engine.handoff import KVHandoff
from minipd.engine.model_runner import ModelRunner
from minipd.engine.scheduler import Scheduler, SchedulerConfig
from minipd.engine.sequence import Sequence, SequenceStatus
from minipd.models.loader import load_model
from minipd.sampling_params import SamplingParams


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    handoff: bool = False  # prefill role: first token made, KV ready to export


@dataclass(slots=True)
class StepStats:
    duration: float = 0.0
    num_preempted: int = 0
    prefilling: list[str] = field(default_factory=list)  # requests that read prompt tokens this step


class Engine:
    """schedule() -> run() -> postprocess(): one step of continuous batching."""

    def __init__(self, config: EngineConfig, model=None, kv_storage=None):
        """kv_storage(num_bytes) -> uint8 tensor: where the KV cache lives (shared memory, say)."""
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model if model is not None else load_model(config.model, config.torch_dtype, config.device)
        mcfg = self.model.config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        max_len = min(config.max_model_len or mcfg.max_position, mcfg.max_position)
        self.scheduler = Scheduler(
            SchedulerConfig(
                policy=config.policy, role=config.role, chunk_tokens=config.chunk_tokens,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_len, eos_token_ids=tuple(mcfg.eos_token_ids),
            ),
            self.blocks,
        )  # fmt: skip
        self.runner = ModelRunner(self.model, config.num_blocks, config.block_size, kv_storage)
        self.last_step = StepStats()

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        vocab = self.model.config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self.scheduler.add(Sequence.new(request_id, prompt_token_ids, params))

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        stats = StepStats(num_preempted=len(batch.preempted))
        if batch.is_empty:
            self.last_step = stats
            return []
        sampled = self.runner.run(batch)
        stats.prefilling = [s.request_id for s in batch.seqs if s.in_prefill]
        self.scheduler.postprocess(batch, sampled)
        outputs = [
            StepOutput(seq.request_id, [token], seq.is_finished, seq.finish_reason,
                       handoff=seq.status is SequenceStatus.HANDOFF)
            for seq, token in zip(batch.seqs, sampled) if token is not None
        ]  # fmt: skip
        stats.duration = time.perf_counter() - started
        self.last_step = stats
        return outputs

    # ---- settings that change at run time ---------------------------------------------
    def set_policy(self, policy: str, chunk_tokens: int | None = None) -> None:
        cfg = self.scheduler.config
        cfg.policy = policy
        if chunk_tokens:
            cfg.chunk_tokens = chunk_tokens
        cfg.__post_init__()

    def set_role(self, role: str) -> None:
        if self.scheduler.num_unfinished or self.scheduler.handoffs:
            raise RuntimeError("change the role only when the engine is drained")
        self.scheduler.config.role = role
        self.scheduler.config.__post_init__()

    # ---- KV handoff ----------------------------------------------------------------
    def export_handoff(self, request_id: str) -> KVHandoff:
        seq = self.scheduler.handoffs[request_id]
        kv = self.runner.export_kv(seq.block_table, seq.num_computed_tokens)
        return KVHandoff.from_sequence(seq, self.runner.kv_cache, kv)

    def release_handoff(self, request_id: str) -> None:
        self.scheduler.release_handoff(request_id)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.blocks.block_size)

    def reserve_seat(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode side: allocate blocks ahead for a prompt's KV plus its first decode step.
        Returns their ids (where a peer may write the KV directly), or None if there is no room."""
        return self.blocks.reserve(request_id, self.blocks_for_tokens(num_tokens + 1))

    def write_seat(self, request_id: str, part: int, kv: torch.Tensor) -> None:
        """Write one (K/V, layer) part of a prompt's KV into its reserved seat."""
        self.runner.write_kv_part(self.blocks.reserved_blocks(request_id), part, kv)

    def import_handoff(self, handoff: KVHandoff, kv_written: bool = False) -> None:
        """Continue a prefilled request in its seat. kv_written: the peer already wrote the KV
        into the seat's blocks (shared cache); otherwise copy handoff.kv in."""
        seq = handoff.to_sequence()
        seq.block_table = self.blocks.claim(seq.request_id)
        if not kv_written:
            self.runner.import_kv(seq.block_table, handoff.kv)
        self.scheduler.add_imported(seq)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
