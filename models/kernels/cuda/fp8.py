"""The Triton GEMV for FP8 weights (e4m3 [N, K] with one fp32 scale per 128 x 128 block, the
official Qwen FP8 layout; QWeight "FP8"): one-token forwards (decode).

Contract: `gemv(x, qw)` equals x @ W^T for W = e4m3 code * its block's scale (hf_quant.Fp8Linear's
dequantization), accumulated in fp32 and rounded once; like linear.gemv it takes a NormedRow (the
residual add and RMSNorm in its prologue, 1/rms applied to the sums at the end), a SwiGLU pair of
row halves ([gate; up]) and a bias, and launches with PDL (the first step of weights and scales
read before it waits on the previous kernel).

Why its own kernel (qlinear.py's generic one decoded FP8 as [rows, 32-weight runs] tiles with a
sum per run: 2.0-2.25 TB/s on the 27B-like matrices, bench/RESULTS.md I4b): this is linear.py's
dense GEMV with e4m3 loads. A program owns BLOCK_N rows and walks K in steps of NB 128-weight
blocks; a thread sums each 16-weight run of a row inside its registers (a conversion and an FMA
a weight), and the run's block scale multiplies that sum, into an fp32 partial per run (summed
once at the end, no reduction per step). The scales are one row per program where its rows share
one 128-row block of scales (`GROUP` 128, BLOCK_N dividing it), else per row (ROW_SCALES: `GROUP`
1, fused linears whose parts end inside a block, or SwiGLU halves not aligned to BLOCK_N).
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton
from ...formats.quant import QWeight
from .linear import PROLOGUE_MAX_BYTES, NormedRow

# Quantized matrices up to this size are read in one step per program (the whole row, before the
# PDL wait), here and in qlinear.py: a small model's launch-bound step then waits on no weight.
WHOLE_STEP_BYTES = 8 << 20


def pick_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, NB: 128-weight blocks a step, num_warps): two rows a program, eight blocks a
    step; 4 warps, 1 from 32k rows. Of 54 configs on the 27B-like shape's matrices (bench/quant_bench.py
    --sweep-fp8, bench/RESULTS.md set L): within 5% of the best on each; 10-20% faster than 4 x 4 x 4.
    A small matrix is read in one step."""
    blocks = k // 128
    if n * k <= WHOLE_STEP_BYTES and blocks <= 32:
        return 4, next_pow2(blocks), 4
    return 2, 8, (1 if n >= 32768 else 4)


def gemv(x: "torch.Tensor | NormedRow", qw: QWeight, bias: torch.Tensor | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] contiguous (or a NormedRow of one), K a multiple of 128. Returns [1, N] (swiglu:
    [1, N/2], the gate rows first) in out_dtype (x's by default). config: (BLOCK_N, NB,
    num_warps), pick_config's by default (bench/quant_bench.py --sweep-fp8 measures others)."""
    if isinstance(x, NormedRow) and (qw.nbytes() > PROLOGUE_MAX_BYTES or x._h is not None):
        x = x.materialize()
    pre = x if isinstance(x, NormedRow) else None
    src = pre.x if pre is not None else x
    n_out = qw.n // 2 if swiglu else qw.n
    bn, nb, warps = config or pick_config(n_out, qw.k)
    out = torch.empty(1, n_out, dtype=out_dtype or src.dtype, device=src.device)
    res = pre.res if pre is not None and pre.res is not None else src
    norm_w, stream, eps = (pre.weight, pre.stream, pre.eps) if pre is not None else (src, src, 0.0)
    group = qw.group or 128
    # a program's rows share one row of scales where BLOCK_N divides the rows a scale covers (and,
    # with SwiGLU, the up rows N below start on a multiple of BLOCK_N too)
    row_scales = group % bn != 0 or (swiglu and n_out % bn != 0)
    launch(_fp8_gemv_kernel, (cdiv(n_out, bn),),
           src, qw.data, qw.scales, bias if bias is not None else src, out, n_out, qw.k, qw.data.stride(0),
           qw.scales.stride(0), res, norm_w, stream, eps, GROUP=group, ROW_SCALES=row_scales,
           HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=pre is not None,
           HAS_RES=pre is not None and pre.res is not None, EVEN=qw.k % (nb * 128) == 0,
           STEPS=cdiv(qw.k, nb * 128), BLOCK_N=bn, NB=nb, num_warps=warps, **cuda_base.pdl(src))
    return out


if triton is not None:
    import triton.language as tl

    from .linear import _input_chunk, _rows_epilogue

    @triton.jit
    def _step_weights(w, sc, rows, first, step, K, stride_w, stride_s, GROUP: tl.constexpr,
                      ROW_SCALES: tl.constexpr, EVEN: tl.constexpr, NB: tl.constexpr):
        """Step `step`'s e4m3 weights of rows `rows` [BN] as fp32 [BN, 8 NB, 16] (16-weight runs),
        and the runs' scales: [BN, 8 NB] (ROW_SCALES) or [8 NB] (those of row `first`'s block,
        shared by all rows). Blocks past the row (not EVEN) read as zero weights."""
        run = step * NB * 8 + tl.arange(0, NB * 8)  # 16-weight runs of the step
        kk = run[:, None] * 16 + tl.arange(0, 16)[None, :]
        rm = None if EVEN else run < K // 16
        zero = None if EVEN else 0.0
        wv = tl.load(w + rows[:, None, None].to(tl.int64) * stride_w + kk[None, :, :],
                     mask=None if EVEN else rm[None, :, None], other=zero)
        blk = tl.minimum(run // 8, K // 128 - 1)  # (runs past the row: their inputs are zero)
        if ROW_SCALES:
            s = tl.load(sc + (rows // GROUP)[:, None] * stride_s + blk[None, :])
        else:
            s = tl.load(sc + (first // GROUP) * stride_s + blk)
        return wv.to(tl.float32), s

    @triton.jit
    def _step_sum(wv, s, xv, ROW_SCALES: tl.constexpr):
        """The step's products per run [BN, 8 NB]: each run's sum of w * x (inside a thread),
        times its scale."""
        part = tl.sum(wv * xv[None, :, :], axis=2)
        if ROW_SCALES:  # (one return: Triton types every return of a function alike)
            out = part * s
        else:
            out = part * s[None, :]
        return out

    @triton.jit
    def _fp8_gemv_kernel(x, w, sc, bias, out, N, K, stride_w, stride_s, res, norm_w, sum_out, eps,
                         GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN: tl.constexpr,
                         STEPS: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        rows = tl.minimum(n, N - 1)  # the last program's spare rows re-read a real row; not stored
        first = pid * BLOCK_N
        if PDL:  # let the next kernel launch now: it reads its first weights while this one runs
            tl.extra.cuda.gdc_launch_dependents()
        # the first step's weights and scales before waiting on the previous kernel (no kernel
        # writes them): their load latency leaves the critical path of a launch-bound step
        wv, s = _step_weights(w, sc, rows, first, 0, K, stride_w, stride_s, GROUP, ROW_SCALES, EVEN, NB)
        uv, su = wv, s
        if SWIGLU:  # the up rows sit N rows below the gate rows
            uv, su = _step_weights(w, sc, rows + N, first + N, 0, K, stride_w, stride_s, GROUP, ROW_SCALES, EVEN,
                                   NB)
        if PDL:  # the input row (and anything this kernel writes) follows the previous kernel
            tl.extra.cuda.gdc_wait()
        write = tl.where(pid == 0, K, 0)  # one program writes the residual stream
        kk = tl.arange(0, NB * 8)[:, None] * 16 + tl.arange(0, 16)[None, :]
        xv, ss = _input_chunk(x, res, norm_w, sum_out, write, kk, K, NORM, HAS_RES, EVEN)
        acc = _step_sum(wv, s, xv, ROW_SCALES)
        acc_up = acc
        if SWIGLU:
            acc_up = _step_sum(uv, su, xv, ROW_SCALES)
        for step in range(1, STEPS):  # (a constexpr: the interpreter's loop bounds must be)
            xv, sq = _input_chunk(x, res, norm_w, sum_out, write, step * NB * 128 + kk, K, NORM, HAS_RES, EVEN)
            ss += sq
            wv, s = _step_weights(w, sc, rows, first, step, K, stride_w, stride_s, GROUP, ROW_SCALES, EVEN, NB)
            acc += _step_sum(wv, s, xv, ROW_SCALES)
            if SWIGLU:
                uv, su = _step_weights(w, sc, rows + N, first + N, step, K, stride_w, stride_s, GROUP, ROW_SCALES,
                                       EVEN, NB)
                acc_up += _step_sum(uv, su, xv, ROW_SCALES)
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps)
            y = y * r
            y_up = y_up * r
        _rows_epilogue(y, y_up, bias, rows, n, nm, out, N, HAS_BIAS, SWIGLU)
