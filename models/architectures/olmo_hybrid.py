"""OLMo-Hybrid: Gated DeltaNet layers (pre-norm) interleaved with OLMo-3 attention layers (post-norm).

The DeltaNet layers are qwen3_5.py's GatedDeltaNet with OLMo's two differences as data
(beta = 2 sigmoid(b), which allows negative eigenvalues; the gated norm's own epsilon), value heads
grouped over key heads as there; their conv and recurrent state is declared as qwen3_5's is and
owned by the engine's StateManager. OLMo's separate q/k/v, g (the output gate), a, b projections
are joined into that layout once, in `checkpoint_names`. Attention layers normalise q and k over
all heads at once (not per head), apply RoPE (or none: NoPE, when the config gives no rope_theta)
and add their output and their MLP's to the residual stream after a norm each, with no norm in
front.
"""
from __future__ import annotations

import torch
from torch import nn

from .causal_lm import Body, CausalLM
from .layers import Linear, QKVProjections, Residual, RMSNorm, Rope, SwiGLU, add_norm, rope_and_attend
from .qwen3_5 import GatedDeltaNet, HybridConfig
from .state_spec import AttentionState, StateView


def config_from_hf(c: dict) -> tuple[HybridConfig, bool]:
    """(the hybrid config, whether attention applies RoPE), with transformers' defaults."""
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    types = c.get("layer_types") or [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)]
    if "full_attention" not in types:
        types = list(types[:-1]) + ["full_attention"]
    nk = c.get("linear_num_key_heads") or heads
    nv = c.get("linear_num_value_heads") or heads
    if nv % nk:  # each key head serves nv / nk consecutive value heads, as in Qwen3.5's DeltaNet
        raise ValueError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    dk = c.get("linear_key_head_dim") or int(0.75 * c["hidden_size"] / nk)
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} (only default RoPE is supported here)")
    theta = rope.get("rope_theta", c.get("rope_theta"))
    head_dim = c["hidden_size"] // heads
    cfg = HybridConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        layer_types=tuple(types), num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=head_dim, rope_theta=float(theta or 10000.0), rotary_dim=head_dim,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), max_position=int(c.get("max_position_embeddings", 65536)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), attention_bias=bool(c.get("attention_bias", False)),
        lin_k_heads=nk, lin_v_heads=nv, lin_k_dim=dk, lin_v_dim=c.get("linear_value_head_dim") or 2 * dk,
        conv_kernel=c.get("linear_conv_kernel_dim", 4),
        beta_scale=2.0 if c.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5)
    return cfg, theta is not None


class OlmoAttention(QKVProjections):
    """GQA with q and k RMS-normalised over all their heads together, then RoPE (unless NoPE)."""

    def __init__(self, cfg: HybridConfig, rope: bool):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d, self.rope = cfg.num_heads, cfg.num_kv_heads, d, rope
        self.q_proj = Linear(h, self.nh * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.nkv * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.nkv * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.nh * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.nh * d, cfg.rms_eps)
        self.k_norm = RMSNorm(self.nkv * d, cfg.rms_eps)

    def forward(self, x, positions, rope: Rope, cos, sin, kv, kv_len, mask):
        T = x.shape[0]
        q, k, v = self.project_qkv(x)
        q = self.q_norm(q).view(T, self.nh, self.d).transpose(0, 1)
        k = self.k_norm(k).view(T, self.nkv, self.d).transpose(0, 1)
        v = v.view(T, self.nkv, self.d).transpose(0, 1)
        return self.o_proj(rope_and_attend(x, q, k, v, positions, rope if self.rope else None, cos, sin, kv, kv_len,
                                           mask))


class OlmoHybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, i: int, rope: bool):
        super().__init__()
        self.linear = cfg.layer_types[i] == "linear_attention"
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        else:
            self.self_attn = OlmoAttention(cfg, rope)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        if self.linear:  # pre-norm, as Llama
            x, h = add_norm(x, self.input_layernorm, defer=True)
            x, h = add_norm(Residual(x, self.linear_attn(h, state.fixed(i))), self.post_attention_layernorm,
                            defer=True)
            return Residual(x, self.mlp(h))
        x = x.x + x.branch if isinstance(x, Residual) else x  # post-norm: the stream itself goes in
        h = self.self_attn(x, positions, rope, cos, sin, state.kv(i), state.kv_len, mask)
        x = x + self.post_attention_layernorm(h)
        return Residual(x, self.post_feedforward_layernorm(self.mlp(x)))


# OLMo's DeltaNet names → qwen3_5.GatedDeltaNet's (q, k, v are joined into in_proj_qkv)
_DELTA_NAMES = {"g_proj": "in_proj_z", "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_norm": "norm",
                "o_proj": "out_proj"}


class OlmoHybridForCausalLM(CausalLM):
    def __init__(self, cfg: HybridConfig, rope: bool = True):
        body = Body(cfg.vocab_size, cfg.hidden_size,
                    [OlmoHybridLayer(cfg, i, rope) for i in range(len(cfg.layer_types))],
                    RMSNorm(cfg.hidden_size, cfg.rms_eps))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta))

    cpu_step_kind = "hybrid"  # (models/kernels/cpu/hybrid_step.py)

    def offers_cpu_step(self) -> bool:
        return True

    def state_spec(self):
        c = self.config
        return [layer.linear_attn.state() if layer.linear else AttentionState(c.num_kv_heads, c.head_dim)
                for layer in self.model.layers]

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names → ours: each DeltaNet's q/k/v projections joined (in that order) into
        in_proj_qkv, and in the published layout (which transformers 5 also saves) the DeltaNet
        layers' attention_layer_norm / feedforward_layer_norm and their per-part q/k/v convs."""
        out: dict[str, torch.Tensor] = {}
        joined: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            name = name.replace(".attention_layer_norm.", ".input_layernorm.").replace(
                ".feedforward_layer_norm.", ".post_attention_layernorm.")
            if ".linear_attn." in name:
                prefix, leaf = name.split(".linear_attn.")
                part = leaf.split(".")[0]
                if part in ("q_proj", "k_proj", "v_proj"):
                    joined.setdefault((prefix, "in_proj_qkv"), {})[part[0]] = t
                    continue
                if part in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    joined.setdefault((prefix, "conv1d"), {})[part[0]] = t if t.dim() == 3 else t[:, None, :]
                    continue
                if part in _DELTA_NAMES:
                    name = f"{prefix}.linear_attn.{_DELTA_NAMES[part]}{leaf[len(part):]}"
            out[name] = t
        for (prefix, target), parts in joined.items():
            out[f"{prefix}.linear_attn.{target}.weight"] = torch.cat([parts[p] for p in "qkv"])
        return out


def from_hf_config(c: dict, flags: dict) -> OlmoHybridForCausalLM:
    cfg, rope = config_from_hf(c)
    return OlmoHybridForCausalLM(cfg, rope)
