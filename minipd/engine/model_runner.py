from __future__ import annotations

import torch

from minipd.engine.sampler import apply_logit_bias, apply_penalties, hold_back_stops, logprobs, sample
from minipd.engine.scheduler import ScheduledBatch
from minipd.models import cpu_kernels
from minipd.models.attention import AttentionMetadata, PrefillSpan
from minipd.models.linear import use_cpu_kernels
from minipd.models.llama import LlamaForCausalLM

PROMPT_SLICE = 256  # prompt rows whose vocabulary logits are held at once (256 x 49152 floats: 48 MiB)


class ModelRunner:
    """Owns the weights and the paged KV cache; turns a scheduled batch into sampled tokens."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_storage=None, prepack=True):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # (K/V, layer, slot, kv_head, head_dim); slot = block * block_size + offset
        shape = (2, cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        if kv_storage is None:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:
            num_bytes = torch.Size(shape).numel() * self.dtype.itemsize
            self.kv_cache = kv_storage(num_bytes)[:num_bytes].view(self.dtype).view(shape)
        if self.device.type == "cpu":
            self.kv_cache.zero_()  # touch every page now, not on the first handoff into it
        self.read_in_place = self.device.type == "cpu" and cpu_kernels.available()
        self.prefill_in_place = self.device.type == "cpu" and cpu_kernels.paged_prefill_available(
            self.dtype, cfg.head_dim)  # fmt: skip
        use_cpu_kernels(model, prepack=prepack)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[list | None] | None]:
        """Each seq's sampled token (None: it read prompt tokens only), and each one's logprobs
        (sampler.logprobs; None for all when no seq asked for them)."""
        decodes = [self._is_decode(batch, i) for i in range(len(batch.seqs))]
        order = sorted(range(len(batch.seqs)), key=lambda i: not decodes[i])
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        samples = batch.samples()
        samples = [samples[i] for i in order]

        input_ids, positions, slots, logits_rows = [], [], [], []
        prompt_rows, prompt_targets = [], []  # rows that score the next prompt token: (seq, its position)
        for seq, n, wants in zip(seqs, counts, samples):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:
                if seq.prompt_logprobs is None:  # a one-token prompt has no row to score: [None]
                    seq.prompt_logprobs = [None] * seq.num_prompt_tokens
                for pos in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(len(input_ids) + pos - start)
                    prompt_targets.append((seq, pos + 1))
            input_ids += seq.token_ids[start : start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in pos]
            if wants:
                logits_rows.append(len(input_ids) - 1)
        meta = self._metadata(seqs, counts, slots, num_decodes=sum(decodes))
        up = self.upload
        if prompt_rows:
            logits, hidden = self.model(up(input_ids), up(positions), self.kv_cache, meta, up(logits_rows), up(prompt_rows))
            self._prompt_logprobs(hidden, prompt_targets)
        else:
            logits = self.model(up(input_ids), up(positions), self.kv_cache, meta, up(logits_rows))
        wanted = [(s.params, s.num_output_tokens) for s, w in zip(seqs, samples) if w]
        scores = logits  # what is sampled from; logprobs come from the model's own logits
        if any(p.changes_logits(i) for p, i in wanted):  # once past min_tokens, no copy of the logits
            scores = logits.float().clone()
            apply_logit_bias(scores, [p for p, _ in wanted])
            histories = [(s.token_ids, s.num_prompt_tokens) for s, w in zip(seqs, samples) if w]
            apply_penalties(scores, [p for p, _ in wanted], histories)
            hold_back_stops(scores, [p for p, _ in wanted], [i for _, i in wanted], self.eos_token_ids)
        sampled = sample(scores, [p for p, _ in wanted], [i for _, i in wanted]) if wanted else []
        asked = [p.logprobs for p, _ in wanted]
        with_logprobs = any(n is not None for n in asked)
        rows_logprobs = iter(logprobs(logits, sampled, asked) if with_logprobs else ())
        tokens = iter(sampled)
        result: list[int | None] = [None] * len(order)
        result_logprobs: list[list | None] = [None] * len(order)
        for i, wants in zip(order, samples):
            if wants:
                result[i] = next(tokens)
                if with_logprobs:
                    result_logprobs[i] = next(rows_logprobs)
        return result, (result_logprobs if with_logprobs else None)

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list) -> None:
        """Each prompt token's logprob, rank and best others, from the hidden states before it: the
        vocabulary's logits for PROMPT_SLICE rows at a time (a whole prompt's would be too large)."""
        for at in range(0, len(targets), PROMPT_SLICE):
            part = targets[at : at + PROMPT_SLICE]
            lp = torch.log_softmax(self.model.lm_head.forward(hidden[at : at + PROMPT_SLICE]).float(), dim=-1)
            ids = torch.tensor([seq.token_ids[pos] for seq, pos in part], device=lp.device)
            chosen = lp.gather(1, ids[:, None])
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            width = max(seq.params.prompt_logprobs for seq, _ in part)
            values, best = lp.topk(width, dim=-1) if width else (lp[:, :0], lp[:, :0].long())
            values, best, chosen = values.tolist(), best.tolist(), chosen.squeeze(1).tolist()
            for j, (seq, pos) in enumerate(part):
                n = seq.params.prompt_logprobs
                top = [[t, v] for t, v in zip(best[j][:n], values[j][:n])]
                seq.prompt_logprobs[pos] = [seq.token_ids[pos], chosen[j], ranks[j], top]

    def upload(self, values: list[int]) -> torch.Tensor:
        """A long tensor on the device; on CUDA through pinned memory, without waiting for the copy."""
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    @staticmethod
    def _is_decode(batch: ScheduledBatch, i: int) -> bool:
        return batch.num_new_tokens[i] == 1 and batch.seqs[i].num_computed_tokens > 0

    def _metadata(self, seqs, counts, slots, num_decodes: int) -> AttentionMetadata:
        """seqs are ordered decodes first: the first num_decodes rows are one-token decodes."""
        meta = AttentionMetadata(slot_mapping=self.upload(slots), block_size=self.block_size)
        if num_decodes and self.read_in_place:
            decodes = seqs[:num_decodes]
            width = max(len(s.block_table) for s in decodes)
            meta.num_decodes = num_decodes
            meta.decode_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes])
            meta.decode_rows = torch.arange(num_decodes)
            meta.decode_positions = torch.tensor([s.num_computed_tokens for s in decodes])
        elif num_decodes:
            ctx = [s.num_computed_tokens + 1 for s in seqs[:num_decodes]]
            meta.num_decodes = num_decodes
            meta.decode_slots = self._context_slots(seqs[:num_decodes], max(ctx))
            if min(ctx) != max(ctx):
                lengths = torch.tensor(ctx, device=self.device)
                mask = torch.arange(max(ctx), device=self.device)[None, :] < lengths[:, None]
                meta.decode_mask = mask[:, None, None, :]
        row = num_decodes
        for seq, n in zip(seqs[num_decodes:], counts[num_decodes:]):
            ctx = seq.num_computed_tokens + n
            span = PrefillSpan(start=row, q_len=n, ctx_len=ctx)
            if self.prefill_in_place:
                span.block_table = torch.tensor(seq.block_table[: -(-ctx // self.block_size)], dtype=torch.long)
            elif ctx > n:
                span.context_slots = self._context_slots([seq], ctx)[0]
                q_pos = torch.arange(ctx - n, ctx, device=self.device)[:, None]
                span.mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos
            meta.prefills.append(span)
            row += n
        return meta

    def _context_slots(self, seqs, length: int) -> torch.Tensor:
        """(B, length) cache slots of positions 0..length-1; positions past a table's end read slot 0."""
        bs = self.block_size
        width = -(-length // bs)
        tables = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            bt = s.block_table[:width]
            tables[i, : len(bt)] = torch.tensor(bt, dtype=torch.long)
        pos = torch.arange(length)
        slots = tables[:, pos // bs] * bs + pos % bs
        return slots if self.device.type == "cpu" else slots.pin_memory().to(self.device, non_blocking=True)
