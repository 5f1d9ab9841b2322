from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipd.models.attention import AttentionMetadata, paged_attention
from minipd.models.config import ModelConfig
from minipd.models.linear import Linear
from minipd.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    fused = False  # one pass in minipd's CPU kernel (set by use_cpu_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            return torch.ops.minipd.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    fused = False  # rotary embedding in place, in minipd's CPU kernel (set by use_cpu_kernels)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias)  # q, k, v stacked
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split(self.sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.fused:
            torch.ops.minipd.rope_(q, k, *rope)
        else:
            q, k = apply_rope(q, k, *rope)
        return self.o_proj.forward(paged_attention(q, k, v, k_cache, v_cache, meta))


class MLP(nn.Module):
    fused = False  # SiLU(gate) * up in one pass, in minipd's CPU kernel (set by use_cpu_kernels)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up stacked
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.size, dim=-1)
        if self.fused:
            return self.down_proj.forward(torch.ops.minipd.silu_and_mul(gate, up))
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, k_cache, v_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a flat batch of tokens from many sequences (no padding).

    Submodules are called through `.forward`: a decode step makes ~270 module calls, and
    nn.Module.__call__'s hook machinery cost ~0.8 ms of an 18 ms step at batch 1 (no hooks are used).
    Where every step of a layer runs minipd's CPU kernels, a decode batch of up to `decode_rows`
    rows runs all the layers in one call instead (csrc/decode_layers.cpp: the same kernels in the
    same order, without ~20 Python-level operator calls per layer)."""

    decode_rows = 0  # set by plan_decode_layers (use_cpu_kernels)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, slots, Hkv, D)
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # (S,) rows whose next-token logits are wanted
        hidden_rows: torch.Tensor | None = None,  # (H,) rows whose final hidden states are wanted too
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # (S, vocab), and (H, hidden) if asked
        x = self.embed_tokens.forward(input_ids)
        rope = self.rope.table(positions, x.dtype)
        T = x.shape[0]
        if T <= self.decode_rows and meta.decode_tables is not None and meta.num_decodes == T and not meta.prefills:
            cfg = self.config
            x = torch.ops.minipd.decode_layers(
                x, *self.decode_weights, kv_cache, meta.slot_mapping, meta.decode_tables, meta.decode_rows,
                meta.decode_positions, *rope, cfg.num_heads, meta.block_size, cfg.head_dim**-0.5, cfg.rms_norm_eps)  # fmt: skip
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, rope, kv_cache[0, i], kv_cache[1, i], meta)
        logits = self.lm_head.forward(self.norm.forward(x[logits_rows]))
        if hidden_rows is None:
            return logits
        return logits, self.norm.forward(x[hidden_rows])  # the caller applies lm_head a slice at a time

    def plan_decode_layers(self) -> None:
        """Turn the one-call decode on where each step of every layer runs a kernel of minipd's
        (fused norms, rotary and SiLU x up; the small-row linear up to the rows it takes, or the
        product on column-blocked weights at any), or off."""
        layers = list(self.layers)
        linears = [m for la in layers for m in (la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj,
                                                  la.mlp.down_proj)]  # fmt: skip
        fused = all(m.fused for la in layers for m in (la.self_attn, la.mlp, la.input_layernorm,
                                                        la.post_attention_layernorm))  # fmt: skip
        biases = [la.self_attn.qkv_proj.bias for la in layers]
        plain = all(m.int8 is None and m.weight.is_contiguous() for m in linears) and len({b is None for b in biases}) <= 1
        rows = [m.blocked_rows if m.blocked is not None else m.small_rows for m in linears]
        self.decode_rows = min(rows) if layers and fused and plain else 0

        def held(m: Linear) -> torch.Tensor:  # what decode_layers multiplies: column blocks, or plain rows
            return m.weight if m.blocked is None else m.blocked

        self.decode_weights = (
            [la.input_layernorm.weight for la in layers], [held(la.self_attn.qkv_proj) for la in layers],
            [] if None in biases else biases, [held(la.self_attn.o_proj) for la in layers],
            [la.post_attention_layernorm.weight for la in layers], [held(la.mlp.gate_up_proj) for la in layers],
            [held(la.mlp.down_proj) for la in layers])  # fmt: skip

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama-layout tensors (module names match, less the `model.` prefix,
        and q/k/v and gate/up are stacked into one projection each, as vLLM does: one matrix
        product instead of three or two)."""
        state = stack_projections({k.removeprefix("model."): v for k, v in weights.items()})
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        own = self.state_dict()
        missing = sorted(set(own) - set(state) - ({"lm_head.weight"} if self.config.tie_word_embeddings else set()))
        if missing:
            for stacked, parts in STACKED.items():  # name what the checkpoint itself calls them
                missing = [m.replace(stacked, "{" + ",".join(parts) + "}") for m in missing]
            raise ValueError(f"checkpoint lacks {missing[:5]}")
        for name, tensor in state.items():
            if name in own and own[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
        self.load_state_dict(state, strict=False, assign=False)
        self.tie_weights()


STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`…q_proj.weight`, `…k_proj.weight`, `…v_proj.weight` -> `…qkv_proj.weight` (rows stacked in
    that order; biases too), and gate/up likewise. A checkpoint missing a part keeps its names, so
    the loader reports what is missing."""
    out = dict(state)
    for name in state:
        for stacked, parts in STACKED.items():
            prefix, dot, suffix = name.partition(f".{parts[0]}.")
            if not dot:
                continue
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if all(n in state for n in names):
                out[f"{prefix}.{stacked}.{suffix}"] = torch.cat([state[n] for n in names])
                for n in names:
                    del out[n]
    return out
