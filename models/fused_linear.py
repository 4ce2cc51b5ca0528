"""Triton GEMV for one-token linear layers on CUDA (x [1, K] @ W^T), with SwiGLU fused in.

Contract: `gemv(x, w, bias)` equals F.linear(x, w, bias) for one row, accumulated in fp32 and
rounded once; `gemv(x, w, swiglu=True)` with w = [gate; up] ([2F, K]) returns silu(x W_g^T) *
(x W_u^T), [1, F], in one launch (the torch form: a GEMM and a silu-mul kernel). Each program
owns BLOCK_N output rows and walks K in BLOCK_K steps: no split-K, so no atomics and the same
bits every run. Why not cuBLAS: for one row it measured 1.3-2 TB/s on these shapes on an H200
(bench/gemv_sweep.py prints both); the configs below are that sweep's winners.
"""
from __future__ import annotations

import torch

from .fused_cuda import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(x, w, bias, out, N, K, stride_w, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xv = tl.load(x + kk).to(tl.float32)
                m2 = nm[:, None]
            else:
                km = kk < K
                xv = tl.load(x + kk, mask=km, other=0.0).to(tl.float32)
                m2 = nm[:, None] & km[None, :]
            wv = tl.load(w + n[:, None] * stride_w + kk[None, :], mask=m2, other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
            if SWIGLU:  # the up row F rows below the gate row
                uv = tl.load(w + (n + N)[:, None] * stride_w + kk[None, :], mask=m2, other=0.0)
                acc_up += uv.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)
        if SWIGLU:
            y = y / (1.0 + tl.exp(-y)) * tl.sum(acc_up, axis=1)
        tl.store(out + n, y.to(out.dtype.element_ty), mask=nm)


def pick_config(K: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [N, K] weight: enough programs to fill the GPU's SMs
    several times over, and long K steps where there are few rows."""
    if N >= 4096:
        return 16, 256, 4
    if N >= 1024:
        return 8, 256, 4
    return 4, 512, 4


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] contiguous; w [N, K] with contiguous rows. Returns [1, N] (swiglu: [1, N/2])."""
    N, K = w.shape
    n_out = N // 2 if swiglu else N
    bn, bk, warps = config or pick_config(K, n_out)
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n_out, bn),)](x, w, bias if bias is not None else w, out, n_out, K, w.stride(0),
                                            HAS_BIAS=bias is not None, SWIGLU=swiglu, EVEN_K=K % bk == 0,
                                            BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
