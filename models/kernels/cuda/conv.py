"""Triton kernel for a causal depthwise conv over a prompt's tokens (CUDA prefill), continuing from
a layer's conv state: the Gated DeltaNet's and Mamba2's conv (SiLU fused) and LFM2's short conv.

Contract: `causal_conv(x, state, weight, bias, silu)` with x [T, C] (columns contiguous, rows any
stride: a slice of a fused projection's output is read where it lies), state [C, K-1] (the last
K-1 inputs before x, oldest first) and weight [C, K] (or conv1d's [C, 1, K]) returns [T, C] in
x's dtype,

    y[t, c] = act(bias[c] + sum_j weight[c, j] * in[t - (K-1) + j, c]),  in[s] = x[s] (s >= 0),
                                                                          state[c, K-1+s] (s < 0),

accumulated in fp32 and rounded once, and leaves the last K-1 inputs in state (a copy after the
launch: the launch reads the old state). The torch form concatenates state and x (a copy of every
channel of the prompt), then cuDNN's depthwise conv and SiLU: the cat and the conv took a
sizeable share of the 35B-A3B-like model's 2k-token prefill on an H200 (bench/profile_step.py
--prefill 2048).
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    @triton.jit(do_not_specialize=["T"])  # (C and the strides: the model's, one compile each)
    def _causal_conv_kernel(x, state, w, bias, out, T, C, stride_x, stride_sc, stride_sk, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            PDL: tl.constexpr):
        _pdl_enter(PDL)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tm = t < T
        cm = c < C
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            s = t - (K - 1) + j  # the input this tap reads: x's row s, or the state's before x
            xm = (tm & (s >= 0))[:, None] & cm[None, :]
            sm = (tm & (s < 0))[:, None] & cm[None, :]
            xv = tl.load(x + s.to(tl.int64)[:, None] * stride_x + c[None, :], mask=xm, other=0.0)
            sv = tl.load(state + c[None, :] * stride_sc + (K - 1 + s)[:, None] * stride_sk, mask=sm, other=0.0)
            wj = tl.load(w + c * K + j, mask=cm, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out + t.to(tl.int64)[:, None] * C + c[None, :], acc.to(out.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = False) -> torch.Tensor:
    """See the module's contract. T >= 1 tokens; weight's rows contiguous."""
    T, C = x.shape
    K = weight.shape[-1]
    w = weight.reshape(C, K)
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    bt, bc = 32, 128
    launch(_causal_conv_kernel, (cdiv(T, bt), cdiv(C, bc)), x, state, w,
           bias if bias is not None else w, out, T, C, x.stride(0), state.stride(0), state.stride(1), K=K,
           HAS_BIAS=bias is not None, SILU=silu, BT=bt, BC=bc, **cuda_base.pdl(x))
    # the window's last K-1 inputs (stream order: after the launch has read the old state)
    if T >= K - 1:
        state.copy_(x[T - (K - 1):].t())
    else:
        state.copy_(torch.cat((state, x.t().to(state.dtype)), dim=1)[:, T:])
    return out


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether causal_conv serves this prefill: prefill kernels on (base.prefill_usable), x's
    columns contiguous, the weight's dtype x's (the torch form convolves in the weight's dtype)."""
    return cuda_base.prefill_usable(x) and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype \
        and weight.is_contiguous()
