"""Granite 4.0-H (`granitemoehybrid`): pre-norm layers whose mixer is Mamba2 (mamba2.Mamba2Mixer:
conv window + SSM state) or GQA attention (KV; RoPE only where `position_embedding_type` is
"rope", softmax scale `attention_multiplier`), each followed by routed SwiGLU experts (the
softmax over the top-k router logits) plus a shared SwiGLU MLP. Granite's muP multipliers:
embeddings times `embedding_multiplier`, each branch times `residual_multiplier` before it joins
the stream, logits divided by `logits_scaling`. The model declares each layer's state; the
engine's StateManager owns it. Checkpoint names (`input_linear`, `output_linear`, `router.layer`)
map to ours in `checkpoint_names`; the experts and router are moe.py's (their top-k softmax,
renormalised, is the softmax over the top-k logits); on CUDA a one-token step runs them through
ops.experts (routing in one launch, the experts in two, as the Qwen MoE models), and a
multi-token forward as two grouped GEMMs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import experts as experts_ops, linear as linear_ops, serving
from .causal_lm import Body, CausalLM
from . import layers
from .layers import FusedLinear, Linear, Residual, RMSNorm, Rope, SwiGLU, add_norm
from .mamba2 import Mamba2Mixer
from .nemotron_h import Attention, float_value, layer_kinds
from . import moe
from .moe import Experts, Router
from .state_spec import AttentionState, StateView


@dataclass(frozen=True)
class GraniteHybridConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    rope: bool
    rope_theta: float
    mamba_heads: int
    mamba_head_dim: int
    ssm_state: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]
    shared_intermediate_size: int
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float
    # routed experts (names as qwen3_5's Experts and Router read them); num_experts 0 = none
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, c: dict) -> "GraniteHybridConfig":
        heads, h = c["num_attention_heads"], c["hidden_size"]
        types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * c["num_hidden_layers"]
        pos = c.get("position_embedding_type")
        if pos not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type {pos!r} (supported: rope, nope)")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} (only default RoPE is supported here)")
        n_heads = c.get("mamba_n_heads", 128)
        head_dim = c.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = c.get("mamba_expand", 2) * h // n_heads
        limit = c.get("time_step_limit") or (0.0, math.inf)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=h, layer_types=layer_kinds(types), num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or h // heads,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)), max_position=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)), rope=pos == "rope",
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            mamba_heads=n_heads, mamba_head_dim=head_dim, ssm_state=c.get("mamba_d_state", 256),
            n_groups=c.get("mamba_n_groups", 1), conv_kernel=c.get("mamba_d_conv", 4),
            conv_bias=bool(c.get("mamba_conv_bias", True)), proj_bias=bool(c.get("mamba_proj_bias", False)),
            dt_limit=(float_value(limit[0]), float_value(limit[1])),
            shared_intermediate_size=c["shared_intermediate_size"],
            embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(c.get("residual_multiplier", 1.0)),
            attention_multiplier=float(c.get("attention_multiplier", 1.0)),
            logits_scaling=float(c.get("logits_scaling", 1.0)),
            num_experts=c.get("num_local_experts", 0) or 0, experts_per_tok=c.get("num_experts_per_tok", 0),
            moe_intermediate_size=c.get("intermediate_size", 0))


class RoutedExperts(nn.Module):
    """`block_sparse_moe`: the router and the routed experts (the shared MLP is the layer's)."""

    def __init__(self, cfg: GraniteHybridConfig):
        super().__init__()
        self.router = Router(cfg.num_experts, cfg.hidden_size, cfg.experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x, shared_mlp: SwiGLU, scale: float):
        """(experts(x) + shared_mlp(x)) * scale (`scale`: the residual multiplier), each operation
        rounded as torch rounds it. One token on CUDA: the router's GEMV (rounded to x's dtype, as
        the torch form), the top k on the device, the chosen experts read where they are stored.
        With bf16 experts, the sum and the product in the last launch's epilogue; and where the
        shared MLP's width is a multiple of the experts' (SHARED_AS_EXPERTS), its weights as that
        many more experts of both launches (two GEMV launches fewer), the sum then in fp32, rounded
        once. Quantized experts add and scale in torch. x may be a NormedRow (one token on CUDA:
        the layer's norm in the router GEMV's prologue, which writes the normed row the experts
        read)."""
        row = linear_ops.is_row(x)
        ex = self.experts
        if not (serving.one_row(x) and moe.decode_serves(ex)):
            x = x.materialize() if row else x
            idx, weights = self.router(x)
            # many tokens: grouped GEMMs where they serve (moe.py)
            return (ex(x, idx, weights) + shared_mlp(x)) * scale
        _, x, idx, weights = self.router.decode_cuda(x if row else x.contiguous())
        fused = layers.FUSED_SCALE and isinstance(ex, Experts)
        parts = shared_parts(shared_mlp, ex) if fused and SHARED_AS_EXPERTS else None
        if parts is not None:
            return experts_ops.experts(x, ex.gate_up_proj, ex.down_proj, idx, weights, shared_gate_up=parts[0],
                                       shared_down=parts[1], scale=scale)
        shared = shared_mlp(x)
        if fused and shared.dtype == x.dtype and shared.is_contiguous():
            return experts_ops.experts(x, ex.gate_up_proj, ex.down_proj, idx, weights, shared, scale=scale)
        out = moe.decode_experts(x, ex, idx, weights) + shared
        return out * scale


# False: the norm before the MLPs in its own add_rms_norm launch, not in the prologue of the
# router's GEMV (or the shared MLP's gate/up; bench/ab_decode.py's normapart)
DEFER_MLP_NORM = True

# False: the shared MLP as its own two GEMVs in a one-token step, its output added in the experts'
# down launch (the A/B of bench/ab_decode.py's variant sharedapart)
SHARED_AS_EXPERTS = True


def shared_parts(mlp: SwiGLU, ex: Experts) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """(the shared MLP's [gate; up] weight [2F, H], its down weight [H, F]) where the experts'
    decode launches take it as F / I more experts: fused (one [gate; up] weight), plain Linears of
    the experts' dtype, contiguous, F a multiple of the experts' width I; else None."""
    gu, dn = getattr(mlp, "gate_up_proj", None), mlp.down_proj
    I = ex.down_proj.shape[2]
    if not (type(gu) is FusedLinear and type(dn) is Linear and gu.bias is None and dn.bias is None):
        return None
    w, d = gu.weight, dn.weight
    if (w.dtype != ex.gate_up_proj.dtype or d.dtype != w.dtype or not w.is_contiguous() or not d.is_contiguous()
            or w.shape[1] != ex.gate_up_proj.shape[2] or (w.shape[0] // 2) % I or d.shape[1] != w.shape[0] // 2):
        return None
    return w, d


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: GraniteHybridConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.rm = cfg.residual_multiplier
        h = cfg.hidden_size
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(h, cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state, cfg.n_groups,
                                     cfg.conv_kernel, cfg.rms_eps, cfg.conv_bias, cfg.proj_bias, cfg.dt_limit)
        elif self.kind == "attention":
            self.self_attn = Attention(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias,
                                       rope=cfg.rope, scale=cfg.attention_multiplier)
        else:
            raise ValueError(f"layer type {self.kind!r} (Granite layers are mamba or attention)")
        if cfg.num_experts:
            self.block_sparse_moe = RoutedExperts(cfg)
        self.shared_mlp = SwiGLU(h, cfg.shared_intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_eps)

    def state(self, cfg: GraniteHybridConfig):
        return self.mamba.state() if self.kind == "mamba" else AttentionState(cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        # a Mamba2 mixer reads h through its in_proj only: on CUDA the norm runs in that GEMV's prologue
        x, h = add_norm(x, self.input_layernorm, defer=self.kind == "mamba")
        # each branch times the residual multiplier: in the GEMV or expert launch that ends it (one token on CUDA)
        if self.kind == "mamba":
            h = self.mamba(h, state.fixed(i), out_scale=self.rm)
        else:
            h = self.self_attn(h, positions, rope, cos, sin, state.kv(i), state.kv_len, mask, out_scale=self.rm)
        # the routed experts' router, or the shared MLP, reads h through a linear first (defer: add_norm)
        x, h = add_norm(Residual(x, h), self.post_attention_layernorm, defer=DEFER_MLP_NORM)
        if hasattr(self, "block_sparse_moe"):
            return Residual(x, self.block_sparse_moe(h, self.shared_mlp, self.rm))
        return Residual(x, self.shared_mlp(h) * self.rm)


class GraniteHybridForCausalLM(CausalLM):
    cpu_step_kind = "mamba2"  # (models/kernels/cpu/mamba2_hybrid_step.py)

    def __init__(self, cfg: GraniteHybridConfig):
        layers = [GraniteHybridLayer(cfg, i) for i in range(len(cfg.layer_types))]
        body = Body(cfg.vocab_size, cfg.hidden_size, layers, RMSNorm(cfg.hidden_size, cfg.rms_eps))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta))

    def offers_cpu_step(self) -> bool:
        return True  # (the step then checks the weights it would read: mamba2_hybrid_step.supports)

    def state_spec(self):
        return [layer.state(self.config) for layer in self.model.layers]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def scale_logits(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.config.logits_scaling == 1.0 else out / self.config.logits_scaling

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names → ours: the released checkpoints' stacked experts (`input_linear`,
        `output_linear`), router (`router.layer`) and fused shared MLP, or transformers 5's names."""
        out = {}
        for name, t in tensors.items():
            name = (name.replace("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")
                    .replace("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")
                    .replace("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"))
            if name.endswith("shared_mlp.input_linear.weight"):
                base = name[: -len("input_linear.weight")]
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t.chunk(2, dim=0)
                continue
            name = name.replace("shared_mlp.output_linear.weight", "shared_mlp.down_proj.weight")
            if name.endswith("conv1d.weight") and t.dim() == 2:
                t = t[:, None, :]
            out[name] = t
        return out


def from_hf_config(c: dict, flags: dict) -> GraniteHybridForCausalLM:
    return GraniteHybridForCausalLM(GraniteHybridConfig.from_hf(c, **flags))
