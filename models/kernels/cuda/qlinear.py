"""Triton kernels for linears on quantized weights: a dequant-GEMV for one-token forwards (decode)
and a dequantize-to-tiles kernel for many-token forwards (prefill: its bf16 rows go to torch's
tensor-core GEMM).

Contract: `gemv(x, qw)` equals x @ W^T for W = the weights `qw` encodes (as the torch
dequantizers in models/formats/gguf_blocks.py and hf_quant.py give them), accumulated in fp32
and rounded once; `dequantize(qw, start, stop, dtype)` gives rows start..stop of W, each weight
computed as scale * code - offset in fp32 and rounded once to dtype. Like linear.gemv, a GEMV
takes a NormedRow (the residual add and RMSNorm in its prologue), a SwiGLU pair of row halves,
a bias, and PDL (it lets the next kernel launch at its start, decodes its first step of weights,
then waits for the previous one).

Weights are read as stored (formats in `FORMATS`): GGUF blocks as the file's bytes (32-weight
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; 256-weight Q4_K, Q5_K, Q6_K), FP8 e4m3 with one fp32 scale per
128 x 128 block, and "INT4": 4-bit codes with an fp16 scale and a uint8 zero per group of rows'
weights (AWQ and GPTQ checkpoints, unpacked by formats/hf_quant.py and packed at load by
quant/hf_layers.py). Every format is decoded the same way: a program's step of K covers W weights
of BLOCK_N rows as two [BLOCK_N, S, L] code tiles (`lo`, `hi`: a byte's two nibbles where there are nibbles), with a scale and an offset per
[row, s] (weight = scale * code - offset); the GEMV sums code * x over L first and applies the
scale once per sub-block, so each weight costs a few integer ops and one FMA. Codes become fp32
through the exponent trick (q | 0x4B000000 is the float 2^23 + q; subtract 2^23) rather than an
int-to-float conversion, which runs at a fraction of the FMA rate: at 4 bits a weight, an H200's
bandwidth delivers ~8e12 weights a second, a budget of a few instructions each.
"""
from __future__ import annotations

import torch

from . import base as cuda_base, fp8, fp8_gemm, qplanar, qruns
from .base import cdiv, launch, triton
from ...quant.layers import QWeight
from .linear import PROLOGUE_MAX_BYTES, NormedRow

# format name → (constexpr id, bytes per block (GGUF), weights per block, weights per sub-block s, L)
FORMATS = {
    "Q4_0": (0, 18, 32, 32, 16), "Q4_1": (1, 20, 32, 32, 16), "Q5_0": (2, 22, 32, 32, 16),
    "Q5_1": (3, 24, 32, 32, 16), "Q8_0": (4, 34, 32, 32, 16),
    "Q4_K": (5, 144, 256, 64, 32), "Q5_K": (6, 176, 256, 64, 32), "Q6_K": (7, 210, 256, 32, 16),
    "FP8": (8, 0, 128, 32, 16), "INT4": (9, 0, 128, 32, 16),
}
# Weights a program decodes per step of K (at most; fewer where K asks): a step's loads are what
# each program has in flight, and a GEMV on the large models is bound by bytes in flight
# (Little's law: ~3 MB across an H200 to reach its bandwidth).
STEP_WEIGHTS = 1024
# Matrices up to fp8.WHOLE_STEP_BYTES are decoded in one step of K where `STEP_WEIGHTS` allows.
WHOLE_STEP_BYTES = fp8.WHOLE_STEP_BYTES
# Those matrices' (BLOCK_N, num_warps, most weights a step, one step for the whole row): rows of up
# to 4,096 weights in one step for WHOLE_WIDE's formats (no SwiGLU pair), up to 2,048 for the others
# (whole_step), so that the small K-quant matrices the kernel plan leaves in their blocks
# (KernelConfig.planar_min_weights) are read in one step (the 0.8B-like Q4_K decode faster than at 2,048:
# bench/ab_decode.py's w2k); several steps were much slower (its qw* variants, qw2x2s1024 and
# others). Longer rows: steps of STEP_WEIGHTS.
WHOLE_CONFIG = (2, 2, 4096, True)
# The formats whose 4,096-weight step compiles without spilling registers (ptxas for sm_90, 2 rows x
# 2 warps: Q4_K 229 registers, Q8_0 240; Q5_0, Q5_1, Q5_K and Q6_K spill 44-272 bytes, and every
# format with a SwiGLU pair's up rows; at 2,048 none spills, Q5_K's pair 243 registers)
WHOLE_WIDE = ("Q4_K", "Q8_0")


def fits(fmt: str, k: int, group: int | None = None) -> bool:
    """Whether the kernels take a row of k weights in this format (whole blocks; the planar
    layouts: qplanar.py's, whose repacks checked their groups). Q4KR, and INT4 in `group`s of
    whole 32-weight runs: qruns.serves; other INT4 rows, whole 128s."""
    return qruns.serves(fmt, k, group) or fmt in qplanar.FMTS or (fmt in FORMATS and k % FORMATS[fmt][2] == 0)


def _step(fmt: str, k: int, most: int = STEP_WEIGHTS, whole: bool = False) -> tuple[int, int]:
    """(W, S): weights a step and sub-blocks a step. W is a power-of-two multiple of the format's
    block, up to `most`; the last step is padded where W does not divide the row (blocks past
    the row re-read its last block, multiplied by inputs masked to zero): `whole`, one step for
    the whole row where `most` allows (a small matrix decoded before the PDL wait), otherwise the
    largest W that pads by an eighth at most."""
    _, _, block, sub, _ = FORMATS[fmt]
    w = block
    while w * 2 <= max(most, block) and w < k:
        padded = -(-k // (w * 2)) * (w * 2)
        if not whole and padded * 8 > k * 9:
            break
        w *= 2
    return w, w // sub


def usable(x) -> bool:
    """Whether the Triton kernels serve this forward: CUDA, Triton on, not inside torch.compile
    (any float dtype: nothing here rounds to TF32)."""
    return cuda_base.ENABLED and x.is_cuda and not torch.compiler.is_compiling()


def _args(qw: QWeight, most: int = STEP_WEIGHTS, whole: bool = False):
    fid, nbytes, _, _, L = FORMATS[qw.fmt]
    w, s = _step(qw.fmt, qw.k, most, whole)
    sc = qw.scales if qw.scales is not None else qw.data
    z = qw.zeros if qw.zeros is not None else qw.data
    stride_s = qw.scales.stride(0) if qw.scales is not None else 0
    return (sc, z, stride_s), dict(FMT=fid, BYTES=nbytes, W=w, S=s, L=L, GROUP=qw.group or 1, EVEN=qw.k % w == 0)


def whole_step(fmt: str, k: int, swiglu: bool = False) -> int:
    """Most weights a step for a matrix read `whole` (at most WHOLE_STEP_BYTES): rows of up to
    4,096 weights in one step for WHOLE_WIDE's formats without a SwiGLU pair, up to 2,048 for the
    others (ptxas: they spill at 4,096), longer rows in steps of STEP_WEIGHTS."""
    most = WHOLE_CONFIG[2] if fmt in WHOLE_WIDE and not swiglu else min(WHOLE_CONFIG[2], 2048)
    return most if k <= most else STEP_WEIGHTS


def pick_config(qw: QWeight, swiglu: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, most weights a step) of gemv on qw (its gate and up halves where
    swiglu). Measured on an H200 (bench/quant_bench.py --sweep-small):
    - an LM head's rows (n >= 16384): one warp a program, 256 weights a step; 16 rows for the
      32-weight-block formats (the 0.5B-like shape's Q5_0 head [151936, 896]: several times
      faster than the 8 x 8 x 1024 taken before), 8 for the K-quants (the 27B-like Q6_K head
      [248320, 5120]);
    - a matrix of at most WHOLE_STEP_BYTES: WHOLE_CONFIG's 2 rows and 2 warps (faster than 4 x 4
      on the 0.5B-like Q5_0 matrices; in the decode step 1 x 1, 2 x 1, 4 x 2, 4 x 4 and 8 x 4 were
      slower on the SmolLM2-135M-like Q4_K: bench/ab_decode.py's wholeRxW), and whole_step's
      weights a step (such a head's rows keep their 1 warp and 8 or 16 rows);
    - else 4 rows and 4 warps (not measured against others)."""
    n = qw.n // 2 if swiglu else qw.n
    whole = qw.nbytes() <= WHOLE_STEP_BYTES
    if n >= 16384:
        bn, warps, most = (8 if FORMATS[qw.fmt][2] >= 256 else 16), 1, 256
    else:
        bn, warps, most = WHOLE_CONFIG[:3] if whole else (4, 4, STEP_WEIGHTS)
    return bn, warps, whole_step(qw.fmt, qw.k, swiglu) if whole else most


def launch_config(qw: QWeight, swiglu: bool = False, config: tuple[int, int, int] | None = None):
    """(BLOCK_N, num_warps, most weights a step, whole) of gemv's launch on qw: config where given,
    else pick_config's; `whole` (a matrix of at most WHOLE_STEP_BYTES, WHOLE_CONFIG[3]): its
    first step is decoded before the PDL wait, and a row that fits one step is read in one."""
    bn, warps, most = config or pick_config(qw, swiglu)
    return bn, warps, most, qw.nbytes() <= WHOLE_STEP_BYTES and WHOLE_CONFIG[3]


def gemv(x: "torch.Tensor | NormedRow", qw: QWeight, bias: torch.Tensor | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, config: tuple[int, int, int] | None = None,
         int8_out: bool = False) -> "torch.Tensor | NormedRow":
    """x [1, K] contiguous (or a NormedRow of one). Returns [1, N] (swiglu: [1, N/2], the gate
    rows first) in out_dtype (x's by default). config: (BLOCK_N, num_warps, most weights a step),
    pick_config's by default (bench/quant_bench.py --sweep measures others); FP8 and the planar
    formats take their own kernels' (fp8.py, qplanar.py), and so do 4-bit runs (qruns.py: Q4KR,
    INT4 in groups of a multiple of 32; int8_out, qruns.gemv's: the output's int8 words too)."""
    if qw.fmt == "FP8":
        return fp8.gemv(x, qw, bias, swiglu, out_dtype, config)
    if qruns.takes(qw):  # a NormedRow normed and quantized in one launch before it
        return qruns.gemv(x, qw, bias, swiglu, out_dtype, int8_out=int8_out)
    if qw.fmt in qplanar.FMTS:  # qplanar.py's GEMV: a NormedRow normed and quantized in one launch before it
        return qplanar.gemv(x, qw, bias, swiglu, out_dtype)
    if isinstance(x, NormedRow) and (qw.nbytes() > PROLOGUE_MAX_BYTES or x._h is not None):
        x = x.materialize()
    pre = x if isinstance(x, NormedRow) else None
    src = pre.x if pre is not None else x
    n_out = qw.n // 2 if swiglu else qw.n
    bn, warps, most, whole = launch_config(qw, swiglu, config)
    out = torch.empty(1, n_out, dtype=out_dtype or src.dtype, device=src.device)
    res = pre.res if pre is not None and pre.res is not None else src
    norm_w, stream, eps = (pre.weight, pre.stream, pre.eps) if pre is not None else (src, src, 0.0)
    (sc, z, stride_s), consts = _args(qw, most, whole=whole)
    launch(_qgemv_kernel, (cdiv(n_out, bn),),
           src, qw.data, sc, z, bias if bias is not None else src, out, n_out, qw.k, qw.data.stride(0), stride_s,
           res, norm_w, stream, eps, HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=pre is not None,
           HAS_RES=pre is not None and pre.res is not None, STEPS=cdiv(qw.k, consts["W"]), BLOCK_N=bn,
           num_warps=warps, **consts, **cuda_base.pdl(src))
    return out


def matmul(x: torch.Tensor, qw: QWeight, dtype: torch.dtype) -> torch.Tensor | None:
    """x [M, K] @ W^T in `dtype` without a dequantized copy of W, where a form takes this format
    and x (FP8 on Hopper: the input quantized too, fp8_gemm.py); else None (the caller
    dequantizes, then runs torch's GEMM)."""
    if fp8_gemm.serves(x, qw):  # (it checks the format)
        return fp8_gemm.matmul(x, qw, dtype)
    return None


def dequantize(qw: QWeight, start: int, stop: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows start..stop of W in `dtype` ([stop - start, K], written into `out` where given: rows
    of unit stride along K)."""
    if qw.fmt in qplanar.FMTS:
        return qplanar.dequantize_rows(qw, start, stop, dtype, out)
    if qruns.takes(qw):
        return qruns.dequantize_rows(qw, start, stop, dtype, out)
    rows = stop - start
    out = torch.empty(rows, qw.k, dtype=dtype, device=qw.data.device) if out is None else out
    (sc, z, stride_s), consts = _args(qw, 256)  # (smaller tiles: one program per tile, no loop)
    bn = 16
    launch(_qdequant_kernel, (cdiv(rows, bn), cdiv(qw.k, consts["W"])),
           qw.data, sc, z, out, start, stop, qw.k, qw.data.stride(0), stride_s, out.stride(0), BLOCK_N=bn, num_warps=4,
           **consts)
    return out


def dequantize_rows(qw: QWeight, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W[rows] in `dtype` for a GGUF matrix (an embedding lookup): the rows gathered, then decoded."""
    sub = QWeight(qw.fmt, qw.data[rows], rows.numel(), qw.k)
    return dequantize(sub, 0, rows.numel(), dtype)


if triton is not None:
    import triton.language as tl

    from .linear import _input_chunk, _rows_epilogue

    @triton.jit
    def _u2f(q):
        """Non-negative int32 codes below 2^23 → fp32, exactly: the float 2^23 + q, minus 2^23."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _f16(p):
        """Two little-endian bytes at p → their fp16 value in fp32."""
        v = tl.load(p).to(tl.uint16) | (tl.load(p + 1).to(tl.uint16) << 8)
        return v.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _scale_min_k4(q, j):
        """Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the 12 scale bytes at q."""
        a = tl.load(q + j).to(tl.int32)
        b = tl.load(q + j + 4).to(tl.int32)
        c = tl.load(q + j % 4).to(tl.int32)
        sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
        return _u2f(sc), _u2f(mn)

    @triton.jit
    def _positions(FMT: tl.constexpr, S: tl.constexpr, L: tl.constexpr):
        """[1, S, L] offsets within a step of the weights the lo and hi tiles hold."""
        s = tl.arange(0, S)[None, :, None]
        l = tl.arange(0, L)[None, None, :]
        if FMT == 7:  # Q6_K: super-block s // 8; in it, byte 16 g + l of ql (g = s % 8), in half g // 4
            g = s % 8
            lo = 256 * (s // 8) + 128 * (g // 4) + 32 * ((g % 4) // 2) + 16 * (g % 2) + l
            return lo, lo + 64
        elif FMT == 5 or FMT == 6:  # Q4_K, Q5_K: 32-byte runs (four a super-block), low nibbles first
            return 64 * s + l, 64 * s + 32 + l
        else:  # 32-weight runs of 16 bytes, low nibbles first (and FP8's halves of 32)
            return 32 * s + l, 32 * s + 16 + l

    @triton.jit
    def _decode(w, sc_ptr, z_ptr, rows, step, K, stride_w, stride_s, FMT: tl.constexpr, BYTES: tl.constexpr,
                W: tl.constexpr, S: tl.constexpr, L: tl.constexpr, GROUP: tl.constexpr):
        """Step `step` (W weights) of rows `rows` [BN]: (lo, hi) fp32 codes [BN, S, L] and
        (scale_lo, scale_hi, offset_lo, offset_hi) [BN, S]: weight = scale * code - offset.
        Sub-blocks past the row (K weights) read its last block instead."""
        r3 = rows[:, None, None].to(tl.int64)
        r2 = rows[:, None].to(tl.int64)
        s3 = tl.arange(0, S)[None, :, None]
        s2 = tl.arange(0, S)[None, :]
        l3 = tl.arange(0, L)[None, None, :]
        if FMT <= 4:  # 32-weight blocks, S a step
            b3 = w + r3 * stride_w + tl.minimum(step * S + s3, K // 32 - 1) * BYTES
            b2 = w + r2 * stride_w + tl.minimum(step * S + s2, K // 32 - 1) * BYTES
            d = _f16(b2)
            if FMT == 4:  # Q8_0: int8 codes; as bytes q + 128 (the sign bit flipped)
                lo = _u2f(tl.load(b3 + 2 + l3).to(tl.int32) ^ 0x80)
                hi = _u2f(tl.load(b3 + 18 + l3).to(tl.int32) ^ 0x80)
                off = 128.0 * d
            else:
                qs = tl.load(b3 + (BYTES - 16) + l3).to(tl.int32)
                ql = qs & 15
                qh = qs >> 4
                if FMT == 2 or FMT == 3:  # Q5_0 / Q5_1: the fifth bits, weight j's bit j of a uint32
                    ql |= ((tl.load(b3 + (BYTES - 20) + l3 // 8).to(tl.int32) >> (l3 % 8)) & 1) << 4
                    qh |= ((tl.load(b3 + (BYTES - 18) + l3 // 8).to(tl.int32) >> (l3 % 8)) & 1) << 4
                lo = _u2f(ql)
                hi = _u2f(qh)
                if FMT == 0:
                    off = 8.0 * d
                elif FMT == 2:
                    off = 16.0 * d
                else:  # Q4_1 / Q5_1: w = d q + m
                    off = -_f16(b2 + 2)
            return lo, hi, d, d, off, off
        elif FMT == 8:  # FP8: [N, K] e4m3, one scale per GROUP rows (128, or 1 in fused linears) x 128
            p = w + r3 * stride_w + tl.minimum(step * W + 32 * s3, K - 32) + l3
            lo = tl.load(p).to(tl.float32)
            hi = tl.load(p + 16).to(tl.float32)
            sc = tl.load(sc_ptr + (r2 // GROUP) * stride_s + tl.minimum(step * W + 32 * s2, K - 32) // 128)
            return lo, hi, sc, sc, sc * 0.0, sc * 0.0
        elif FMT == 9:  # INT4: 16 bytes per 32 weights, a scale and a zero per GROUP weights
            qs = tl.load(w + r3 * stride_w + tl.minimum(step * W + 32 * s3, K - 32) // 2 + l3).to(tl.int32)
            g = tl.minimum(step * W + 32 * s2, K - 32) // GROUP
            sc = tl.load(sc_ptr + r2 * stride_s + g).to(tl.float32)
            off = _u2f(tl.load(z_ptr + r2 * stride_s + g).to(tl.int32)) * sc
            return _u2f(qs & 15), _u2f(qs >> 4), sc, sc, off, off
        elif FMT == 7:  # Q6_K: ql[128], qh[64], 16 int8 scales, d; eight sub-blocks s a super-block
            b3 = w + r3 * stride_w + tl.minimum(step * (S // 8) + s3 // 8, K // 256 - 1) * BYTES
            b2 = w + r2 * stride_w + tl.minimum(step * (S // 8) + s2 // 8, K // 256 - 1) * BYTES
            g = s3 % 8
            h = g // 4
            t = (g % 4) // 2
            ll = 16 * (g % 2) + l3
            ql = tl.load(b3 + 16 * g + l3).to(tl.int32)
            qh = tl.load(b3 + 128 + 32 * h + ll).to(tl.int32)
            lo = _u2f((ql & 15) | (((qh >> (2 * t)) & 3) << 4))
            hi = _u2f((ql >> 4) | (((qh >> (2 * t + 4)) & 3) << 4))
            d = _f16(b2 + 208)
            g2 = s2 % 8
            i = 8 * (g2 // 4) + g2 % 4
            sc_lo = tl.load(b2 + 192 + i).to(tl.int8, bitcast=True).to(tl.float32) * d
            sc_hi = tl.load(b2 + 196 + i).to(tl.int8, bitcast=True).to(tl.float32) * d
            return lo, hi, sc_lo, sc_hi, 32.0 * sc_lo, 32.0 * sc_hi
        else:  # Q4_K (qs at 16), Q5_K (qh[32] at 16, qs at 48); four sub-block pairs s a super-block
            b3 = w + r3 * stride_w + tl.minimum(step * (S // 4) + s3 // 4, K // 256 - 1) * BYTES
            b2 = w + r2 * stride_w + tl.minimum(step * (S // 4) + s2 // 4, K // 256 - 1) * BYTES
            j3 = s3 % 4
            qs = tl.load(b3 + (BYTES - 128) + 32 * j3 + l3).to(tl.int32)
            ql = qs & 15
            qh = qs >> 4
            if FMT == 6:
                hb = tl.load(b3 + 16 + l3).to(tl.int32)
                ql |= ((hb >> (2 * j3)) & 1) << 4
                qh |= ((hb >> (2 * j3 + 1)) & 1) << 4
            d = _f16(b2)
            dmin = _f16(b2 + 2)
            j2 = s2 % 4
            sl, ml = _scale_min_k4(b2 + 4, 2 * j2)
            sh, mh = _scale_min_k4(b2 + 4, 2 * j2 + 1)
            return _u2f(ql), _u2f(qh), d * sl, d * sh, dmin * ml, dmin * mh

    @triton.jit
    def _tiles_dot(lo, hi, sl, sh, ol, oh, xl, xh, xsl, xsh):
        """sum over a step's weights of w * x, per row [BN], from _decode's tiles."""
        part = sl * tl.sum(lo * xl, axis=2) - ol * xsl + sh * tl.sum(hi * xh, axis=2) - oh * xsh
        return tl.sum(part, axis=1)

    @triton.jit
    def _step_dot(w, sc_ptr, z_ptr, rows, step, K, stride_w, stride_s, xl, xh, xsl, xsh, FMT: tl.constexpr,
                  BYTES: tl.constexpr, W: tl.constexpr, S: tl.constexpr, L: tl.constexpr, GROUP: tl.constexpr):
        lo, hi, sl, sh, ol, oh = _decode(w, sc_ptr, z_ptr, rows, step, K, stride_w, stride_s, FMT, BYTES, W, S, L,
                                         GROUP)
        return _tiles_dot(lo, hi, sl, sh, ol, oh, xl, xh, xsl, xsh)

    @triton.jit
    def _x_step(x, res, norm_w, sum_out, write, k0, pl, ph, K, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                EVEN: tl.constexpr):
        """The input at a step's lo and hi positions (normed where NORM; zero past the row),
        their sums of squares and per-sub-block sums."""
        xl, ql = _input_chunk(x, res, norm_w, sum_out, write, k0 + pl, K, NORM, HAS_RES, EVEN)
        xh, qh = _input_chunk(x, res, norm_w, sum_out, write, k0 + ph, K, NORM, HAS_RES, EVEN)
        return xl, xh, ql + qh, tl.sum(xl, axis=2), tl.sum(xh, axis=2)

    @triton.jit
    def _qgemv_kernel(x, w, sc_ptr, z_ptr, bias, out, N, K, stride_w, stride_s, res, norm_w, sum_out, eps,
                      FMT: tl.constexpr, BYTES: tl.constexpr, W: tl.constexpr, S: tl.constexpr, L: tl.constexpr,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                      HAS_RES: tl.constexpr, EVEN: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        rows = tl.minimum(n, N - 1)  # the last program's spare rows re-read a real row; not stored
        if PDL:  # let the next kernel launch now: it decodes its first weights while this one runs
            tl.extra.cuda.gdc_launch_dependents()
        # the first step's weights, decoded before waiting on the previous kernel (no kernel
        # writes weights): their load latency leaves the critical path of a launch-bound step
        lo, hi, sl, sh, ol, oh = _decode(w, sc_ptr, z_ptr, rows, 0, K, stride_w, stride_s, FMT, BYTES, W, S, L, GROUP)
        if SWIGLU:  # the up rows sit N rows below the gate rows
            ulo, uhi, usl, ush, uol, uoh = _decode(w, sc_ptr, z_ptr, rows + N, 0, K, stride_w, stride_s, FMT, BYTES,
                                                   W, S, L, GROUP)
        if PDL:  # the input row (and anything this kernel writes) follows the previous kernel
            tl.extra.cuda.gdc_wait()
        write = tl.where(pid == 0, K, 0)  # one program writes the residual stream
        pl, ph = _positions(FMT, S, L)
        xl, xh, ss, xsl, xsh = _x_step(x, res, norm_w, sum_out, write, 0, pl, ph, K, NORM, HAS_RES, EVEN)
        acc = _tiles_dot(lo, hi, sl, sh, ol, oh, xl, xh, xsl, xsh)
        acc_up = acc
        if SWIGLU:
            acc_up = _tiles_dot(ulo, uhi, usl, ush, uol, uoh, xl, xh, xsl, xsh)
        for step in range(1, STEPS):  # (a constexpr: the interpreter's loop bounds must be)
            xl, xh, sq, xsl, xsh = _x_step(x, res, norm_w, sum_out, write, step * W, pl, ph, K, NORM, HAS_RES, EVEN)
            if NORM:
                ss += sq
            acc += _step_dot(w, sc_ptr, z_ptr, rows, step, K, stride_w, stride_s, xl, xh, xsl, xsh,
                             FMT, BYTES, W, S, L, GROUP)
            if SWIGLU:
                acc_up += _step_dot(w, sc_ptr, z_ptr, rows + N, step, K, stride_w, stride_s, xl, xh, xsl, xsh,
                                    FMT, BYTES, W, S, L, GROUP)
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, axis=2), axis=1) / K + eps)
            acc = acc * r
            acc_up = acc_up * r
        _rows_epilogue(acc, acc_up, bias, rows, n, nm, out, N, HAS_BIAS, SWIGLU)

    @triton.jit
    def _qdequant_kernel(w, sc_ptr, z_ptr, out, start, stop, K, stride_w, stride_s, stride_o,
                         FMT: tl.constexpr, BYTES: tl.constexpr, W: tl.constexpr, S: tl.constexpr,
                         L: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr):
        i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
        step = tl.program_id(1)
        rows = tl.minimum(start + i, stop - 1)
        lo, hi, sl, sh, ol, oh = _decode(w, sc_ptr, z_ptr, rows, step, K, stride_w, stride_s, FMT, BYTES, W, S, L,
                                         GROUP)
        pl, ph = _positions(FMT, S, L)
        o = out + i[:, None, None].to(tl.int64) * stride_o + step * W
        m = (start + i < stop)[:, None, None]
        ml = m
        mh = m
        if not EVEN:  # (the last step's positions past the row)
            ml = m & (step * W + pl < K)
            mh = m & (step * W + ph < K)
        tl.store(o + pl, (sl[:, :, None] * lo - ol[:, :, None]).to(out.dtype.element_ty), mask=ml)
        tl.store(o + ph, (sh[:, :, None] * hi - oh[:, :, None]).to(out.dtype.element_ty), mask=mh)
