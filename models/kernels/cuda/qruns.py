"""Dequant-GEMVs for 4- and 5-bit weights in 32-weight runs (models/quant/runs.py): AWQ/GPTQ groups
as stored (QWeight "INT4"), GGUF Q4_K repacked as Q4KR, Q5_0 and Q5_1 as Q50R and Q51R. One-token
forwards (decode).

Contract: `gemv(x, pw)` equals x @ W^T for the weights W = scale code - offset the layout encodes
(runs.dequantize), accumulated in fp32 and rounded once; on int8 inputs (qplanar.int8_inputs: 16-bit
models, as llama.cpp's CUDA GEMVs take theirs) against x~ = quantize_input's q dx instead of x
(qplanar.quantized_reference(x, 32)).

Why runs (against qplanar.py's planar layouts, whose words interleave four rows and spread a word's
codes over its group): there a thread's 16-byte load held 32 weights of four rows and its inputs
came in four more loads of 4 bytes, so the loads of inputs and scales matched the loads of weights,
and the L1 ran near its peak throughput while the DRAM ran well below its own (Nsight Compute on
bench/gemv_counters.py). Here a thread owns one run of the step (32 inputs: two 16-byte loads of
int8 and one 8-byte load of (dx, dx sum q)) for every row of its program, and reads per row a
16-byte load of the run's codes and its scales: per row, one load of weights and one or two of
scales; the input's three loads serve all BN rows. The codes' low nibbles (w & 0x0F0F0F0F) meet the
run's first 16 inputs and the high ones the next 16, in order: two DP4As a word, the run's sum
scaled once: sum (scale q - offset) q~ dx = scale dx sum q q~ - offset dx sum q~. The 5-bit layouts
add a word a run of fifth bits, spread into bit 4 of the code bytes ((b * 0x00204081) & 0x01010101
puts bit i of a nibble b in byte i) before the DP4As.

A program owns BN rows (a SwiGLU pair's: BN gate rows and the BN up rows N below) and walks K in
steps of C runs (32 num_warps: a run a thread), the next step's words read before the step's are
summed (PREFETCH). With PDL, the first step's words and scales are read before the wait.

The int8 input may come made by the launch before the GEMV (FUSED_INT8): a producer that owns
whole runs of its output writes their words too (`_quantize_head`, quantize_input's bits from the
output as stored) and returns `carrying(row, words)`, a NormedRow.made whose INT8_RUNS form the
GEMV reads (`reads_int8`: whether the consumer reads runs int8). `gemv(..., int8_out=True)` is this
GEMV as a producer (a SwiGLU pair's, for its down): the last of a run's programs to count itself
in on `counters` quantizes the run.
"""
from __future__ import annotations


import torch

from . import base as cuda_base, qplanar
from .base import cdiv, launch, next_pow2, triton
from ...quant import runs
from ...quant.layers import QuantLinear, QWeight
from .linear import NormedRow

__all__ = ["FMTS", "gemv", "quantize_input", "normed_input", "pick_config", "dequantize_rows", "serves", "takes",
           "reads_int8", "int8_words"]

# The kernels' FMT constant: INT4 0, then runs.REPACKED's (Q4KR 1, Q50R 2, Q51R 3: FMT >= 2 the 5-bit ones)
FMTS = {"INT4": 0, **{fmt: i + 1 for i, fmt in enumerate(runs.REPACKED)}}
RUN = 32  # weights a run: an int8 input's group
INT8_RUNS = "int8 runs"  # a NormedRow's form (NormedRow.forms) holding quantize_input's words of it
# Programs of the norm-and-quantize launch (about; each sums the whole row's squares)
NORM_QUANTIZE_PROGRAMS = 8
# Runs a program of quantize_input's launch (one warp each)
QUANTIZE_RUNS = 8


def serves(fmt: str, k: int, group: int | None) -> bool:
    """Whether these kernels read rows of k weights in this format: Q4KR, Q50R, Q51R, and INT4 in
    `group`s of whole 32-weight runs at any k of whole groups."""
    return fmt in runs.REPACKED or (fmt == "INT4" and bool(group) and group % RUN == 0 and k % group == 0)


def takes(qw: QWeight) -> bool:
    """serves() for a QWeight."""
    return serves(qw.fmt, qw.k, qw.group)


if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .qplanar import _add_norm, _dp4a_pair, _epilogue

    @triton.jit
    def _run_words(w, rows, run, m, stride_w, RUNS: tl.constexpr, EVEN: tl.constexpr):
        """The int32 words [C, BN, 4] of runs `run` [C, 1, 1] of rows `rows` [1, BN, 1]: a 16-byte load a row."""
        at = w + rows * stride_w + run * 4 + m
        if EVEN:
            return tl.load(at)
        return tl.load(at, mask=run < RUNS, other=0)

    @triton.jit
    def _run_scales(aux, aux2, rows, run, stride_a, stride_z, G: tl.constexpr, FMT: tl.constexpr,
                    RUNS: tl.constexpr, EVEN: tl.constexpr):
        """(scale, offset) [C, BN, 1] of the runs (weight = scale code - offset), in fp32, exact:
        INT4 s and s z (an fp16 times at most 15), Q4KR d sc and dmin m (fp16 times 6 bits), Q50R
        d and 16 d, Q51R d and -m."""
        ok = run < RUNS
        # (the offsets marked contiguous along no dim: a load vectorized over runs would hand each
        # thread the scales of other threads' runs, and the sums would go through shared memory)
        if FMT == 0:
            at = tl.max_contiguous(rows * stride_a + run // (G // 32), [1, 1, 1])
            at_z = tl.max_contiguous(rows * stride_z + run // (G // 32), [1, 1, 1])
            if EVEN:
                s = tl.load(aux + at).to(tl.float32)
                z = tl.load(aux2 + at_z).to(tl.float32)
            else:
                s = tl.load(aux + at, mask=ok, other=0.0).to(tl.float32)
                z = tl.load(aux2 + at_z, mask=ok, other=0).to(tl.float32)
            scale, offset = s, s * z
        elif FMT >= 2:  # aux: Q50R's d as an int16, Q51R's (d, m) as one int32, a run
            at = tl.max_contiguous(rows * stride_a + run, [1, 1, 1])
            if EVEN:
                dm = tl.load(aux + at).to(tl.int32)
            else:
                dm = tl.load(aux + at, mask=ok, other=0).to(tl.int32)
            scale = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            if FMT == 2:
                offset = 16.0 * scale
            else:
                offset = -(((dm >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))
        else:
            at = tl.max_contiguous(rows * stride_a + run // 8, [1, 1, 1])
            at_z = tl.max_contiguous(rows * stride_z + run, [1, 1, 1])
            if EVEN:  # aux: (d, dmin) as one int32 a super-block; aux2: (sc, m) as one int16 a run
                dd = tl.load(aux + at)
                sm = tl.load(aux2 + at_z).to(tl.int32)
            else:
                dd = tl.load(aux + at, mask=ok, other=0)
                sm = tl.load(aux2 + at_z, mask=ok, other=0).to(tl.int32)
            d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            scale, offset = d * (sm & 255).to(tl.float32), dmin * ((sm >> 8) & 255).to(tl.float32)
        return scale, offset

    @triton.jit
    def _run_high(aux2, rows, run, stride_z, FMT: tl.constexpr, RUNS: tl.constexpr, EVEN: tl.constexpr):
        """The 5-bit layouts' fifth bits [C, BN, 1] (an int32 a run: bit j, the run's weight j);
        a zero for the 4-bit ones (unused)."""
        if FMT >= 2:  # (one return: Triton checks every return's type, pruned branches' too)
            at = tl.max_contiguous(rows * stride_z + run, [1, 1, 1])
            if EVEN:
                high = tl.load(aux2 + at)
            else:
                high = tl.load(aux2 + at, mask=run < RUNS, other=0)
        else:
            high = tl.zeros([1, 1, 1], dtype=tl.int32)
        return high

    @triton.jit
    def _run_step(w, aux, aux2, rows, run, m, stride_w, stride_a, stride_z, G: tl.constexpr, FMT: tl.constexpr,
                  RUNS: tl.constexpr, EVEN: tl.constexpr):
        words = _run_words(w, rows, run, m, stride_w, RUNS, EVEN)
        high = _run_high(aux2, rows, run, stride_z, FMT, RUNS, EVEN)
        scale, offset = _run_scales(aux, aux2, rows, run, stride_a, stride_z, G, FMT, RUNS, EVEN)
        return words, high, scale, offset

    @triton.jit
    def _spread(b):
        """The low four bits of b as bit 4 of four bytes (bit i in byte i): the fifth bits' place."""
        return (((b & 15) * 0x00204081) & 0x01010101) << 4

    @triton.jit
    def _rounded(y, INTERPRETED: tl.constexpr):
        """y (|y| <= 127 and a bit) rounded half to even and clamped to [-127, 127], as int32."""
        if INTERPRETED:  # (adding and taking away 1.5 2^23)
            y = (y + 12582912.0) - 12582912.0
        else:
            y = libdevice.rint(y)
        return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int32)

    @triton.jit
    def _step_input(x, run, m, RUNS: tl.constexpr, KQ: tl.constexpr, A8: tl.constexpr, EVEN: tl.constexpr):
        """The runs' int8 input (A8): (xe, xo) [C, 1, 4], the int32 words of the run's inputs 0-15
        and 16-31 in order, and (dx, dx sum q) [C, 1, 1], from quantize_input's words. Zeros on the
        float path (unused)."""
        ok = run < RUNS
        if A8:
            if EVEN:
                xe = tl.load(x + run * 8 + m)
                xo = tl.load(x + run * 8 + 4 + m)
                meta = tl.load(x.to(tl.pointer_type(tl.int64)) + KQ // 2 + run)
            else:
                xe = tl.load(x + run * 8 + m, mask=ok, other=0)
                xo = tl.load(x + run * 8 + 4 + m, mask=ok, other=0)
                meta = tl.load(x.to(tl.pointer_type(tl.int64)) + KQ // 2 + run, mask=ok, other=0)
            dx = meta.to(tl.int32).to(tl.float32, bitcast=True)
            xs = (meta >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        else:
            xe = tl.zeros(m.shape, dtype=tl.int32)
            xo = xe
            dx = tl.zeros([1, 1, 1], dtype=tl.float32)
            xs = dx
        return xe, xo, dx, xs

    @triton.jit
    def _run_dot(acc, x, xe, xo, dx, xs, words, high, scale, offset, run, m, RUNS: tl.constexpr,
                 FMT: tl.constexpr, A8: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr):
        """acc [C, BN, 1] plus the runs' contributions. A8: on the int8 input (xe, xo, dx, xs:
        _step_input's); else on the row x as given. FMT >= 2: the codes' fifth bits from `high`."""
        ok = run < RUNS
        lo = words & 0x0F0F0F0F  # word m's codes: weights 4m.. (low nibbles) and 16 + 4m.. (high)
        hi = (words >> 4) & 0x0F0F0F0F
        if FMT >= 2:  # (bit 4 from high)
            lo |= _spread(high >> (4 * m))
            hi |= _spread(high >> (16 + 4 * m))
        if A8:
            isum = tl.sum(_dp4a_pair(lo, xe, hi, xo, INTERPRETED), axis=2, keep_dims=True)
            return acc + scale * (isum.to(tl.float32) * dx) - offset * xs
        ws = tl.zeros(words.shape, dtype=tl.float32)
        xs4 = tl.zeros(m.shape, dtype=tl.float32) + tl.zeros(run.shape, dtype=tl.float32)
        for b in tl.static_range(4):
            at = x + run * 32 + 4 * m + b
            if EVEN:
                xl = tl.load(at).to(tl.float32)
                xh = tl.load(at + 16).to(tl.float32)
            else:
                xl = tl.load(at, mask=ok, other=0.0).to(tl.float32)
                xh = tl.load(at + 16, mask=ok, other=0.0).to(tl.float32)
            # (codes to fp32 by the exponent, 2^23 + q less 2^23, exact: no int-to-float)
            cl = (((lo >> (8 * b)) & 31) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            ch = (((hi >> (8 * b)) & 31) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            ws += cl * xl + ch * xh
            xs4 += xl + xh
        ws = tl.sum(ws, axis=2, keep_dims=True)
        xs = tl.sum(xs4, axis=2, keep_dims=True)
        return acc + scale * ws - offset * xs

    @triton.jit
    def _runs_gemv_kernel(x, w, aux, aux2, bias, out, N, stride_w, stride_a, stride_z, q8, sync,
                          G: tl.constexpr, RUNS: tl.constexpr, BN: tl.constexpr, C: tl.constexpr,
                          STEPS: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr, A8: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PREFETCH: tl.constexpr, Q8: tl.constexpr,
                          PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """Rows pid BN.. (N outputs; SWIGLU: the up rows N below), C runs a step, STEPS steps. A8:
        x is quantize_input's words; else the row.
        Q8 (BN divides 32, N a multiple of 32): the output row's int8 runs into q8 as well, by the
        last of a run's 32 / BN programs to count itself in (`sync`, an acq_rel atomic after a
        barrier; the count set back to zero), from the outputs as stored: quantize_input's bits."""
        KQ: tl.constexpr = RUNS * 8  # the int8 input's words
        r = tl.program_id(0) * BN + tl.arange(0, BN)
        # [C, BN, 4] tiles (runs first: Triton's coalescing orders the dims that are not contiguous by
        # their index, and the threads must go along the runs so that each holds all BN rows of its run)
        rows = tl.minimum(r, N - 1).to(tl.int64)[None, :, None]
        ci = tl.arange(0, C)[:, None, None]
        m = tl.arange(0, 4)[None, None, :]
        if PDL:  # the next kernel launches now: it reads its first weights while this one runs
            tl.extra.cuda.gdc_launch_dependents()
        words, high, scale, offset = _run_step(w, aux, aux2, rows, ci, m, stride_w, stride_a, stride_z, G, FMT, RUNS,
                                               EVEN)
        if SWIGLU:
            u_words, u_high, u_scale, u_offset = _run_step(w, aux, aux2, rows + N, ci, m, stride_w, stride_a,
                                                           stride_z, G, FMT, RUNS, EVEN)
        else:
            u_words, u_high, u_scale, u_offset = words, high, scale, offset
        if PDL:  # (the weights before the wait: no kernel writes them)
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((C, BN, 1), dtype=tl.float32)
        acc_up = acc
        if PREFETCH:
            for i in range(1, STEPS):
                run = i * C + ci
                n_words, n_high, n_scale, n_offset = _run_step(w, aux, aux2, rows, run, m, stride_w, stride_a,
                                                               stride_z, G, FMT, RUNS, EVEN)
                if SWIGLU:
                    nu_words, nu_high, nu_scale, nu_offset = _run_step(w, aux, aux2, rows + N, run, m, stride_w,
                                                                       stride_a, stride_z, G, FMT, RUNS, EVEN)
                xe, xo, dx, xs = _step_input(x, run - C, m, RUNS, KQ, A8, EVEN)
                acc = _run_dot(acc, x, xe, xo, dx, xs, words, high, scale, offset, run - C, m, RUNS, FMT, A8, EVEN,
                               INTERPRETED)
                if SWIGLU:
                    acc_up = _run_dot(acc_up, x, xe, xo, dx, xs, u_words, u_high, u_scale, u_offset, run - C, m, RUNS,
                                      FMT, A8, EVEN, INTERPRETED)
                    u_words, u_high, u_scale, u_offset = nu_words, nu_high, nu_scale, nu_offset
                words, high, scale, offset = n_words, n_high, n_scale, n_offset
            last = (STEPS - 1) * C + ci
            xe, xo, dx, xs = _step_input(x, last, m, RUNS, KQ, A8, EVEN)
            acc = _run_dot(acc, x, xe, xo, dx, xs, words, high, scale, offset, last, m, RUNS, FMT, A8, EVEN,
                           INTERPRETED)
            if SWIGLU:
                acc_up = _run_dot(acc_up, x, xe, xo, dx, xs, u_words, u_high, u_scale, u_offset, last, m, RUNS, FMT,
                                  A8, EVEN, INTERPRETED)
        else:
            xe, xo, dx, xs = _step_input(x, ci, m, RUNS, KQ, A8, EVEN)
            acc = _run_dot(acc, x, xe, xo, dx, xs, words, high, scale, offset, ci, m, RUNS, FMT, A8, EVEN, INTERPRETED)
            if SWIGLU:
                acc_up = _run_dot(acc_up, x, xe, xo, dx, xs, u_words, u_high, u_scale, u_offset, ci, m, RUNS, FMT, A8,
                                  EVEN, INTERPRETED)
            for i in range(1, STEPS):
                run = i * C + ci
                words, high, scale, offset = _run_step(w, aux, aux2, rows, run, m, stride_w, stride_a, stride_z, G,
                                                       FMT, RUNS, EVEN)
                xe, xo, dx, xs = _step_input(x, run, m, RUNS, KQ, A8, EVEN)
                acc = _run_dot(acc, x, xe, xo, dx, xs, words, high, scale, offset, run, m, RUNS, FMT, A8, EVEN,
                               INTERPRETED)
                if SWIGLU:
                    u_words, u_high, u_scale, u_offset = _run_step(w, aux, aux2, rows + N, run, m, stride_w, stride_a,
                                                                   stride_z, G, FMT, RUNS, EVEN)
                    acc_up = _run_dot(acc_up, x, xe, xo, dx, xs, u_words, u_high, u_scale, u_offset, run, m, RUNS,
                                      FMT, A8, EVEN, INTERPRETED)
        y = tl.sum(tl.sum(acc, axis=2), axis=0)  # [BN]
        _epilogue(y, tl.sum(tl.sum(acc_up, axis=2), axis=0) if SWIGLU else y, bias, out, r, N, HAS_BIAS, SWIGLU)
        if Q8:
            run = tl.program_id(0) * BN // 32
            tl.debug_barrier()  # every thread's stores before the count (the release covers them)
            if tl.atomic_add(sync + run, 1, sem="acq_rel", scope="gpu") == 32 // BN - 1:
                v = tl.load(out + run * 32 + tl.arange(0, 32), cache_modifier=".cg")  # (other programs wrote it: from L2)
                _quantize_head(v, run, 1, q8, N // 4, INTERPRETED)
                tl.store(sync + run, 0)

    @triton.jit
    def _quantize_runs(v, r, ok, dst, KQ, INTERPRETED: tl.constexpr):
        """v [RB, 32] fp32 (runs r [RB, 1]; ok: which are real) → dst: per run, q = round-half-even(v
        127 / amax) as int8 (words r 8.. in order) and (dx = amax / 127, dx sum q) as fp32 bits
        (words KQ + 2 r, + 1): qplanar._quantize_groups' arithmetic on groups of 32."""
        amax = tl.max(tl.abs(v), axis=1)[:, None]
        inv = tl.div_rn(127.0, tl.where(amax > 0, amax, 1.0))
        dx = tl.div_rn(amax, 127.0)
        q = _rounded(v * inv, INTERPRETED)
        qsum = tl.sum(q, axis=1)[:, None]
        shift = (tl.arange(0, 32) % 4 * 8)[None, :]
        packed = tl.sum(tl.reshape((q & 255) << shift, [v.shape[0], 8, 4]), axis=2)  # disjoint bytes: the sum is their OR
        tl.store(dst + r * 8 + tl.arange(0, 8)[None, :], packed, mask=ok)
        tl.store(dst + KQ + 2 * r, dx.to(tl.int32, bitcast=True), mask=ok)
        tl.store(dst + KQ + 2 * r + 1, (qsum.to(tl.float32) * dx).to(tl.int32, bitcast=True), mask=ok)

    @triton.jit
    def _quantize_head(y, first, R: tl.constexpr, dst, KQ, INTERPRETED: tl.constexpr):
        """A producer's R runs of its output y ([R 32] values as stored, in order), runs first..
        of the row whose words dst holds (KQ: their count): _quantize_runs of them."""
        r = first + tl.arange(0, R)[:, None]
        _quantize_runs(tl.reshape(y.to(tl.float32), [R, 32]), r, r >= 0, dst, KQ, INTERPRETED)

    @triton.jit
    def _quantize_kernel(x, out, stride_x, RUNS: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        """Row program_id(1) of x, RB runs a program, into out's row of RUNS 8 + RUNS 2 words."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(1)
        r = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
        ok = r < RUNS
        v = tl.load(x + row * stride_x + r * 32 + tl.arange(0, 32)[None, :], mask=ok, other=0.0).to(tl.float32)
        _quantize_runs(v, r, ok, out + row * (RUNS * 10), RUNS * 8, INTERPRETED)

    @triton.jit
    def _norm_quantize_kernel(x, y, w, sum_out, norm_out, qout, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                              RB: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """One row: cuda_base's _add_rms_norm_kernel (the same operations: the same bits; the sum
        written where HAS_RES), the normed row then quantized as _quantize_kernel does. Each
        program sums the whole row's squares and writes runs RB pid.. of the sum, the normed row
        and qout."""
        r = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
        mine = r * 32 + tl.arange(0, 32)[None, :]
        ok = r < N // 32
        nw = tl.load(w + mine, mask=ok, other=0.0)  # a weight: before the wait
        if PDL:  # the next GEMV launches once the one before this kernel has ended
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        h = _add_norm(x, y, nw, sum_out, norm_out, mine, ok, eps, N, BLOCK, HAS_RES)
        _quantize_runs(h.to(tl.float32), r, ok, qout, N // 4, INTERPRETED)

    @triton.jit
    def _runs_dequant_kernel(w, aux, aux2, out, start, stop, stride_w, stride_a, stride_z, stride_o,
                             G: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr, CR: tl.constexpr):
        """Rows start.. of W (BLOCK_N a program; w: the bytes, stride_w a row's), runs CR pid(1).. (a row's CR 32
        weights contiguous)."""
        i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None, None]
        run = tl.program_id(1) * CR + tl.arange(0, CR)[None, :, None, None]
        half = tl.arange(0, 2)[None, None, :, None]
        m = tl.arange(0, 16)[None, None, None, :]  # byte of the run
        n = tl.minimum(start + i, stop - 1).to(tl.int64)
        byte = tl.load(w + n * stride_w + run * 16 + m).to(tl.int32)
        code = (byte >> (4 * half)) & 15  # [rows, CR, 2, 16]: weight 32 run + 16 half + m
        n3 = tl.minimum(start + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None], stop - 1).to(tl.int64)
        run3 = tl.program_id(1) * CR + tl.arange(0, CR)[None, :, None]
        if FMT >= 2:  # the fifth bits: bit 16 half + m of the run's word
            high = _run_high(aux2, n3, run3, stride_z, FMT, 1 << 30, True)[:, :, :, None]
            code |= ((high >> (16 * half + m)) & 1) << 4
        code = code.to(tl.float32)
        scale, offset = _run_scales(aux, aux2, n3, run3, stride_a, stride_z, G, FMT, 1 << 30, True)  # [rows, CR, 1]
        val = (scale[:, :, :, None] * code - offset[:, :, :, None]).to(out.dtype.element_ty)
        rr = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        kk = tl.program_id(1) * (CR * 32) + tl.arange(0, CR * 32)[None, :]
        tl.store(out + rr.to(tl.int64) * stride_o + kk, tl.reshape(val, [BLOCK_N, CR * 32]), mask=start + rr < stop)


def _aux(pw: QWeight) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' scale operands and their row strides: INT4's s and z as stored; Q4KR's (d,
    dmin) as one int32 a super-block and (sc, m) as one int16 a run; Q50R's d as an int16 and
    Q51R's (d, m) as one int32 a run, with their fifth bits (an int32 a run)."""
    if pw.fmt == "Q4KR":
        aux, aux2 = pw.scales.view(torch.int32).reshape(pw.n, -1), pw.zeros.view(torch.int16).reshape(pw.n, -1)
    elif pw.fmt == "Q50R":
        aux, aux2 = pw.scales.view(torch.int16), pw.zeros
    elif pw.fmt == "Q51R":
        aux, aux2 = pw.scales.view(torch.int32).reshape(pw.n, -1), pw.zeros
    else:
        aux, aux2 = pw.scales, pw.zeros
    return aux, aux2, aux.stride(0), aux2.stride(0)


def quantize_input(x: torch.Tensor) -> torch.Tensor:
    """x [S, K] (K a multiple of 32, rows of unit stride along K) → int32 [S, K/4 + K/16]: per
    32-input run, q = round(x 127 / amax) as int8 in order, then (dx = amax / 127, dx sum q) as
    fp32 bits a run: x~ = q dx (qplanar.quantized_reference(x, 32))."""
    S, K = x.shape
    out = torch.empty(S, K // RUN * 10, dtype=torch.int32, device=x.device)
    rb = QUANTIZE_RUNS
    launch(_quantize_kernel, (cdiv(K // 32, rb), S), x, out, x.stride(0), RUNS=K // 32, RB=rb,
           INTERPRETED=cuda_base.interpreted(), num_warps=1, **cuda_base.pdl(x))
    return out


def normed_input(row: NormedRow) -> torch.Tensor:
    """quantize_input of a NormedRow, made once a row (its other run GEMVs take the same): where
    the row is not normed yet, one launch norms it (the stream written, the row kept as
    materialize() would leave it) and quantizes it."""
    q = row.forms.get(INT8_RUNS)
    if q is None:
        h = row.row_for_prologue()
        if h is None:
            q = quantize_input(row.materialize())
        else:
            K = row.x.shape[-1]
            q = int8_words(K, row.x.device)
            rb = next_pow2(-(-(K // 32) // NORM_QUANTIZE_PROGRAMS))
            launch(_norm_quantize_kernel, (cdiv(K // 32, rb),), row.x, row.res if row.res is not None else row.x,
                   row.weight, row.stream, h, q, row.eps, N=K, BLOCK=next_pow2(K), RB=rb,
                   HAS_RES=row.res is not None, INTERPRETED=cuda_base.interpreted(), num_warps=4,
                   **cuda_base.pdl(row.x))
        row.forms[INT8_RUNS] = q
    return q


# An LM head's rows (a vocabulary) on the float path (its fp32 normed row): 16 rows, 1 warp, read ahead
# (the best of bench/quant_bench.py --sweep-runs on the Qwen2.5-0.5B-like tied Q50R head
# [151936, 896], faster than 8 rows; bench/ab_decode.py's head8x1)
HEAD_FLOAT = (16, 1, True)


def pick_config(n: int, k: int, swiglu: bool = False, int8: bool = True) -> tuple[int, int, bool]:
    """(BN rows a program, num_warps, PREFETCH: the next step read ahead) for n outputs (a SwiGLU
    pair's: 2 BN rows a program) of K = k. From bench/quant_bench.py --sweep-runs on an H200 (the
    27B-like matrices, Q4KR and INT4; at or near the best of the sweep on each): a SwiGLU pair on
    4 rows and 1 warp; up to 8,192 rows, 4 rows and 2 warps; more rows, 8 rows and 1 warp. Fewer
    than 4,096 rows (a small model's down): 2 rows a program (more programs) on 4 warps (faster
    than 2 warps on LFM2-1.2B's [2048, 8192], equal on Qwen2.5-0.5B's [896, 4864], whose Q4_K
    decode it sped up: `--runs-shapes`, bench/ab_decode.py's runsbefore); no more warps than the
    row has runs for. An LM head's rows on the float path (not int8): HEAD_FLOAT."""
    if not int8 and n >= 16384 and not swiglu:
        return HEAD_FLOAT
    if swiglu:
        bn, warps = 4, 1
    elif n < 4096:
        bn, warps = 2, 4
    elif n <= 8192:
        bn, warps = 4, 2
    else:
        bn, warps = 8, 1
    while warps > 1 and 32 * warps > k // RUN:
        warps //= 2
    return bn, warps, True


def gemv(x: "torch.Tensor | NormedRow", pw: QWeight, bias: torch.Tensor | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, config: tuple[int, int, bool] | None = None,
         int8: bool | None = None, int8_out: bool = False) -> "torch.Tensor | NormedRow":
    """x [1, K] contiguous (or a NormedRow of one: normed and quantized in one launch,
    normed_input); pw an INT4, Q4KR, Q50R or Q51R QWeight (takes). Returns [1, N] (swiglu: [1, N/2], the
    gate rows first) in out_dtype (the row's dtype by default). int8 (qplanar.int8_inputs of the
    row's dtype by default): against x~ = quantize_input's instead of x. config: (BN, num_warps,
    PREFETCH), pick_config's by default. int8_out (for an output that a runs GEMV reads next:
    reads_int8): the output also as quantize_input's words, made in this launch, returned as a row
    carrying them (NormedRow.made), where the tile allows (BN dividing 32, whole runs of outputs);
    else the output alone."""
    n_out = pw.n // 2 if swiglu else pw.n
    x, row_dtype, int8 = qplanar.row_input(x, int8)  # (qplanar.int8_inputs' rule)
    normed = isinstance(x, NormedRow)
    src = x.x if normed else x
    xin = (normed_input(x) if normed else quantize_input(x)) if int8 else x
    bn, warps, prefetch = config or pick_config(n_out, pw.k, swiglu, int8)
    runs, c = pw.k // RUN, 32 * warps
    out = torch.empty(1, n_out, dtype=out_dtype or row_dtype, device=src.device)
    aux, aux2, sa, sz = _aux(pw)
    steps = cdiv(runs, c)
    q8 = int8_out and n_out % RUN == 0 and RUN % bn == 0 and n_out // RUN <= COUNTERS
    words = int8_words(n_out, src.device) if q8 else out
    launch(_runs_gemv_kernel, (cdiv(n_out, bn),), xin, pw.data.view(torch.int32), aux, aux2,
           bias if bias is not None else out, out, n_out, pw.k // 8, sa, sz, words,
           counters(src.device) if q8 else words, G=pw.group, RUNS=runs, BN=bn, C=c, STEPS=steps,
           EVEN=runs % c == 0, FMT=FMTS[pw.fmt], A8=int8, HAS_BIAS=bias is not None, SWIGLU=swiglu,
           PREFETCH=prefetch and steps > 1, Q8=q8, INTERPRETED=cuda_base.interpreted(),
           num_warps=warps, **cuda_base.pdl(src))
    return carrying(out, words) if q8 else out


# The Q8 launches' counters a device: one a run of outputs (a SwiGLU pair of up to 2 Mi outputs)
COUNTERS = 1 << 16
_COUNTERS: dict = {}


def counters(device: torch.device) -> torch.Tensor:
    """COUNTERS int32 zeros on `device`, through which a Q8 launch's programs meet. Each launch
    leaves them zero, and launches on one stream follow each other, so one buffer serves them
    all; made once (at a model's first eager step: graphs.py warms up before it captures) and
    never replaced, as captured graphs hold its address."""
    have = _COUNTERS.get(device)
    if have is None:
        have = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return have


# The launches that make the int8 input of the runs GEMV after them, in place of a quantize_input
# launch of its own: "pair" (a SwiGLU pair's runs GEMV, for the down), "merge" (the attention merge,
# for o_proj), "delta" (the Gated DeltaNet step, for out_proj): the merge and the delta step, as
# Q4_K decode with both is faster than with none on the SmolLM2-135M-like, Qwen2.5-0.5B-like and
# Qwen3.5-27B-like shapes; the pair's counted epilogue cost more than the launch it saved
# (bench/ab_decode.py's int8apart / pairon, which set FUSED_INT8 to compare).
PRODUCERS = ("pair", "merge", "delta")
FUSED_INT8 = frozenset(("merge", "delta"))


def reads_int8(linear, dtype: torch.dtype, producer: str) -> bool:
    """Whether `linear`'s one-row CUDA GEMV on rows of `dtype` reads quantize_input's words (a
    QuantLinear of a layout these kernels take, in a 16-bit model), so that the launch making
    its input (`producer`, one of PRODUCERS) makes them too, where FUSED_INT8 holds it."""
    assert producer in PRODUCERS, producer
    if not (producer in FUSED_INT8 and isinstance(linear, QuantLinear) and linear.forms is not None
            and qplanar.int8_inputs(dtype)):
        return False  # (a module without its CUDA forms bound runs torch's, which reads no words)
    return takes(linear.qweight())


def int8_words(k: int, device: torch.device) -> torch.Tensor:
    """An empty buffer for one row of k inputs as quantize_input's words."""
    return torch.empty(1, k // RUN * 10, dtype=torch.int32, device=device)


def carrying(row: torch.Tensor, words: torch.Tensor) -> NormedRow:
    """`row` as the runs GEMV after it takes it: a row made already (NormedRow.made) carrying its
    int8 words (INT8_RUNS), which that GEMV reads in place of a quantize_input launch."""
    return NormedRow.made(row, {INT8_RUNS: words})


# (rows a program, runs a program, num_warps): the dequantize launch's tile (prefill's weights)
DEQUANT_TILE = (16, 32, 8)


def dequantize_rows(pw: QWeight, start: int, stop: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Rows start..stop of W in `dtype` ([stop - start, K]; into `out` where given, rows of unit
    stride along K): each weight scale * code - offset in fp32, rounded once."""
    rows = stop - start
    out = torch.empty(rows, pw.k, dtype=dtype, device=pw.data.device) if out is None else out
    bn, cr, warps = tile or DEQUANT_TILE
    runs = pw.k // RUN
    while runs % cr:
        cr //= 2
    aux, aux2, sa, sz = _aux(pw)
    launch(_runs_dequant_kernel, (cdiv(rows, bn), runs // cr), pw.data, aux, aux2, out, start, stop,
           pw.data.stride(0), sa, sz, out.stride(0), G=pw.group, FMT=FMTS[pw.fmt], BLOCK_N=bn, CR=cr, num_warps=warps)
    return out
