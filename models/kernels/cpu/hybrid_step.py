"""The CPU decode step of the DeltaNet hybrids in C++ (hybrid_step.h, built into step.cpp's
library): Qwen3.5, Qwen3.5-MoE and Qwen3-Next (routed experts in GGUF blocks), and OLMo-Hybrid.

Contract: `HybridStep(model)(tokens, positions, state)` computes what `model(tokens, positions,
state)` computes for one token on the CPU in fp32 (the same weights: 4-bit `Int4Linear`, GGUF
blocks read as stored `BlockLinear`, or fp32 `Linear`; the same state buffers: each DeltaNet
layer's conv window and recurrent state updated in place, each attention layer's KV written at
the token's position), up to float summation order: tests/kernels/test_hybrid_step.py compares logits,
states and greedy tokens with the torch step. `verify` (speculative decoding) is CpuStep's: its
rows are one-token steps bit for bit, and the DeltaNet states after each row are kept for the
rollback of rejected drafts. `supports(model)` says which models it serves: Qwen3.5, and Qwen3.5-MoE
and Qwen3-Next where their routed experts are GGUF blocks (quant.BlockExperts: a GGUF loaded with
its blocks; other experts keep the torch step and its per-linear kernels), and OLMo-Hybrid (its
attention layers post-norm, q and k normed over all heads, RoPE or none).

Why: the torch step of a DeltaNet layer is a dozen dispatched ops around its projections and the
library's delta_decode, and an attention layer's as many again; here the whole token is one call.
"""
from __future__ import annotations

import torch

from ...quant.layers import BlockExperts
from . import step as cpu_step


def _in_projections(lin) -> list:
    """A DeltaNet layer's input linears, in project_in's order (qkv, z, b, a side by side)."""
    if hasattr(lin, "in_projs"):
        return list(lin.in_projs)
    return [lin.in_proj_qkv, lin.in_proj_z, lin.in_proj_b, lin.in_proj_a]


def _olmo_attention(layer) -> bool:
    """An OLMo-Hybrid attention layer (post-norm, q/k normed over all heads)."""
    return not layer.linear and hasattr(layer, "post_feedforward_layernorm")


def _attention_params(attn, ins) -> list:
    """q/k/v linears, the q and k norms' weights (their offsets added), o_proj: as the step reads them."""
    return (cpu_step.linears_params(ins) + [attn.q_norm.fused_weight(), attn.k_norm.fused_weight()]
            + cpu_step._linear_params(attn.o_proj))


def _routed(mlp) -> bool:
    """A routed-experts MLP (moe.SparseMoe), as against a SwiGLU one."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _routed_ok(mlp) -> bool:
    """Routed experts the step reads: GGUF blocks, an fp32 router, a shared expert (where there is
    one) of linears it reads and an fp32 gate row."""
    if not isinstance(mlp.experts, BlockExperts) or mlp.gate.weight.dtype != torch.float32:
        return False
    if not hasattr(mlp, "shared_expert"):
        return True
    se, g = mlp.shared_expert, mlp.shared_expert_gate
    parts = cpu_step._parts(se, "gate_up_proj", ("gate_proj", "up_proj")) + [se.down_proj]
    return (all(cpu_step._linear_ok(m) for m in parts) and isinstance(g, torch.nn.Linear)
            and g.weight.dtype == torch.float32 and g.bias is None)


def supports(model) -> bool:
    """Whether a Qwen3.5 hybrid has what the step reads: 4-bit, GGUF-block or fp32 linears, routed
    experts in GGUF blocks (_routed_ok), fp32 norms and DeltaNet parameters, head sizes the
    attention loops take."""
    cfg = model.config
    if cfg.head_dim > 512 or model.rope.rotary_dim % 2:
        return False
    for layer in model.model.layers:
        olmo = _olmo_attention(layer)
        norms = [layer.post_attention_layernorm] + ([layer.post_feedforward_layernorm] if olmo else
                                                    [layer.input_layernorm])
        mlp = layer.mlp
        if _routed(mlp):
            if olmo or not _routed_ok(mlp):
                return False
        elif not hasattr(mlp, "down_proj"):  # (a SwiGLU MLP)
            return False
        if layer.linear:
            lin = layer.linear_attn
            linears = _in_projections(lin) + [lin.out_proj]
            extra = [lin.conv1d.weight, lin.neg_A, lin.dt_bias32, lin.q_norm_w, lin.k_norm_w, lin.norm.weight]
            if lin.conv1d.bias is not None or any(t.dtype != torch.float32 for t in extra):
                return False
        else:
            attn = layer.self_attn
            linears = cpu_step.qkv_linears(attn) + [attn.o_proj]
            norms += [attn.q_norm, attn.k_norm]
        mlp_linears = [] if _routed(mlp) else cpu_step._parts(mlp, "gate_up_proj", ("gate_proj", "up_proj")) + [mlp.down_proj]
        if not all(cpu_step._linear_ok(m) for m in linears + mlp_linears):
            return False
        if any(n.weight.dtype != torch.float32 or n.eps != cfg.rms_eps for n in norms):
            return False
    return True


def _mlp_params(mlp) -> tuple[list, list]:
    """(the gate/up linears, the MLP's params as the step reads them after its norm): a SwiGLU's
    gate/up linears and down_proj; routed experts' router, stacks and their types [gate, up, down,
    int8 inputs], then the shared expert's gate/up linears, down_proj and gate row (moe_mlp)."""
    if not _routed(mlp):
        gu = cpu_step._parts(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        return gu, cpu_step.linears_params(gu) + cpu_step._linear_params(mlp.down_proj)
    ex = mlp.experts
    types = torch.tensor([*ex.types, int(ex.int8_inputs)], dtype=torch.int64)
    params = [mlp.gate.weight, ex.gate_blocks, ex.up_blocks, ex.down_blocks, types]
    if not hasattr(mlp, "shared_expert"):
        return [], params
    se = mlp.shared_expert
    gu = cpu_step._parts(se, "gate_up_proj", ("gate_proj", "up_proj"))
    return gu, (params + cpu_step.linears_params(gu) + cpu_step._linear_params(se.down_proj)
                + [mlp.shared_expert_gate.weight])


def serves(model, dtype: torch.dtype) -> bool:
    return cpu_step.ENABLED and dtype == torch.float32 and supports(model)


class HybridStep(cpu_step.CpuStep):
    """The decode step (one token) of a DeltaNet hybrid through the C++ library; `verify` and the
    head's rows are CpuStep's."""

    def __init__(self, model):
        cpu_step.attach_block_kernels(model)
        self.model = model
        cfg = model.config
        first = next(layer.linear_attn for layer in model.model.layers if layer.linear)
        nope = any(_olmo_attention(layer) and not layer.self_attn.rope for layer in model.model.layers)
        meta = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 0 if nope else model.rope.rotary_dim,
                first.nk, first.nv, first.dk, first.dv, int(first.out_tiled), max(1, getattr(cfg, "experts_per_tok", 0)),
                int(getattr(cfg, "norm_topk_prob", True))]
        params: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            mlp = layer.mlp
            routed = _routed(mlp)
            gu, mlp_params = _mlp_params(mlp)
            if _olmo_attention(layer):  # (no norm in front; one after the attention, one after the MLP)
                ins = cpu_step.qkv_linears(layer.self_attn)
                params += _attention_params(layer.self_attn, ins) + [layer.post_attention_layernorm.fused_weight()]
                params += mlp_params + [layer.post_feedforward_layernorm.fused_weight()]
                meta += [2, len(ins), len(gu), 0]
                continue
            params.append(layer.input_layernorm.fused_weight())
            if layer.linear:
                lin = layer.linear_attn
                ins = _in_projections(lin)
                params += cpu_step.linears_params(ins)
                params += [lin.conv1d.weight.contiguous(), lin.neg_A, lin.dt_bias32, lin.q_norm_w,
                           lin.k_norm_w, lin.norm.weight] + cpu_step._linear_params(lin.out_proj)
            else:
                ins = cpu_step.qkv_linears(layer.self_attn)
                params += _attention_params(layer.self_attn, ins)
            params += [layer.post_attention_layernorm.fused_weight()] + mlp_params
            meta += [int(layer.linear), len(ins), len(gu), int(routed)]
        self.params = [p.detach() if p is not None else None for p in params]
        self.meta = meta
        self.eps = float(cfg.rms_eps)
        self.lin_eps = float(first.norm.eps)
        self.beta_scale = float(first.beta_scale)
        self.op = torch.ops.chat_cpu.hybrid_step
        self.kv_dtype = cpu_step.kv_dtype_of(model)
        self._caches = (None, [])
        self._fixed_layers = [(i, ("conv", "recurrent")) for i, layer in enumerate(model.model.layers) if layer.linear]
        self._row_states = []

    def _run(self, x, cos, sin, state, row_states: list[torch.Tensor]) -> torch.Tensor:
        return self.op(x, cos, sin, self.params, self._state_tensors(state), self.meta, state.length, self.eps,
                       self.lin_eps, self.beta_scale, row_states)


STEP = HybridStep
