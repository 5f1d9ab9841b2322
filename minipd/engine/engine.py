from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minipd.config import EngineConfig
from minipd.engine.block_manager import BlockManager, blocks_for
from minipd.engine.handoff import HandoffMeta, KVHandoff, KVSlots
from minipd.engine.model_runner import ModelRunner
from minipd.engine.scheduler import Scheduler, SchedulerConfig
from minipd.engine.sequence import Sequence, SequenceStatus
from minipd.models.linear import quantize_int8
from minipd.models.loader import load_model
from minipd.sampling_params import SamplingParams


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    handoff: bool = False  # a token made by a request that hands off: its KV is ready to go
    index: int = 0  # how many output tokens the request had before these
    logprobs: list | None = None  # per new token, when the request asked: sampler.logprobs's entry
    prompt_logprobs: list | None = None  # with a request's first token, when it asked: Sequence.prompt_logprobs
    stop_reason: int | None = None  # finished by a stop_token_ids token: it (Sequence.stop_reason)


@dataclass(slots=True)
class StepStats:
    start: float = 0.0  # wall clock (time.time) when the step began
    duration: float = 0.0
    num_preempted: int = 0
    prefill_tokens: int = 0  # prompt (or recomputed) tokens read this step
    num_decodes: int = 0  # sequences that advanced by one token
    scheduled: int = 0  # sequences the step carried (0: nothing could run)
    prefilling: list[str] = field(default_factory=list)  # requests that read prompt tokens this step
    prefill_attention: int = 0  # (query, key) pairs the prompt tokens attend to
    decode_context: int = 0  # tokens the decodes attend to, together


class StepFailed(RuntimeError):
    """The model step raised; the requests it carried were aborted (their blocks are free)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {request_ids}: {cause!r}")
        self.request_ids, self.cause = request_ids, cause


class Engine:
    """schedule() -> run() -> postprocess(): one step of continuous batching."""

    def __init__(self, config: EngineConfig, model=None, kv_storage=None):
        """kv_storage(num_bytes) -> uint8 tensor: where the KV cache lives (shared memory, say)."""
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(config.device))  # this process's card, for every kernel and handle
        self.model = model if model is not None else load_model(config.model, config.torch_dtype, config.device)
        if config.quantization == "int8":
            quantize_int8(self.model)
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
        self.runner = ModelRunner(self.model, config.num_blocks, config.block_size, kv_storage, config.prepack)
        self.last_step = StepStats()
        self.on_prefill_step = None  # (start, prefill tokens, decodes, prefilling ids): a step that reads prompt tokens begins

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] = (), hand_off: bool | None = None) -> None:  # fmt: skip
        """output_token_ids: tokens this request already produced elsewhere (it is being redone);
        they are recomputed with the prompt and sampling goes on from there. hand_off: its KV goes
        to another worker after its first token (default: whether this engine's role is prefill)."""
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        vocab = self.model.config.vocab_size
        if any(not (0 <= t < vocab) for t in (*prompt_token_ids, *output_token_ids)):
            raise ValueError(f"token ids must be in [0, {vocab})")
        seq = Sequence.new(request_id, prompt_token_ids, params)
        seq.token_ids += output_token_ids
        seq.hand_off = hand_off
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[StepOutput]:
        started, wall = time.perf_counter(), time.time()
        batch = self.scheduler.schedule()
        stats = StepStats(start=wall, num_preempted=len(batch.preempted))
        self.last_step = stats
        if batch.is_empty:
            return []
        shape = batch.shape()
        if self.on_prefill_step is not None and shape.prefilling:
            self.on_prefill_step(wall, shape.prefill_tokens, shape.decodes, shape.prefilling)
        try:
            sampled, sampled_logprobs = self.runner.run(batch)
        except Exception as err:
            ids = [s.request_id for s in batch.seqs]
            for rid in ids:
                self.scheduler.abort(rid)
            raise StepFailed(ids, err) from err
        stats.prefilling, stats.prefill_tokens, stats.num_decodes = shape.prefilling, shape.prefill_tokens, shape.decodes
        stats.prefill_attention, stats.decode_context = shape.prefill_attention, shape.decode_context
        self.scheduler.postprocess(batch, sampled)
        outputs = [
            StepOutput(seq.request_id, [token], seq.is_finished, seq.finish_reason,
                       handoff=seq.status is SequenceStatus.HANDOFF, index=seq.num_output_tokens - 1,
                       logprobs=[sampled_logprobs[i]] if sampled_logprobs and sampled_logprobs[i] else None,
                       prompt_logprobs=seq.prompt_logprobs if seq.num_output_tokens == 1 else None,
                       stop_reason=seq.stop_reason)
            for i, (seq, token) in enumerate(zip(batch.seqs, sampled)) if token is not None
        ]  # fmt: skip
        stats.scheduled = len(batch.seqs)
        stats.duration = time.perf_counter() - started
        return outputs

    # ---- settings that change at run time ---------------------------------------------
    def set_policy(self, policy: str, chunk_tokens: int | None = None) -> None:
        cfg = self.scheduler.config
        cfg.policy = policy
        if chunk_tokens:
            cfg.chunk_tokens = chunk_tokens
        cfg.__post_init__()

    def is_drained(self) -> bool:
        return not (self.scheduler.num_unfinished or self.scheduler.handoffs or self.blocks.num_seated)

    def set_role(self, role: str) -> None:
        """The default for requests added from now on; those already here keep their own way."""
        self.scheduler.config.role = role
        self.scheduler.config.__post_init__()

    # ---- prefill side of a handoff ------------------------------------------------------
    def handoff_meta(self, request_id: str) -> HandoffMeta:
        return HandoffMeta.of(self.scheduler.handoffs[request_id], self.runner.kv_cache)

    def handoff_kv(self, request_id: str) -> KVSlots:
        seq = self.scheduler.handoffs[request_id]
        return KVSlots(self.runner.kv_cache, seq.block_table, seq.num_computed_tokens, self.blocks.block_size)

    def export_handoff(self, request_id: str) -> KVHandoff:
        return KVHandoff(self.handoff_meta(request_id), self.handoff_kv(request_id).read())

    def start_move(self, request_id: str) -> bool:
        """Hand a running request's KV to another worker at its next token boundary. True: it is
        frozen now and handoff_meta/handoff_kv describe it; False: it goes once its prompt is read."""
        return self.scheduler.freeze_for_move(request_id)

    def release_handoff(self, request_id: str) -> None:
        self.scheduler.release_handoff(request_id)

    # ---- decode side: seats --------------------------------------------------------------
    def add_seat(self, request_id: str, num_tokens: int, headroom_tokens: int = 0) -> list[int] | None:
        """Blocks allocated ahead for a prompt's KV and its first decode step, plus a booking for
        headroom_tokens more. Their ids (where a peer may write the KV), or None if there is no room."""
        bs = self.blocks.block_size
        now = blocks_for(num_tokens + 1, bs)
        headroom = max(0, blocks_for(num_tokens + 1 + headroom_tokens, bs) - now)
        return self.blocks.add_seat(request_id, now, headroom)

    def seat_kv(self, request_id: str, num_tokens: int) -> KVSlots:
        return KVSlots(self.runner.kv_cache, self.blocks.seat_blocks(request_id), num_tokens, self.blocks.block_size)

    def release_seat(self, request_id: str) -> int:
        return self.blocks.release_seat(request_id)

    def import_handoff(self, meta: HandoffMeta, kv: torch.Tensor | None = None) -> None:
        """Run a prefilled request in its seat. kv: copy it into the seat first; None: a peer already
        wrote it there."""
        seq = meta.to_sequence()
        if kv is not None:
            self.seat_kv(seq.request_id, seq.num_computed_tokens).write(kv)
        seq.block_table = self.blocks.claim_seat(seq.request_id)
        self.scheduler.add_imported(seq)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
