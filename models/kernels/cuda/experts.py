"""Triton kernels for routed SwiGLU experts in a one-token step (CUDA): routing in one launch, the
experts in two.

Contract, routing: `route(logits, k)` computes what qwen3_5.Router computes from fp32 router
logits [1, E]: the k largest (torch.topk's order) and their softmax (= the full softmax's top k,
renormalised), in one program; idx int64 and weights fp32, [1, k] (the torch form is ~5 launches).

Contract, experts: `decode(x, gate_up, down, idx, weights)` computes what qwen3_5.Experts.forward computes
for one token: sum over the k chosen experts e of weights[e] * down[e] (silu(gate) * up), with
[gate; up] = gate_up[e] x. The torch form gathers the chosen experts' weights into new tensors
first (a copy of every active expert each step) and launches ~12 kernels; here the programs read
the chosen experts' rows where they are stored:
- up: one program per (chosen expert, block of I rows) computes its gate and up rows over all of
  K and writes silu(gate) * up in fp32;
- down: one program per block of output rows walks the k experts in order (no atomics: the same
  bits every run), weighting and summing their rows' products in fp32, and rounds once.
Where a torch op runs on the router's device tensors (idx, weights) the step stays graph-safe:
no host reads them.
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import launch, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    @triton.jit
    def _route_kernel(logits, idx_out, w_out, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr,
                      KP: tl.constexpr, PDL: tl.constexpr):
        i = tl.arange(0, EP)
        kk = tl.arange(0, KP)
        _pdl_enter(PDL)
        v = tl.load(logits + i, mask=i < E, other=float("-inf"))
        top_v = tl.full((KP,), float("-inf"), tl.float32)
        top_i = tl.zeros((KP,), dtype=tl.int64)
        for s in tl.static_range(TOPK):  # the largest left, lowest index first among equals
            m = tl.max(v, axis=0)
            j = tl.min(tl.where(v == m, i, EP), axis=0)
            top_v = tl.where(kk == s, m, top_v)
            top_i = tl.where(kk == s, j.to(tl.int64), top_i)
            v = tl.where(i == j, float("-inf"), v)
        p = tl.exp(top_v - tl.max(top_v, axis=0))
        tl.store(idx_out + kk, top_i, mask=kk < TOPK)
        tl.store(w_out + kk, p / tl.sum(p, axis=0), mask=kk < TOPK)

    @triton.jit
    def _up_kernel(x, gate_up, idx, act, H: tl.constexpr, I: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr):
        slot = tl.program_id(0)
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        rm = r < I
        _pdl_enter(PDL)
        e = tl.load(idx + slot).to(tl.int64)
        base = gate_up + e * (2 * I * H)
        g = tl.zeros((BR,), dtype=tl.float32)
        u = tl.zeros((BR,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            km = k < H
            xv = tl.load(x + k, mask=km, other=0.0).to(tl.float32)
            m = rm[:, None] & km[None, :]
            wg = tl.load(base + r[:, None] * H + k[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(base + (r[:, None] + I) * H + k[None, :], mask=m, other=0.0).to(tl.float32)
            g += tl.sum(wg * xv[None, :], axis=1)
            u += tl.sum(wu * xv[None, :], axis=1)
        tl.store(act + slot * I + r, g / (1.0 + tl.exp(-g)) * u, mask=rm)

    @triton.jit
    def _down_kernel(act, down, idx, weights, out, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                     BR: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = r < H
        _pdl_enter(PDL)
        total = tl.zeros((BR,), dtype=tl.float32)
        for slot in tl.static_range(TOPK):
            e = tl.load(idx + slot).to(tl.int64)
            base = down + e * (H * I)
            acc = tl.zeros((BR,), dtype=tl.float32)
            for k0 in range(0, I, BK):
                k = k0 + tl.arange(0, BK)
                km = k < I
                a = tl.load(act + slot * I + k, mask=km, other=0.0)
                w = tl.load(base + r[:, None] * I + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            total += tl.load(weights + slot).to(tl.float32) * acc
        tl.store(out + r, total.to(out.dtype.element_ty), mask=rm)


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [1, E] fp32 contiguous → (idx int64 [1, k], weights fp32 [1, k])."""
    E = logits.shape[-1]
    idx = torch.empty(1, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(1, k, dtype=torch.float32, device=logits.device)
    launch(_route_kernel, (1,), logits, idx, w, E=E, EP=triton.next_power_of_2(E), TOPK=k,
           KP=triton.next_power_of_2(k), **cuda_base.pdl(logits))
    return idx, w


def decode(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor,
           weights: torch.Tensor) -> torch.Tensor:
    """x [1, H] contiguous; gate_up [E, 2I, H], down [E, H, I] contiguous; idx, weights [1, k] on
    the device. Returns [1, H] in x's dtype."""
    E, two_i, H = gate_up.shape
    I, k = two_i // 2, idx.shape[-1]
    idx, weights = idx.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    act = torch.empty(k, I, dtype=torch.float32, device=x.device)
    opts = cuda_base.pdl(x)
    br, bk = 16, min(256, triton.next_power_of_2(H))
    launch(_up_kernel, (k, triton.cdiv(I, br)), x, gate_up, idx, act, H=H, I=I, BR=br, BK=bk, **opts)
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    br, bk = 16, min(256, triton.next_power_of_2(I))
    launch(_down_kernel, (triton.cdiv(H, br),), act, down, idx, weights, out, H=H, I=I, TOPK=k, BR=br, BK=bk,
           **opts)
    return out
