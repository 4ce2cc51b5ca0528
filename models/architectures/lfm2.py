"""LiquidAI LFM2: gated short-convolution blocks interleaved with GQA attention (q/k RMSNorm, RoPE).

A conv layer projects x to (B, C, x'), convolves B * x' causally over time with a depthwise kernel
of `conv_L_cache` taps and multiplies by C. Its last K-1 inputs are the layer's **conv state**,
declared as FixedState and owned by the engine's StateManager. A multi-token forward continues
from that window (`conv_prefill`); a one-token forward updates it in place (`conv_step`, or the
Triton kernel of kernels/cuda/shortconv.py on CUDA); both leave the same window. Attention layers
are llama.py's (qk_norm); HF's names are mapped to ours once, in `checkpoint_names`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops import recurrent as recurrent_ops, serving
from .causal_lm import Body, CausalLM
from .causal_conv import conv_prefill, conv_step
from .layers import Linear, Residual, RMSNorm, Rope, SwiGLU, add_norm
from .llama import Attention
from .state_spec import AttentionState, FixedState, StateView


@dataclass(frozen=True)
class Lfm2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    conv_kernel: int
    conv_bias: bool
    qkv_bias: bool = False  # (read by llama.Attention)
    qk_norm: bool = True

    @classmethod
    def from_hf(cls, c: dict) -> "Lfm2Config":
        n, heads = c["num_hidden_layers"], c["num_attention_heads"]
        types = c.get("layer_types")
        if types is None:  # older configs list the attention layers instead
            attn = set(c.get("full_attn_idxs") if c.get("full_attn_idxs") is not None else range(n))
            types = ["full_attention" if i in attn else "conv" for i in range(n)]
        if len(types) != n or not set(types) <= {"conv", "full_attention"}:
            raise ValueError(f"layer_types {types!r} (expected {n} entries of 'conv' / 'full_attention')")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} (only default RoPE is supported here)")
        kernel = int(c.get("conv_L_cache", 3))
        if kernel < 2:
            raise ValueError(f"conv_L_cache {kernel} (at least 2: a window of one tap keeps no state)")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=_ffn_size(c),
            layer_types=tuple(types), num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 1000000.0))),
            rms_eps=float(c.get("norm_eps", 1e-5)), max_position=int(c.get("max_position_embeddings", 128000)),
            tie_embeddings=bool(c.get("tie_embedding", c.get("tie_word_embeddings", True))),
            conv_kernel=kernel, conv_bias=bool(c.get("conv_bias", False)))


def _ffn_size(c: dict) -> int:
    """The MLP width as HF's Lfm2MLP derives it from the config (2/3 of it, scaled, rounded up)."""
    size = int(c.get("block_ff_dim", c.get("intermediate_size")))
    if c.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier, multiple = c.get("block_ffn_dim_multiplier", 1.0), int(c.get("block_multiple_of", 256))
        if multiplier is not None:
            size = int(multiplier * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class ShortConv(nn.Module):
    """`conv.*`: in_proj → (B, C, x); y = C * causal_conv(B * x); out_proj."""

    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        h, self.kernel = cfg.hidden_size, cfg.conv_kernel
        self.in_proj = Linear(h, 3 * h, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(h, h, self.kernel, groups=h, bias=cfg.conv_bias)
        self.out_proj = Linear(h, h, bias=cfg.conv_bias)

    def state(self) -> FixedState:
        return FixedState((("conv", (self.conv.in_channels, self.kernel - 1), None),))

    def forward(self, x: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
        bcx = self.in_proj(x)
        weight, window = self.conv.weight[:, 0], st["conv"]
        if serving.one_row(bcx) and bcx.is_contiguous():
            # the gate, the conv, the window's shift and the output gate in one launch
            return self.out_proj(recurrent_ops.shortconv_step(bcx, window, weight, self.conv.bias))
        b, c, xs = bcx.chunk(3, dim=-1)
        form = conv_step if bcx.shape[0] == 1 else conv_prefill
        return self.out_proj(c * form(b * xs, window, weight, self.conv.bias).to(c.dtype))


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: Lfm2Config, i: int):
        super().__init__()
        self.attention = cfg.layer_types[i] == "full_attention"
        if self.attention:
            self.self_attn = Attention(cfg)
        else:
            self.conv = ShortConv(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)           # HF: operator_norm
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)  # HF: ffn_norm

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        x, h = add_norm(x, self.input_layernorm, defer=True)  # both operators read h through a linear first
        if self.attention:
            h = self.self_attn(h, positions, rope, cos, sin, state.kv(i), state.kv_len, mask)
        else:
            h = self.conv(h, state.fixed(i))
        x, h = add_norm(Residual(x, h), self.post_attention_layernorm, defer=True)
        return Residual(x, self.mlp(h))


# HF name fragments → ours (llama.py's attention and layers.py's SwiGLU carry the llama names)
_RENAMES = (("model.embedding_norm.", "model.norm."), (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."))


class Lfm2ForCausalLM(CausalLM):
    def __init__(self, cfg: Lfm2Config):
        body = Body(cfg.vocab_size, cfg.hidden_size, [Lfm2Layer(cfg, i) for i in range(len(cfg.layer_types))],
                    RMSNorm(cfg.hidden_size, cfg.rms_eps))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta))

    def offers_cpu_step(self) -> bool:
        return True  # (the C++ step runs the conv layers too)

    def state_spec(self):
        c = self.config
        return [AttentionState(c.num_kv_heads, c.head_dim) if layer.attention else layer.conv.state()
                for layer in self.model.layers]

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names → ours; a conv weight stored [C, K] (llama.cpp's converter squeezes it) → [C, 1, K]."""
        out = {}
        for name, t in tensors.items():
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if name.endswith(".conv.conv.weight") and t.dim() == 2:
                t = t[:, None, :]
            out[name] = t
        return out


def from_hf_config(c: dict, flags: dict) -> Lfm2ForCausalLM:
    return Lfm2ForCausalLM(Lfm2Config.from_hf(c, **flags))
