"""Triton grouped GEMMs of the MoE prefill (moe.Experts.grouped on CUDA): each expert's rows of
the (token, slot) pairs sorted by expert, through its SwiGLU experts.

Contract:
- gate_up(x, src, starts, offs, gate_up_w): h [P, I] in x's dtype, row r = silu(g) * u with
  g, u = gate_up_w[e] x[src[r]] (gate rows first) for the expert e whose rows starts[e] ..
  offs[e] - 1 hold r. x's rows are read where they lie (src: each sorted row's token), so the
  sorted copy of x that torch._grouped_mm needs is never written, and the SwiGLU is the GEMM's
  epilogue, from its fp32 sums (one rounding, where the torch form rounds g and u first).
- down(h, starts, offs, down_w): ys [P, H], row r = down_w[e] h[r].
One launch each, a program per (tile of BLOCK_M rows of one expert, BLOCK_N columns); which expert
and rows a program takes is read on the device from starts/offs (no host sync), programs past the
last tile do nothing, and a tile of at most BLOCK_M / 2 live rows multiplies as a tile of
BLOCK_M / 2 (the same sums over K, in the same order: a row's bits do not depend on its tile).
Launch order: gate_up's row tiles of one column block are neighbours (an expert's weights are
read from memory about once however many row tiles it has; x, a few MB, stays in L2); down's
column blocks of one row tile are neighbours (its rows of h are read once, and the next tile of
the same expert finds the expert's weights, ~3 MB at the 30B-A3B-like shape, in L2). Sums in fp32
over K in a fixed order: the same bits every run. The experts' K (H for gate_up, I for down) must
be a multiple of BLOCK_K (`fits`).
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    @triton.jit
    def _tile(t, starts, offs, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """(expert, first row, end of its rows) of row tile t; expert E past the last tile."""
        e = tl.arange(0, BLOCK_E)
        em = e < E
        beg = tl.load(starts + e, mask=em, other=0)
        end = tl.load(offs + e, mask=em, other=0)
        tiles = (end - beg + BLOCK_M - 1) // BLOCK_M
        before = tl.cumsum(tiles, axis=0)                           # tiles of experts 0..e
        ex = tl.sum((before <= t).to(tl.int32), axis=0)
        mine = e == ex
        row0 = tl.sum(tl.where(mine, beg + (t - (before - tiles)) * BLOCK_M, 0), axis=0)
        return ex, row0, tl.sum(tl.where(mine, end, 0), axis=0)

    @triton.jit
    def _gate_up_tile(x, src, w, h, ex, row0, row_end, stride_x, stride_we, I: tl.constexpr, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = row0 + tl.arange(0, BLOCK_M)
        rm = rows < row_end
        tok = tl.load(src + rows, mask=rm, other=0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        k = tl.arange(0, BLOCK_K)
        a_ptrs = x + tok[:, None] * stride_x + k[None, :]
        g_ptrs = w + ex.to(tl.int64) * stride_we + n[None, :] * K + k[:, None]   # [BLOCK_K, BLOCK_N]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=rm[:, None], other=0.0)
            acc_g = tl.dot(a, tl.load(g_ptrs + k0, mask=nm[None, :], other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(g_ptrs + (I * K + k0), mask=nm[None, :], other=0.0), acc_u)
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h + rows.to(tl.int64)[:, None] * I + n[None, :], out.to(h.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])

    @triton.jit
    def _gate_up_kernel(x, src, starts, offs, w, h, E, stride_x, stride_we, I: tl.constexpr, K: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HALF: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        ex, row0, row_end = _tile(tl.program_id(0), starts, offs, E, BLOCK_M, BLOCK_E)
        if ex < E:
            if HALF and row_end - row0 <= BLOCK_M // 2:  # an expert's last rows: half the products
                _gate_up_tile(x, src, w, h, ex, row0, row_end, stride_x, stride_we, I, K, BLOCK_M // 2, BLOCK_N,
                              BLOCK_K)
            else:
                _gate_up_tile(x, src, w, h, ex, row0, row_end, stride_x, stride_we, I, K, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _down_tile(hs, w, ys, ex, row0, row_end, stride_we, N: tl.constexpr, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = row0 + tl.arange(0, BLOCK_M)
        rm = rows < row_end
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        k = tl.arange(0, BLOCK_K)
        a_ptrs = hs + rows.to(tl.int64)[:, None] * K + k[None, :]
        b_ptrs = w + ex.to(tl.int64) * stride_we + n[None, :] * K + k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=rm[:, None], other=0.0)
            acc = tl.dot(a, tl.load(b_ptrs + k0, mask=nm[None, :], other=0.0), acc)
        tl.store(ys + rows.to(tl.int64)[:, None] * N + n[None, :], acc.to(ys.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])

    @triton.jit
    def _down_kernel(hs, starts, offs, w, ys, E, stride_we, N: tl.constexpr, K: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HALF: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        # the column blocks of one row tile are neighbours in launch order (program_id(0)): its rows
        # of h are read from memory once, where the tile-major order read them once a column block
        # (h is [T k, I]: 16 times at the 30B-A3B-like shape, as many bytes as the experts' weights)
        ex, row0, row_end = _tile(tl.program_id(1), starts, offs, E, BLOCK_M, BLOCK_E)
        if ex < E:
            if HALF and row_end - row0 <= BLOCK_M // 2:
                _down_tile(hs, w, ys, ex, row0, row_end, stride_we, N, K, BLOCK_M // 2, BLOCK_N, BLOCK_K)
            else:
                _down_tile(hs, w, ys, ex, row0, row_end, stride_we, N, K, BLOCK_M, BLOCK_N, BLOCK_K)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of each launch, from bench/moe_prefill_sweep.py
# on an H200 (down at the 30B-A3B-like 2k prefill faster than 128 x 128 x 64 x 8 x 3; its K, 768,
# is 12 steps of 64, and four stages of 128 x 64 + 64 x 256 bf16 are 192 KB of the 227 KB of
# shared memory)
GATE_UP_CONFIG = (128, 128, 64, 8, 4)
DOWN_CONFIG = (128, 256, 64, 8, 4)
# A tile holding at most BLOCK_M / 2 rows (an expert's last rows) multiplies them as a tile of
# BLOCK_M / 2: at ~BLOCK_M rows an expert (the 30B-A3B-like 2k prefill: 128 on average) about half
# the experts spill a few rows into a second tile, which otherwise costs a whole tile's products
# (bench/moe_prefill_sweep.py times both). HALF_TILES = False: every tile whole (the A/B of
# bench/ab_prefill.py).
# (Only where BLOCK_M >= 32: the tensor cores' products take at least 16 rows.)
HALF_TILES = True


def fits(hidden: int, intermediate: int) -> bool:
    """Whether both launches take experts of these sizes: each K a multiple of BLOCK_K."""
    return hidden % GATE_UP_CONFIG[2] == 0 and intermediate % DOWN_CONFIG[2] == 0


def _max_tiles(P: int, E: int, block_m: int) -> int:
    """An upper bound of the row tiles over all experts: sum_e ceil(n_e / BLOCK_M), sum_e n_e = P."""
    return (P + E * (block_m - 1)) // block_m


def gate_up(x: torch.Tensor, src: torch.Tensor, starts: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
            config: tuple | None = None) -> torch.Tensor:
    """x [T, H] (rows of unit stride); src [P] int32 (each sorted row's token); starts, offs [E]
    int32; w [E, 2I, H] contiguous. Returns h [P, I] in x's dtype."""
    E, I2, H = w.shape
    P = src.shape[0]
    bm, bn, bk, warps, stages = config or GATE_UP_CONFIG
    h = torch.empty(P, I2 // 2, dtype=x.dtype, device=x.device)
    launch(_gate_up_kernel, (_max_tiles(P, E, bm), cdiv(I2 // 2, bn)), x, src, starts, offs, w, h, E,
           x.stride(0), w.stride(0), I=I2 // 2, K=H, BLOCK_E=next_pow2(E), BLOCK_M=bm, BLOCK_N=bn,
           BLOCK_K=bk, HALF=HALF_TILES and bm >= 32, num_warps=warps, num_stages=stages, **cuda_base.pdl(x))
    return h


def down(h: torch.Tensor, starts: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
         config: tuple | None = None) -> torch.Tensor:
    """h [P, I] contiguous (sorted rows); w [E, H, I] contiguous. Returns ys [P, H] in h's dtype."""
    E, H, I = w.shape
    P = h.shape[0]
    bm, bn, bk, warps, stages = config or DOWN_CONFIG
    ys = torch.empty(P, H, dtype=h.dtype, device=h.device)
    launch(_down_kernel, (cdiv(H, bn), _max_tiles(P, E, bm)), h, starts, offs, w, ys, E, w.stride(0),
           N=H, K=I, BLOCK_E=next_pow2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HALF=HALF_TILES and bm >= 32,
           num_warps=warps, num_stages=stages, **cuda_base.pdl(h))
    return ys
