"""The CPU decode step of the Mamba2 hybrids in C++ (mamba2_hybrid_step.h, built into step.cpp's
library): Granite 4.0-H (granitemoehybrid) and Nemotron-H.

Contract: `Mamba2HybridStep(model)(tokens, positions, state)` computes what `model(tokens,
positions, state)` computes for one token on the CPU in fp32 (the same weights: 4-bit `Int4Linear`,
GGUF blocks read as stored `BlockLinear` and `BlockExperts`, or fp32 `Linear`; the same state
buffers: each Mamba2 layer's conv window and ssm state updated in place, each attention layer's KV
written at the token's position; Granite's embedding, residual and logits multipliers), up to
float summation order: tests/kernels/test_mamba2_hybrid_step.py compares logits, states and greedy
tokens with the torch step. `verify` (speculative decoding) is CpuStep's: its rows are one-token
steps bit for bit, and the Mamba2 states after each row are kept for the rollback of rejected
drafts. `supports(model)` says which models it serves: every layer's linears 4-bit, GGUF blocks or
fp32, its routed experts (Granite's) GGUF blocks with an fp32 router, fp32 norms and mixer
parameters, one set of mixer sizes, head sizes the attention loops take.

Why: the torch step of a Mamba2 layer is its projections around the library's mamba2_decode plus
the norm, the residual multiplier and the add; an attention layer's a dozen ops more, and a
Granite MLP's routing, experts and shared MLP as many again; here the whole token is one call.
"""
from __future__ import annotations

import torch

from ...quant.layers import BlockExperts
from . import step as cpu_step

# the block kinds of mamba2_hybrid_step.h's meta
MAMBA, ATTENTION, SWIGLU, RELU_SQUARED, ROUTED = 1, 2, 3, 4, 5


def _blocks(model) -> list[tuple[int, object, object]]:
    """The model's pre-norm blocks in order, (kind, norm, module): a Granite layer's mixer then its
    MLP (routed experts beside the shared MLP: the layer itself), a Nemotron-H layer's one block."""
    out = []
    for layer in model.model.layers:
        if hasattr(layer, "mixer"):  # Nemotron-H: norm, then one block
            kind = {"mamba": MAMBA, "attention": ATTENTION, "mlp": RELU_SQUARED}[layer.kind]
            out.append((kind, layer.norm, layer.mixer))
            continue
        mixer = layer.mamba if layer.kind == "mamba" else layer.self_attn
        out.append((MAMBA if layer.kind == "mamba" else ATTENTION, layer.input_layernorm, mixer))
        out.append((ROUTED, layer.post_attention_layernorm, layer) if hasattr(layer, "block_sparse_moe")
                   else (SWIGLU, layer.post_attention_layernorm, layer.shared_mlp))
    return out


def _gate_up(mlp) -> list:
    return cpu_step._parts(mlp, "gate_up_proj", ("gate_proj", "up_proj"))


def _linears(kind: int, m) -> list:
    """The block's linears as the step reads them, in order."""
    if kind == MAMBA:
        return [m.in_proj, m.out_proj]
    if kind == ATTENTION:
        return cpu_step.qkv_linears(m) + [m.o_proj]
    if kind == SWIGLU:
        return _gate_up(m) + [m.down_proj]
    if kind == RELU_SQUARED:
        return [m.up_proj, m.down_proj]
    return _gate_up(m.shared_mlp) + [m.shared_mlp.down_proj]


def _fp32(*tensors) -> bool:
    return all(t is None or t.dtype == torch.float32 for t in tensors)


def supports(model) -> bool:
    """Whether a Mamba2 hybrid has what the step reads (the module docstring's list)."""
    cfg = model.config
    if cfg.head_dim > 512 or model.rope.rotary_dim % 2:
        return False
    for kind, norm, m in _blocks(model):
        if not all(cpu_step._linear_ok(x) for x in _linears(kind, m)):
            return False
        if norm.weight.dtype != torch.float32 or norm.eps != cfg.rms_eps or norm.offset != 0.0:
            return False
        if kind == MAMBA:
            if (not _fp32(m.conv1d.weight, m.conv1d.bias, m.A, m.dt_bias32, m.D32, m.norm.weight)
                    or m.norm.eps != cfg.rms_eps or (m.H, m.P, m.N, m.G) != _mixer_sizes(cfg)):
                return False
        elif kind == ROUTED:
            moe = m.block_sparse_moe
            if not isinstance(moe.experts, BlockExperts) or moe.router.weight.dtype != torch.float32:
                return False
    return True


def _mixer_sizes(cfg) -> tuple[int, int, int, int]:
    return cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state, cfg.n_groups


def serves(model, dtype: torch.dtype) -> bool:
    return cpu_step.ENABLED and dtype == torch.float32 and supports(model)


def _input_parts(kind: int, m) -> int:
    """The block's input linears' count in meta: an attention's q/k/v (one fused or three), a
    SwiGLU's or the routed block's shared gate/up (one fused or two); 1 for the others."""
    if kind == ATTENTION:
        return len(cpu_step.qkv_linears(m))
    if kind in (SWIGLU, ROUTED):
        return len(_gate_up(m.shared_mlp if kind == ROUTED else m))
    return 1


def _block_params(kind: int, norm, m) -> list:
    """A block's params after its kind: mamba2_hybrid_step.h's list."""
    if kind == ROUTED:
        moe, ex = m.block_sparse_moe, m.block_sparse_moe.experts
        types = torch.tensor([*ex.types, int(ex.int8_inputs)], dtype=torch.int64)
        shared = m.shared_mlp
        return ([norm.weight, moe.router.weight, ex.gate_blocks, ex.up_blocks, ex.down_blocks, types]
                + cpu_step.linears_params(_gate_up(shared)) + cpu_step._linear_params(shared.down_proj))
    params = [norm.weight]
    if kind == MAMBA:
        bias = m.conv1d.bias.detach() if m.conv1d.bias is not None else None
        return (params + cpu_step._linear_params(m.in_proj)
                + [m.conv1d.weight[:, 0].contiguous(), bias, m.A, m.dt_bias32, m.D32, m.norm.weight]
                + cpu_step._linear_params(m.out_proj))
    return params + cpu_step.linears_params(_linears(kind, m))


class Mamba2HybridStep(cpu_step.CpuStep):
    """The decode step (one token) of a Mamba2 hybrid through the C++ library; `verify` and the
    head's rows are CpuStep's."""

    def __init__(self, model):
        cpu_step.attach_block_kernels(model)
        self.model = model
        cfg = model.config
        granite = hasattr(cfg, "residual_multiplier")
        meta = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.rope.rotary_dim if getattr(cfg, "rope", False) else 0,
                *_mixer_sizes(cfg), max(1, getattr(cfg, "experts_per_tok", 0)), int(getattr(cfg, "norm_topk_prob", True))]
        params: list[torch.Tensor | None] = []
        q_scale = 1.0
        for kind, norm, m in _blocks(model):
            params += _block_params(kind, norm, m)
            meta += [kind, _input_parts(kind, m)]
            if kind == ATTENTION:
                q_scale = m.q_scale
        self.params = [p.detach() if p is not None else None for p in params]
        self.meta = meta
        self.eps = float(cfg.rms_eps)
        self.scale = float(cfg.residual_multiplier) if granite else 1.0
        self.q_scale = float(q_scale)
        self.dt_limit = tuple(float(v) for v in cfg.dt_limit)
        self.op = torch.ops.chat_cpu.mamba2_hybrid_step
        self.kv_dtype = cpu_step.kv_dtype_of(model)
        self._caches = (None, [])
        self._fixed_layers = [(i, ("conv", "ssm")) for i, layer in enumerate(model.model.layers)
                              if layer.kind == "mamba"]
        self._row_states = []

    def _state_tensors(self, state) -> list[torch.Tensor]:
        if self._caches[0] is not state:  # (a Nemotron-H MLP layer holds no state)
            kinds = [layer.kind for layer in self.model.model.layers]
            self._caches = (state, [t for i, kind in enumerate(kinds) for t in
                                    ([state.fixed(i)["conv"], state.fixed(i)["ssm"]] if kind == "mamba"
                                     else state.kv(i) if kind == "attention" else [])])
        return self._caches[1]

    def _run(self, x, cos, sin, state, row_states: list[torch.Tensor]) -> torch.Tensor:
        return self.op(x, cos, sin, self.params, self._state_tensors(state), self.meta, state.length, self.eps,
                       self.scale, self.q_scale, self.eps, *self.dt_limit, row_states)


STEP = Mamba2HybridStep
