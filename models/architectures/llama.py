"""GQA transformers: Llama / SmolLM2, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and
Qwen3-MoE (Qwen3's attention with moe.py's MLP, no shared expert, in the layers the config names).

The variants are data (`qkv_bias`, `qk_norm`, `moe`, `tie_embeddings`), never a branch on a model
name. Module names equal the HF checkpoint names; hub MoE checkpoints' per-expert weights are
stacked in `checkpoint_names`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..sharding import Plan, Split, divisible, expert_splits
from ..ops import attention as attention_ops, linear as linear_ops
from .causal_lm import Body, CausalLM
from . import moe
from .moe import SparseMoe, num_experts, stack_experts
from . import layers
from .layers import (Linear, QKVProjections, Residual, RMSNorm, Rope, SwiGLU, add_norm, attend_cached,
                     cached_attention)
from .state_spec import AttentionState, StateView


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    # MoE (Qwen3-MoE): which layers route (empty: dense everywhere)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, c: dict, qkv_bias: bool = False, qk_norm: bool = False, moe: bool = False) -> "LlamaConfig":
        heads = c["num_attention_heads"]
        n = c["num_hidden_layers"]
        moe_layers = ()
        if moe and num_experts(c) > 0:
            step, only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0) if moe_layers and all(moe_layers)
            else c["intermediate_size"], num_layers=n,
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", qkv_bias)), qk_norm=qk_norm, rope_scaling=scaling,
            moe_layers=moe_layers, num_experts=num_experts(c) if moe_layers else 0,
            experts_per_tok=c.get("num_experts_per_tok", 0), moe_intermediate_size=c.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)))


class Attention(QKVProjections):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)

    def forward(self, x, positions, rope: Rope, cos, sin, kv, kv_len, mask):
        T, H, KVH, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        if attention_ops.rope_serves(x, D):
            # one kernel for the q/k norms, RoPE and the KV write; two for a one-token attention
            qkv = self.project_joint(x)
            norms = (self.q_norm.fused_weight(), self.k_norm.fused_weight()) if hasattr(self, "q_norm") else None
            q = attention_ops.rope_kv_write(qkv, cos, sin, positions, kv[0], kv[1], H, KVH, norm_weights=norms,
                                            eps=self.q_norm.eps if norms else 0.0)
            if attention_ops.decode_serves(x, D):
                return self.o_proj(attention_ops.decode(q, kv[0], kv[1], positions,
                                                        int8_out=linear_ops.reads_int8(self.o_proj, x.dtype, "merge")))
            return self.o_proj(attend_cached(q, kv[0], kv[1], kv_len, mask, positions))
        if hasattr(self, "qkv_proj") and not hasattr(self, "q_norm"):
            qkv = self.qkv_proj(x)
            # query and key heads are adjacent in the fused output: one RoPE over both
            heads = qkv.view(T, H + 2 * KVH, D).transpose(0, 1)
            qk = rope.apply(heads[:H + KVH], cos, sin)
            q, k, v = qk[:H], qk[H:], heads[H + KVH:]
        else:
            q, k, v = self.project_qkv(x)
            q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D).transpose(0, 1)
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q.transpose(0, 1), cos, sin), rope.apply(k.transpose(0, 1), cos, sin)
        out = cached_attention(q, k, v, positions, kv[0], kv[1], kv_len, mask)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, i: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        if cfg.moe_layers and cfg.moe_layers[i]:
            self.mlp = SparseMoe(cfg.hidden_size, cfg.num_experts, cfg.experts_per_tok, cfg.moe_intermediate_size,
                                 cfg.norm_topk_prob)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        # adds the previous layer's MLP output first; h goes only into linears (defer: see add_norm)
        x, h = add_norm(x, self.input_layernorm, defer=True)
        a = self.self_attn(h, positions, rope, cos, sin, state.kv(i), state.kv_len, mask)
        # an MoE MLP's router GEMV writes the normed row its experts read (SparseMoe.decode_cuda)
        x, h = add_norm(Residual(x, a), self.post_attention_layernorm, defer=isinstance(self.mlp, (SwiGLU, SparseMoe)))
        return Residual(x, moe.branch(self.mlp, h))  # an MoE prefill's combine joins the next add_norm


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: LlamaConfig):
        body = Body(cfg.vocab_size, cfg.hidden_size, [DecoderLayer(cfg, i) for i in range(cfg.num_layers)],
                    RMSNorm(cfg.hidden_size, cfg.rms_eps))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling))

    def offers_cpu_step(self) -> bool:
        return not self.config.moe_layers  # (the C++ step has no MoE MLP)

    def pads_prefill(self, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether a prefill may run padded to a length bucket (CausalLM.forward's `last`;
        engine/graphs.py): every layer holds attention KV only (a pad token would feed recurrent
        state), attends as layers.padded_prefill_serves says, and its MLP makes no host sync."""
        return (layers.padded_prefill_serves(device, dtype, self.config.head_dim, kv_dtype)
                and all(moe.prefill_syncless(layer.mlp, dtype) for layer in self.model.layers))

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-expert 2D weights of hub MoE checkpoints → the 3D expert tensors; else unchanged."""
        return stack_experts(tensors) if self.config.moe_layers else tensors

    def state_spec(self) -> list[AttentionState]:
        return [AttentionState(self.config.num_kv_heads, self.config.head_dim)] * self.config.num_layers


def from_hf_config(c: dict, flags: dict) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.from_hf(c, **flags))


def tensor_parallel_plan(cfg: LlamaConfig, world: int) -> Plan:
    """Heads, KV heads, the MLP's width and (Qwen3-MoE) each expert's width split over `world`
    ranks (models/sharding.py); routers replicated."""
    H, KV, D, I, MI = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.moe_intermediate_size
    counts = {"attention heads": H, "key/value heads": KV, "MLP width": I}
    if cfg.num_experts:
        counts["expert width"] = MI
    divisible(counts, world)
    local = replace(cfg, num_heads=H // world, num_kv_heads=KV // world, intermediate_size=I // world,
                    moe_intermediate_size=MI // world)
    layer = r"model\.layers\.\d+\."
    return Plan(local, (
        Split(layer + r"self_attn\.q_proj\.(weight|bias)", 0, (H * D,)),
        Split(layer + r"self_attn\.[kv]_proj\.(weight|bias)", 0, (KV * D,)),
        Split(layer + r"self_attn\.o_proj\.weight", 1, (H * D,)),
        Split(layer + r"mlp\.(gate|up)_proj\.weight", 0, (I,)),
        Split(layer + r"mlp\.down_proj\.weight", 1, (I,)),
        *expert_splits(layer, MI),
    ), reduce_after=layer + r"(self_attn|mlp)")
