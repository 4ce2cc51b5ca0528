"""The Triton GEMV for FP8 weights (e4m3 [N, K] with one fp32 scale per 128 x 128 block, the
official Qwen FP8 layout; QWeight "FP8"): one-token forwards (decode).

Contract: `gemv(x, qw)` is x @ W^T for W = e4m3 code * its block's scale (hf_layers.Fp8Linear's
dequantization); like linear.gemv it takes a NormedRow (the residual add and RMSNorm in its
prologue, 1/rms applied to the sums at the end), a SwiGLU pair of row halves ([gate; up]) and a
bias, and launches with PDL (the first step of weights, and in the fp32 form its scales, read
before it waits on the previous kernel). Two forms (`takes16` picks; `form` forces one):
- fp32 products (matrices of at most WHOLE_STEP_BYTES, the CPU's interpreter, CHAT_FP8_GEMV=f32):
  accumulated in fp32 and rounded once.
- fp16 products (larger matrices on CUDA): each 16-weight run's sum is taken in fp16 pairs on
  inputs scaled by a power of two per run, then added in fp32; within 2^-8 of sum |x w| at worst
  for 16-bit inputs, ~4.4e-3 for the norm prologue's fp32 ones (one rounding more; a run whose
  largest |x| is below 2^-123 counts as zero). tests/kernels/test_quant_kernels.py bounds it by 4e-3 of
  sum |x w| (5e-3 with the prologue) and by 2e-3 of the output's rms.

Why its own kernel (qlinear.py's generic one decoded FP8 as [rows, 32-weight runs] tiles with a
sum per run, well short of the memory bandwidth on the 27B-like matrices: bench/quant_bench.py
--sweep). The fp32 form is linear.py's dense GEMV with e4m3 loads. A program owns BLOCK_N rows
and walks K in steps of NB 128-weight blocks; a thread sums each 16-weight run of a row inside its registers (a conversion
and an FMA a weight), and the run's block scale multiplies that sum, into an fp32 partial per
run (summed once at the end, no reduction per step). The scales are one row per program where its
rows share one 128-row block of scales (`GROUP` 128, BLOCK_N dividing it), else per row
(ROW_SCALES: `GROUP` 1, fused linears whose parts end inside a block, or SwiGLU halves not
aligned to BLOCK_N). Its loop issues ~5.9 instructions a weight (sm_90 SASS, bench/sass_loop.py):
the bf16 input arrives in another layout than the weights' (lanes exchange halves) and is
widened per weight. The fp16 form (`_fp8_gemv16_kernel`) gives each thread one 16-weight run of
the input and of each of the program's rows (rows loaded as separate [R, 4] word tiles, so the
input's run and the rows' runs share a thread), prepares the run's input once for all the rows
(its largest magnitude scaled into [8, 16), packed as fp16 pairs), and converts and multiplies
two codes an instruction in inline PTX (`cvt.rn.f16x2.e4m3x2`, `fma.rn.f16x2`): ~2.9
instructions a weight at 4 rows a program, and the next step's words read ahead.
"""
from __future__ import annotations


import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton
from ...quant.layers import QWeight
from .linear import PROLOGUE_MAX_BYTES, NormedRow

# Quantized matrices up to this size are read in one step per program (the whole row, before the
# PDL wait), here and in qlinear.py: a small model's launch-bound step then waits on no weight.
WHOLE_STEP_BYTES = 8 << 20
# "f16": matrices above WHOLE_STEP_BYTES on CUDA take the fp16-product form; "f32": none does
# (CHAT_FP8_GEMV, engine/config.py's Environment, set by models.configure)
FORM = "f16"


def pick_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, NB: 128-weight blocks a step, num_warps): two rows a program, eight blocks a
    step; 4 warps, 1 from 32k rows: near the best of the sweep on each of the 27B-like shape's
    matrices, and faster than 4 x 4 x 4 (bench/quant_bench.py --sweep-fp8). A small matrix is read
    in one step."""
    blocks = k // 128
    if n * k <= WHOLE_STEP_BYTES and blocks <= 32:
        return 4, next_pow2(blocks), 4
    return 2, 8, (1 if n >= 32768 else 4)


# pick_config16's rows a program for matrices of up to 8,192 rows and K above 8,192
DEEP_ROWS = 5


def pick_config16(n: int, k: int, swiglu: bool = False) -> tuple[int, int, int]:
    """The fp16-product form's (BLOCK_N rows a program, R 16-weight runs a step, num_warps = R / 32:
    a run a thread), for n outputs (a SwiGLU pair's: 2 BLOCK_N rows a program). The fastest on the
    27B-like shape's matrices (bench/quant_bench.py --sweep-fp8): few rows (N up to 8,192) on 128
    runs and 4 warps, 4 rows a program; more rows on 64 runs and 2 warps, 2 rows up to 12,288 rows
    and for a SwiGLU pair (at 4 rows its 8 rows a thread take too many registers), else 4. Where K
    passes 8,192, 5 rows (1,024 programs for 5,120 rows: faster than 2, 3, 4 or 6 rows,
    bench/quant_bench.py --sweep-fp8-rows)."""
    if n <= 8192:
        return (4 if k <= 8192 else DEEP_ROWS), 128, 4
    return (2 if n <= 12288 or swiglu else 4), 64, 2


def takes16(x: torch.Tensor, qw: QWeight) -> bool:
    """Whether gemv takes the fp16-product form by default: FORM "f16", a CUDA input (inline PTX:
    not under Triton's interpreter), a matrix above WHOLE_STEP_BYTES (the small ones keep their
    one-step form)."""
    return FORM == "f16" and x.is_cuda and qw.n * qw.k > WHOLE_STEP_BYTES


def gemv(x: "torch.Tensor | NormedRow", qw: QWeight, bias: torch.Tensor | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, config: tuple[int, int, int] | None = None,
         form: str | None = None) -> torch.Tensor:
    """x [1, K] contiguous (or a NormedRow of one), K a multiple of 128. Returns [1, N] (swiglu:
    [1, N/2], the gate rows first) in out_dtype (x's by default). form: "f16" (fp16 products)
    or "f32", takes16's by default; config: that form's (pick_config16's: BLOCK_N, R, num_warps;
    pick_config's: BLOCK_N, NB, num_warps), the pick by default (bench/quant_bench.py
    --sweep-fp8 measures others)."""
    if isinstance(x, NormedRow) and (qw.nbytes() > PROLOGUE_MAX_BYTES or x._h is not None):
        x = x.materialize()
    pre = x if isinstance(x, NormedRow) else None
    src = pre.x if pre is not None else x
    n_out = qw.n // 2 if swiglu else qw.n
    f16 = (form or ("f16" if takes16(src, qw) else "f32")) == "f16"
    bn, nb, warps = config or (pick_config16(n_out, qw.k, swiglu) if f16 else pick_config(n_out, qw.k))
    if nb & (nb - 1) or (f16 and nb < 8):  # (the fp16 form's steps are whole 128-weight blocks: 8 runs each)
        raise ValueError(f"config {bn} x {nb} x {warps}: the {'runs' if f16 else 'blocks'} a step must be a power "
                         f"of two{', at least 8' if f16 else ''}")
    out = torch.empty(1, n_out, dtype=out_dtype or src.dtype, device=src.device)
    res = pre.res if pre is not None and pre.res is not None else src
    norm_w, stream, eps = (pre.weight, pre.stream, pre.eps) if pre is not None else (src, src, 0.0)
    group = qw.group or 128
    # a program's rows share one row of scales where BLOCK_N divides the rows a scale covers (and,
    # with SwiGLU, the up rows N below start on a multiple of BLOCK_N too)
    row_scales = group % bn != 0 or (swiglu and n_out % bn != 0)
    flags = dict(GROUP=group, ROW_SCALES=row_scales, HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=pre is not None,
                 HAS_RES=pre is not None and pre.res is not None, BLOCK_N=bn, num_warps=warps, **cuda_base.pdl(src))
    b = bias if bias is not None else src
    if f16:  # (nb: R, 16-weight runs a step)
        launch(_fp8_gemv16_kernel, (cdiv(n_out, bn),), src, qw.data.view(torch.int32), qw.scales, b, out, n_out,
               qw.k, qw.data.stride(0) // 4, qw.scales.stride(0), res, norm_w, stream, eps,
               EVEN=qw.k % (nb * 16) == 0, STEPS=cdiv(qw.k, nb * 16), R=nb, **flags)
        return out
    launch(_fp8_gemv_kernel, (cdiv(n_out, bn),), src, qw.data, qw.scales, b, out, n_out, qw.k, qw.data.stride(0),
           qw.scales.stride(0), res, norm_w, stream, eps, EVEN=qw.k % (nb * 128) == 0,
           STEPS=cdiv(qw.k, nb * 128), NB=nb, **flags)
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


def _run_dot_ptx() -> str:
    """_run_dot's PTX: word $1+j (codes 4j..4j+3) as two f16 pairs times inputs $5+2j and $6+2j,
    summed into the pair c (the first product a mul), then c's lanes widened and added into $0."""
    lines = [".reg .b16 l, h;", ".reg .b32 a, b, c;", ".reg .f32 fl, fh;"]
    for j in range(4):
        first = "mul.rn.f16x2 c, a, $5;" if j == 0 else f"fma.rn.f16x2 c, a, ${5 + 2 * j}, c;"
        lines += [f"mov.b32 {{l, h}}, ${1 + j};", "cvt.rn.f16x2.e4m3x2 a, l;", "cvt.rn.f16x2.e4m3x2 b, h;", first,
                  f"fma.rn.f16x2 c, b, ${6 + 2 * j}, c;"]
    lines += ["mov.b32 {l, h}, c;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", "add.f32 $0, fl, fh;"]
    return "{\n" + "\n".join(lines) + "\n}"


if triton is not None:
    _RUN_DOT_PTX = tl.constexpr(_run_dot_ptx())

    @triton.jit
    def _pack_f16x2(lo, hi):
        """f32 pairs -> one int32 holding (f16(lo), f16(hi)): cvt.rn.f16x2.f32, one instruction."""
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _run_dot(w0, w1, w2, w3, xs):
        """A 16-weight run's sum of code * input: words w* (4 e4m3 codes each, low byte first),
        inputs xs (8 int32 of f16 pairs, low half first); the products summed in fp16 pairs (a lane
        sums 8), the two lanes added in fp32."""
        return tl.inline_asm_elementwise(
            _RUN_DOT_PTX, "=r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]],
            dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _split4(v):
        """[R, 4] -> its four columns [R] (a thread holds a row's four: no data moves)."""
        a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # (columns 0, 2 and 1, 3)
        a0, a2 = tl.split(a)
        a1, a3 = tl.split(b)
        return a0, a1, a2, a3

    @triton.jit
    def _scaled_pairs(xa, xb):
        """A run's 16 inputs (two halves [R, 8], fp32) as 8 int32 of f16 pairs, scaled by the power
        of two that puts the run's largest |x| in [8, 16) (8 products of at most 16 x 448 a lane:
        below fp16's 65504), and that scale's inverse [R]."""
        m = tl.maximum(tl.max(tl.abs(xa), axis=1), tl.max(tl.abs(xb), axis=1))
        se = tl.minimum(257 - ((m.to(tl.int32, bitcast=True) >> 23) & 255), 254)  # (biased exponents)
        s = (se << 23).to(tl.float32, bitcast=True)[:, None]
        inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
        ea, oa = tl.split(tl.reshape(xa * s, [xa.shape[0], 4, 2]))
        eb, ob = tl.split(tl.reshape(xb * s, [xb.shape[0], 4, 2]))
        p0, p1, p2, p3 = _split4(_pack_f16x2(ea, oa))
        p4, p5, p6, p7 = _split4(_pack_f16x2(eb, ob))
        return (p0, p1, p2, p3, p4, p5, p6, p7), inv

    @triton.jit
    def _rows_load(ptrs, step, K, R: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr):
        """Each row's words of step `step` (its pointers + the step's): a tuple of BN [R, 4] int32;
        runs past the row (not EVEN) read as zero codes."""
        ws = ()
        for i in tl.static_range(BN):
            if EVEN:
                ws = ws + (tl.load(ptrs[i] + step * (R * 4)),)
            else:
                rm = (step * R + tl.arange(0, R) < K // 16)[:, None]
                ws = ws + (tl.load(ptrs[i] + step * (R * 4), mask=rm, other=0),)
        return ws

    @triton.jit
    def _rows_scales(sc, first, N, blk, stride_s, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, BN: tl.constexpr):
        """Each row's run scales [R] (a tuple of BN; one shared load where the rows share a block)."""
        ss = ()
        if ROW_SCALES:
            for i in tl.static_range(BN):
                ss = ss + (tl.load(sc + (tl.minimum(first + i, N - 1) // GROUP) * stride_s + blk),)
        else:
            s0 = tl.load(sc + (first // GROUP) * stride_s + blk)
            for i in tl.static_range(BN):
                ss = ss + (s0,)
        return ss

    @triton.jit
    def _rows_acc(acc, ws, xs, ss, inv, BN: tl.constexpr):
        """Each row's run sums of this step added to its accumulator [R] (a tuple of BN): the run's
        dot in fp16 pairs, times its block scale over the input's scale."""
        new = ()
        for i in tl.static_range(BN):
            w0, w1, w2, w3 = _split4(ws[i])
            new = new + (acc[i] + _run_dot(w0, w1, w2, w3, xs) * (ss[i] * inv),)
        return new

    @triton.jit
    def _raw_halves(x, kk, K, EVEN: tl.constexpr):
        """The input at kk [R, 8] and kk + 8 as loaded (two 16-byte loads a run: a thread holds the
        run whole, in the layout of the rows' word tiles)."""
        km = None if EVEN else kk < K
        zero = None if EVEN else 0.0
        return tl.load(x + kk, mask=km, other=zero), tl.load(x + kk + 8, mask=km, other=zero)

    @triton.jit
    def _fp8_gemv16_kernel(x, w, sc, bias, out, N, K, stride_w, stride_s, res, norm_w, sum_out, eps,
                           GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN: tl.constexpr,
                           STEPS: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr):
        """Rows pid BLOCK_N.. (w: the codes as int32 words, stride_w words a row), R runs a step:
        the module docstring's fp16 form. The gate rows' words (and the up rows', N below) of step
        0 are read before the PDL wait; each step reads the next's words (and input, without
        NORM) before its own sums."""
        pid = tl.program_id(0)
        first = pid * BLOCK_N
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        run = tl.arange(0, R)
        cols = run[:, None] * 4 + tl.arange(0, 4)[None, :]
        gp = ()
        up = ()
        for i in tl.static_range(BLOCK_N):
            gp = gp + (w + tl.minimum(first + i, N - 1).to(tl.int64) * stride_w + cols,)
            if SWIGLU:
                up = up + (w + (tl.minimum(first + i, N - 1) + N).to(tl.int64) * stride_w + cols,)
        wg = _rows_load(gp, 0, K, R, EVEN, BLOCK_N)
        wu = wg
        if SWIGLU:
            wu = _rows_load(up, 0, K, R, EVEN, BLOCK_N)
        if PDL:
            tl.extra.cuda.gdc_wait()
        write = tl.where(pid == 0, K, 0)
        kk = run[:, None] * 16 + tl.arange(0, 8)[None, :]
        xa, xb = _raw_halves(x, kk, K, EVEN)
        acc = ()
        acc_up = ()
        for i in tl.static_range(BLOCK_N):
            acc = acc + (tl.zeros([R], tl.float32),)
            acc_up = acc_up + (tl.zeros([R], tl.float32),)
        ssq = tl.zeros([R], tl.float32)
        for step in range(STEPS):
            nxt = tl.minimum(step + 1, STEPS - 1)  # (the last step re-reads its own: no mask)
            ng = _rows_load(gp, nxt, K, R, EVEN, BLOCK_N)
            nu = ng
            if SWIGLU:
                nu = _rows_load(up, nxt, K, R, EVEN, BLOCK_N)
            if NORM:
                fa, qa = _input_chunk(x, res, norm_w, sum_out, write, step * R * 16 + kk, K, NORM, HAS_RES, EVEN)
                fb, qb = _input_chunk(x, res, norm_w, sum_out, write, step * R * 16 + kk + 8, K, NORM, HAS_RES, EVEN)
                ssq += tl.sum(qa, axis=1) + tl.sum(qb, axis=1)
            else:
                fa = xa.to(tl.float32)
                fb = xb.to(tl.float32)
                xa, xb = _raw_halves(x, nxt * R * 16 + kk, K, EVEN)
            xs, inv = _scaled_pairs(fa, fb)
            blk = tl.minimum(step * (R // 8) + run // 8, K // 128 - 1)
            acc = _rows_acc(acc, wg, xs, _rows_scales(sc, first, N, blk, stride_s, GROUP, ROW_SCALES, BLOCK_N), inv,
                            BLOCK_N)
            if SWIGLU:
                acc_up = _rows_acc(acc_up, wu, xs, _rows_scales(sc, first + N, 2 * N, blk, stride_s, GROUP, ROW_SCALES,
                                                                BLOCK_N), inv, BLOCK_N)
            wg = ng
            wu = nu
        r = 1.0
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(ssq, axis=0) / K + eps)
        for i in tl.static_range(BLOCK_N):
            row = first + i
            y = tl.sum(acc[i], axis=0) * r
            if HAS_BIAS:
                y += tl.load(bias + tl.minimum(row, N - 1)).to(tl.float32)
            if SWIGLU:
                yu = tl.sum(acc_up[i], axis=0) * r
                if HAS_BIAS:
                    yu += tl.load(bias + tl.minimum(row, N - 1) + N).to(tl.float32)
                y = y / (1.0 + tl.exp(-y)) * yu
            tl.store(out + row, y.to(out.dtype.element_ty), mask=row < N)
