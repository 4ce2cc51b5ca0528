"""Nemotron-H: a stack of single-mixer blocks, each `x + mixer(RMSNorm(x))`, the mixer one of
Mamba2 (mamba2.Mamba2Mixer: conv window + SSM state), GQA attention without positional encoding
(KV), or a squared-ReLU MLP (no state), as `hybrid_override_pattern` (M, *, -) or
`layers_block_type` lists them. The model declares each layer's state; the engine's
StateManager owns it. Checkpoint names (`backbone.*`, `embeddings`, `norm_f`) map to ours in
`checkpoint_names`. The routed-expert blocks of Nemotron-H MoE models (`E`) are refused at load.
`Attention` (no RoPE or RoPE, any softmax scale) is shared with granitemoehybrid.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .causal_lm import Body, CausalLM
from .layers import Linear, QKVProjections, Residual, RMSNorm, Rope, add_norm, rope_and_attend, scaled_linear
from .mamba2 import Mamba2Mixer
from .state_spec import AttentionState, FixedState, StateView

# layer kinds: "mamba" (Mamba2 mixer), "attention", "mlp"; the names configs use for them
LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "mamba": "mamba", "linear_attention": "mamba",
               "attention": "attention", "full_attention": "attention", "mlp": "mlp"}


def layer_kinds(names) -> tuple[str, ...]:
    """A config's layer types (pattern characters or names) → our kinds; one-line error otherwise."""
    kinds = []
    for name in names:
        if name not in LAYER_KINDS:
            raise ValueError(f"layer type {name!r} is not supported (supported: Mamba2 'M'/'mamba', attention "
                             f"'*'/'attention', MLP '-'/'mlp'; routed experts 'E' are not)")
        kinds.append(LAYER_KINDS[name])
    return tuple(kinds)


def float_value(v) -> float:
    """A float from config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    mamba_heads: int
    mamba_head_dim: int
    ssm_state: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]
    rope_theta: float = 10000.0  # unused: these attention layers have no positional encoding

    @classmethod
    def from_hf(cls, c: dict) -> "NemotronHConfig":
        types = c.get("layers_block_type") or c.get("layer_types") or list(c["hybrid_override_pattern"])
        heads = c["num_attention_heads"]
        if c.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"mlp_hidden_act {c['mlp_hidden_act']!r} (only relu2 is supported)")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            layer_types=layer_kinds(types), num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c.get("attention_head_dim") or c["hidden_size"] // heads,
            rms_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            max_position=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
            mamba_heads=c["mamba_num_heads"], mamba_head_dim=c["mamba_head_dim"], ssm_state=c["ssm_state_size"],
            n_groups=c.get("n_groups", c.get("mamba_n_groups", 8)),
            conv_kernel=c.get("conv_kernel", c.get("mamba_d_conv", 4)),
            conv_bias=bool(c.get("use_conv_bias", c.get("mamba_conv_bias", True))),
            proj_bias=bool(c.get("use_bias", False)),
            # transformers clamps the step from below at time_step_min (its prefill form; its one-token
            # form does not): here every form does, so prefill and decode compute one recurrence
            dt_limit=(float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))), math.inf))


class Attention(QKVProjections):
    """GQA over the engine's KV cache; RoPE only where `rope` (Nemotron-H and Granite 4.0-H attend
    without positional encoding), softmax scale `scale` (1/sqrt(head_dim) by default), applied
    to q before the attention so that every attention form (and the CUDA kernel) serves."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, bias: bool, rope: bool,
                 scale: float | None = None):
        super().__init__()
        self.nh, self.nkv, self.d, self.rope = n_heads, n_kv, head_dim, rope
        self.q_scale = 1.0 if scale is None else scale * math.sqrt(head_dim)
        self.q_proj = Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, n_kv * head_dim, bias=bias)
        self.v_proj = Linear(hidden, n_kv * head_dim, bias=bias)
        self.o_proj = Linear(n_heads * head_dim, hidden, bias=bias)

    def forward(self, x, positions, rope: Rope, cos, sin, kv, kv_len, mask, out_scale: float = 1.0):
        """out_scale: the output times it (layers.scaled_linear: in o_proj's GEMV)."""
        T = x.shape[0]
        q, k, v = self.project_qkv(x)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k = q.view(T, self.nh, self.d).transpose(0, 1), k.view(T, self.nkv, self.d).transpose(0, 1)
        v = v.view(T, self.nkv, self.d).transpose(0, 1)
        return scaled_linear(self.o_proj, rope_and_attend(x, q, k, v, positions, rope if self.rope else None, cos, sin,
                                                          kv, kv_len, mask), out_scale)


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden, ffn, bias=bias)
        self.down_proj = Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHLayer(nn.Module):
    def __init__(self, cfg: NemotronHConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state,
                                     cfg.n_groups, cfg.conv_kernel, cfg.rms_eps, cfg.conv_bias, cfg.proj_bias,
                                     cfg.dt_limit)
        elif self.kind == "attention":
            self.mixer = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.attention_bias, rope=False)
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def state(self, cfg: NemotronHConfig):
        if self.kind == "mamba":
            return self.mixer.state()
        if self.kind == "attention":
            return AttentionState(cfg.num_kv_heads, cfg.head_dim)
        return FixedState(())

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        # Mamba2 and the MLP read h through a linear only: on CUDA the norm runs in that GEMV's prologue
        x, h = add_norm(x, self.norm, defer=self.kind != "attention")
        if self.kind == "mamba":
            h = self.mixer(h, state.fixed(i))
        elif self.kind == "attention":
            h = self.mixer(h, positions, rope, cos, sin, state.kv(i), state.kv_len, mask)
        else:
            h = self.mixer(h)
        return Residual(x, h)


class NemotronHForCausalLM(CausalLM):
    cpu_step_kind = "mamba2"  # (models/kernels/cpu/mamba2_hybrid_step.py)

    def __init__(self, cfg: NemotronHConfig):
        body = Body(cfg.vocab_size, cfg.hidden_size, [NemotronHLayer(cfg, i) for i in range(len(cfg.layer_types))],
                    RMSNorm(cfg.hidden_size, cfg.rms_eps))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta))

    def offers_cpu_step(self) -> bool:
        return True  # (the step then checks the weights it would read: mamba2_hybrid_step.supports)

    def state_spec(self):
        return [layer.state(self.config) for layer in self.model.layers]

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names → ours: `backbone.` (the released checkpoints) or `model.`, `embeddings`, `norm_f`."""
        out = {}
        for name, t in tensors.items():
            if name.startswith("mtp."):
                continue  # multi-token-prediction heads are not part of the model's forward
            if name.startswith("backbone."):
                name = "model." + name[len("backbone."):]
            name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
            if name.endswith("conv1d.weight") and t.dim() == 2:
                t = t[:, None, :]
            out[name] = t
        return out


def from_hf_config(c: dict, flags: dict) -> NemotronHForCausalLM:
    return NemotronHForCausalLM(NemotronHConfig.from_hf(c, **flags))
