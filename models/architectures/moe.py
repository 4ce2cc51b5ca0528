"""Mixture-of-experts MLPs: a softmax top-k router over SwiGLU experts, with an optional shared
expert (sigmoid-gated). Used by Qwen3-MoE (no shared expert), Qwen3-Next and Qwen3.5-MoE.

The experts are stored as 3D tensors (the transformers 5 layout: `gate_up_proj` [E, 2*I, H] with
gate rows first, `down_proj` [E, H, I]); `stack_experts` turns hub checkpoints' per-expert 2D
weights into it. The layer takes [T, H] and returns [T, H]; routing weights stay fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, SwiGLU


class Experts(nn.Module):
    """Routed SwiGLU experts stored as 3D tensors."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; idx (int64), weights (fp32) [T, top_k]."""
        if x.shape[0] == 1:  # decode: gather the chosen experts (no data-dependent control flow)
            gate, up = torch.einsum("kih,h->ki", self.gate_up_proj[idx[0]], x[0]).chunk(2, dim=-1)
            y = torch.einsum("khi,ki->kh", self.down_proj[idx[0]], F.silu(gate) * up)
            return (y * weights[0][:, None].to(y.dtype)).sum(0, keepdim=True)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


class Router(nn.Module):
    """Softmax over all experts in fp32, then the top k (renormalised to sum 1 if norm_topk)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.norm_topk = top_k, norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights


class SparseMoe(nn.Module):
    """`mlp.*` in checkpoint names: gate (the router), experts, and where shared_intermediate > 0
    shared_expert + shared_expert_gate."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk: bool = True,
                 shared_intermediate: int = 0):
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, norm_topk)
        self.experts = Experts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.gate(x)
        out = self.experts(x, idx, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub checkpoints' `...mlp.experts.<e>.{gate,up,down}_proj.weight` (2D each) → the 3D
    `...mlp.experts.gate_up_proj` / `down_proj`; every other name passes through. The dict is
    consumed as it is read (no second copy of the experts is held)."""
    out: dict[str, torch.Tensor] = {}
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        t = tensors.pop(name)
        prefix, sep, rest = name.partition(".mlp.experts.")
        parts = rest.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            per.setdefault(prefix, {}).setdefault(int(parts[0]), {})[parts[1]] = t
        else:
            out[name] = t
    for prefix, experts in per.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[e]) != 3 for e in ids):
            raise ValueError(f"{prefix}.mlp.experts: the per-expert weights are incomplete")
        out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids])
        out[prefix + ".mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


def num_experts(config: dict) -> int:
    """The routed experts' count: `num_experts` in hub configs, `num_local_experts` where
    transformers 5 writes it (its attribute map renames the key on save)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)
