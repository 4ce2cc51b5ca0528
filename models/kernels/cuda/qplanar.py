"""Dequant-GEMVs for 4-, 5- and 6-bit weights in layouts repacked for them at load
(models/quant/planar.py): AWQ/GPTQ groups as INT4P, GGUF Q4_K as Q4KP, Q5_K as Q5KP and Q6_K as
Q6KP. Fewer instructions a weight than qlinear.py's kernels, which decode the stored layouts.

The layouts (planar.py has the details): per group of G weights (the checkpoint's group for
INT4P, the 32-weight sub-block for Q4KP and Q5KP, the 16-weight one for Q6KP), int32 word m holds in its nibble j the code of weight
G/8 j + m, so a word's eight codes share their group's scale and offset, and the input a nibble
meets, x[g G + G/8 j + m], runs contiguously along m; rows are interleaved by R = 4, so a
thread's four contiguous words are four rows' same word and the input it loads and converts
serves four rows. Scales: INT4P the checkpoint's s (fp16) and z (uint8) per row and group; Q4KP
Q4_K's own (d, dmin) per super-block (fp16) and (sc, m) per sub-block (uint8). Q6KP (G = 16)
holds Q6_K's codes' low four bits so, their high two bits in one more word a group, and Q6_K's
d per super-block and int8 sc per group; Q5KP (G = 32) Q5_K's low four bits so, their high bit
in one more word a group, and Q4KP's scales (Q5_K's are Q4_K's).

Contract: `gemv(x, pw)` equals x @ W^T for the weights W = s code - offset the layout encodes
(as planar.dequantize_* give them), accumulated in fp32 and rounded once. Each code becomes the
float 1 + code/16 by bit operations alone (the code moved into the top of the mantissa of 1.0: a
shift and one three-input logic op), multiplied into a running sum over the word's nibbles; as
sum_j (s code_j - offset) x_j = 16 s sum_j (1 + code_j/16) x_j - (16 s + offset) sum_j x_j, the
scales cost two FMAs a word and no instruction converts an integer to a float.

Int8 inputs (int8_inputs: 16-bit models by default, as llama.cpp's CUDA GEMVs quantize theirs):
quantize_input first rounds each group of the input to int8 with one scale (x~ = q dx), in the
order the nibbles meet them, and the GEMV then equals x~ @ W^T: per word, the even and the odd
nibbles masked out in place (four codes a register, a byte each) go through two DP4As against
the packed inputs, so a word costs about five integer instructions and two FMAs instead of three
instructions a weight (Q6KP and Q5KP: the high bits joined into those bytes first, a few more).
The float path of Q6KP and Q5KP (fp32 models, and the LM head, whose normed row is fp32) moves each
6- or 5-bit code into the mantissa of 1.0 as the 4-bit layouts' do, the high bits joined by shifts.
`dequantize_rows` gives rows of W for prefill's GEMM. `bench/sass_loop.py` counts the
instructions a weight of the compiled loop.
"""
from __future__ import annotations


import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton
from ...quant.planar import ROWS as R, dequantize_int4p as dequantize, repack_int4p as repack
from ...quant.layers import QWeight
from .linear import NormedRow, row_dtype as linear_row_dtype

__all__ = ["R", "repack", "dequantize", "gemv", "quantize_input", "normed_input", "quantized_reference", "int8_inputs",
           "dequantize_rows", "pick_config", "FMTS", "experts_gate_up", "experts_down"]

FMTS = {"INT4P": 0, "Q4KP": 1, "Q6KP": 2, "Q5KP": 3}  # the kernels' FMT constant

# Per layout: whether the GEMV's loop reads a step's words before it sums the step before (two
# steps' loads in flight a program). On an H200 the read ahead sped up Q4KP, slowed INT4P and Q5KP
# and left Q6KP (the Q4_K head) even (the 27B-like shape: bench/ab_decode.py --format's noprefetch /
# prefetch).
PREFETCH = {"INT4P": False, "Q4KP": True, "Q6KP": False, "Q5KP": False}
# False: a NormedRow's int8 input made by add_rms_norm then quantize_input, two launches (the A/B
# of bench/ab_decode.py's variant twolaunch)
NORM_QUANTIZE = True
# Programs of that launch (about; each sums the whole row's squares, then norms and quantizes its
# share of the groups): 1 is one program for the whole row (the A/B of ab_decode's variant nqp1)
NORM_QUANTIZE_PROGRAMS = 8
# The grid the K split aims at (pick_config): parts of a row block until about this many programs
PROGRAMS = 8192
# pick_config's form for small matrices (bench/ab_decode.py's nosmall variant: without), up to
# this many weights, where the general form leaves K unsplit or gives fewer programs than
# SMALL_GRID (ab_decode --format Q4_K's grid1024 against setq: the bound of 1,024 beat none on the
# 30B-A3B-like, LFM2-1.2B-like and 35B-A3B-like shapes; the 0.5B- and 0.8B-like shapes' configs
# unchanged)
SMALL = True
SMALL_WEIGHTS = 16 << 20
SMALL_GRID = 1024
# Outputs a program of the split-K reduce launch: 256 (1 warp), faster than 1024 (4 warps) in the
# 27B-like AWQ and Q4_K decode, 128 about as fast (bench/ab_decode.py --format's reduce256 / reduce128)
REDUCE_BLOCK = 256


if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _group_sums(words, x, xb, GW: tl.constexpr, INTERPRETED: tl.constexpr):
        """Per word of the tile [.., GW, R]: sum_j (1 + code_j/16) x_j, and per input position
        [.., GW, 1]: sum_j x_j."""
        ws = tl.zeros(words.shape, dtype=tl.float32)
        xs = tl.zeros(xb.shape, dtype=tl.float32)
        mask = tl.full(words.shape, 15 << 19, tl.int32)
        one = tl.full(words.shape, 0x3F800000, tl.int32)
        for j in tl.static_range(8):
            xj = tl.load(x + xb + j * GW).to(tl.float32)
            if 4 * j <= 19:  # code j into bits 19..22, the mantissa's top four
                moved = words << (19 - 4 * j)
            else:
                moved = words >> (4 * j - 19)
            if INTERPRETED:
                bits = (moved & mask) | one
            else:  # (moved & mask) | one in one LOP3: the constants in registers (a LOP3 takes one immediate)
                bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [moved, mask, one],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            ws += bits.to(tl.float32, bitcast=True) * xj
            xs += xj
        return ws, xs

    @triton.jit
    def _scales(aux, aux2, rb, grp, ri, stride_a, stride_z, FMT: tl.constexpr):
        """(16 s, 16 s + offset) of groups grp (weight = s code - offset): INT4P's from s and z
        (16 s + s z = s (16 + z), exact in fp32: an fp16 s times at most 31); Q4KP's from (d,
        dmin) of the super-block and (sc, m) of the sub-block (Q5KP's alike); Q6KP's from d of the
        super-block and the int8 sc of the group (s = d sc, offset 32 s: exact, an fp16 times at
        most 128 x 48). Converted where loaded: a read ahead that carried the loads unconverted to
        the step's sums (b13d6a4) ran slower in 27B-like Q4_K decode (bench/ab_decode.py)."""
        if FMT == 0:
            s = tl.load(aux + rb * stride_a + grp * 4 + ri).to(tl.float32)
            s16 = 16.0 * s
            c = s16 + s * tl.load(aux2 + rb * stride_z + grp * 4 + ri).to(tl.float32)
        elif FMT == 2:
            sc = tl.load(aux2 + rb * stride_z + grp * 4 + ri).to(tl.int8, bitcast=True).to(tl.float32)
            s = tl.load(aux + rb * stride_a + (grp // 16) * 4 + ri).to(tl.float32) * sc
            s16 = 16.0 * s
            c = 48.0 * s
        else:
            sc = tl.load(aux2 + rb * stride_z + grp * 8 + ri).to(tl.float32)
            mn = tl.load(aux2 + rb * stride_z + grp * 8 + 4 + ri).to(tl.float32)
            d = tl.load(aux + rb * stride_a + (grp // 8) * 8 + ri).to(tl.float32)
            dmin = tl.load(aux + rb * stride_a + (grp // 8) * 8 + 4 + ri).to(tl.float32)
            s16 = 16.0 * d * sc
            c = s16 + dmin * mn
        return s16, c

    @triton.jit
    def _dp4a_pair(lo, xe, hi, xo, INTERPRETED: tl.constexpr):
        """sum over the four bytes b of lo_b xe_b + hi_b xo_b (lo, hi: unsigned codes; xe, xo:
        signed int8 inputs): two DP4As."""
        if INTERPRETED:
            acc = tl.zeros(lo.shape, dtype=tl.int32)
            for b in tl.static_range(4):
                acc += ((lo >> (8 * b)) & 255) * ((xe << (24 - 8 * b)) >> 24)
                acc += ((hi >> (8 * b)) & 255) * ((xo << (24 - 8 * b)) >> 24)
            return acc
        return tl.inline_asm_elementwise("{ dp4a.u32.s32 $0, $1, $2, 0; dp4a.u32.s32 $0, $3, $4, $0; }",
                                         "=r,r,r,r,r", [lo, xe, hi, xo], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _code_high_bits(hi, j, HB: tl.constexpr):
        """Q6KP's and Q5KP's high bits of the code of nibble j (a constexpr or a tensor), moved to
        bits 4..: hi is the group's high word shifted right by 2 HB m for word m, so the code's HB
        bits sit at 8 (j // 2) + HB (j % 2) (planar.py's layout). _planar_dequant_kernel takes them so; _words_dot's float path
        moves them straight into a float's mantissa, its int8 path joins a word's four at once."""
        return ((hi >> (8 * (j // 2) + HB * (j % 2))) & ((1 << HB) - 1)) << 4

    @triton.jit
    def _step_words(w, aux, aux2, rb, gi, wi, ri, step, stride_w, stride_a, stride_z, G: tl.constexpr,
                    NG: tl.constexpr, FMT: tl.constexpr, KW8: tl.constexpr):
        """A step's words [BB, NG, GW, R] of row blocks rb and their groups' (16 s, 16 s + offset).
        Q6KP and Q5KP: int64 words, the low four bits of the codes in the low half and the group's
        high bits, moved to this word's place (h >> 2 HB m, HB high bits a code), in the high half
        (KW8: the row's low words)."""
        GW: tl.constexpr = G // 8
        grp = step * NG + gi
        words = tl.load(w + rb * stride_w + (grp * GW + wi) * 4 + ri)
        if FMT >= 2:  # Q6KP, Q5KP: HB high bits a weight, 2 HB a word in the group's high word
            HB: tl.constexpr = 4 - FMT
            hi = tl.load(w + rb * stride_w + (KW8 + grp) * 4 + ri) >> (2 * HB * wi)
            words = (words.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)
        s16, c = _scales(aux, aux2, rb, grp, ri, stride_a, stride_z, FMT)
        return words, s16, c

    @triton.jit
    def _words_dot(acc, x, words, s16, c, gi, wi, step, G: tl.constexpr, NG: tl.constexpr, A8: tl.constexpr,
                   KW8: tl.constexpr, INTERPRETED: tl.constexpr, FMT: tl.constexpr, PAIRS: tl.constexpr):
        """acc [BB, NG, GW, R] plus the contribution of a step's words (_step_words'). A8: x is
        quantize_input's int32 (PAIRS, as pairs_for gives it: [KW8, 4], else [4, KW8]: per word position, the
        packed int8 inputs of the even and the odd nibbles, the word's input sum dx sum_j q_j and
        its group's dx / 16). Q6KP's and Q5KP's codes: bytes of
        both halves joined (code = low | high << 4) for the DP4As; as given, each code converted."""
        GW: tl.constexpr = G // 8
        HB: tl.constexpr = 4 - FMT  # Q6KP, Q5KP: high bits a code (unused by the other layouts)
        grp = step * NG + gi
        if FMT >= 2:
            lo = words.to(tl.int32)
            hi = (words >> 32).to(tl.int32)
        else:
            lo = words
            hi = words
        if A8:  # sum_j (s code_j - off) q_j dx = 16 s ((dx / 16) sum_j code_j q_j + dx sum_j q_j) - c dx sum_j q_j
            if PAIRS:  # a word position's four values side by side (INT4P's: pairs_for), two 8-byte loads
                p = (grp * GW + wi) * 2
                xp = x.to(tl.pointer_type(tl.int64))
                pair = tl.load(xp + p)
                sums = tl.load(xp + p + 1)
                xe = pair.to(tl.int32)
                xo = (pair >> 32).to(tl.int32)
                xs = sums.to(tl.int32).to(tl.float32, bitcast=True)
                xd16 = (sums >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            else:  # the K-quant layouts' input: four planes of KW8 words, four 4-byte loads
                p = grp * GW + wi
                xe = tl.load(x + p)
                xo = tl.load(x + KW8 + p)
                xs = tl.load(x + 2 * KW8 + p).to(tl.float32, bitcast=True)
                xd16 = tl.load(x + 3 * KW8 + p).to(tl.float32, bitcast=True)
            even = lo & 0x0F0F0F0F
            odd = (lo >> 4) & 0x0F0F0F0F
            if FMT >= 2:  # the high bits of the even and the odd nibbles' codes into bits 4.. of their bytes
                MASK: tl.constexpr = 0x01010101 * ((1 << HB) - 1)
                even = even | ((hi & MASK) << 4)
                odd = odd | (((hi >> HB) & MASK) << 4)
            isum = _dp4a_pair(even, xe, odd, xo, INTERPRETED)
            acc += s16 * (isum.to(tl.float32) * xd16 + xs)
            return acc - c * xs
        if FMT >= 2:  # the float path (fp32 models, and LM heads, whose rows come in fp32)
            # sum_j (s code_j - offset) x_j with each code (low | high << 4: 4 + HB bits) moved into the
            # top of the mantissa of 1.0, f_j = 1 + code_j / 2^(4 + HB), by shifts and masks: sum_j
            # code_j x_j = 2^(4 + HB) (sum_j f_j x_j - sum_j x_j). No integer-to-float conversion: the
            # H200 issues those at a quarter of the rate of the shifts (I2F: 16 a clock an SM).
            TOP: tl.constexpr = 19 - HB  # the code's lowest bit in f: Q6KP 17, Q5KP 18
            ws = tl.zeros(acc.shape, dtype=tl.float32)
            xs = tl.zeros((1, NG, GW, 1), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x + grp * G + wi + j * GW).to(tl.float32)
                if 4 * j <= TOP:  # the low four bits into bits TOP..TOP+3
                    low = lo << (TOP - 4 * j)
                else:
                    low = lo >> (4 * j - TOP)
                # the high bits, at `at` in hi (_code_high_bits' place), into bits TOP+4..22
                at = 8 * (j // 2) + HB * (j % 2)  # (a constexpr: j and HB are)
                if at <= TOP + 4:
                    high = hi << (TOP + 4 - at)
                else:
                    high = hi >> (at - TOP - 4)
                bits = (low & (15 << TOP)) | (high & (((1 << HB) - 1) << (TOP + 4))) | 0x3F800000
                ws += bits.to(tl.float32, bitcast=True) * xj
                xs += xj
            sf = s16 * (1 << HB)  # s 2^(4 + HB)
            return acc + (sf * ws - (sf + c - s16) * xs)
        ws, xs = _group_sums(lo, x, grp * G + wi, GW, INTERPRETED)
        return acc + (s16 * ws - c * xs)

    @triton.jit
    def _rows_dot(acc, x, w, aux, aux2, rb, gi, wi, ri, step, stride_w, stride_a, stride_z, G: tl.constexpr,
                  NG: tl.constexpr, FMT: tl.constexpr, A8: tl.constexpr, KW8: tl.constexpr,
                  INTERPRETED: tl.constexpr, PAIRS: tl.constexpr):
        """acc plus a step's contribution for row blocks rb: its words read, then summed."""
        words, s16, c = _step_words(w, aux, aux2, rb, gi, wi, ri, step, stride_w, stride_a, stride_z, G, NG, FMT,
                                    KW8)
        return _words_dot(acc, x, words, s16, c, gi, wi, step, G, NG, A8, KW8, INTERPRETED, FMT, PAIRS)

    @triton.jit
    def _quantize_groups(src, dst, g, m, ok, G: tl.constexpr, KW8: tl.constexpr, PAIRS: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        """Groups g [GB, 1] of the row at src (words m [1, G/8]; ok: which are real) quantized
        into dst (the row's [KW8, 4] int32 where PAIRS, else [4, KW8]): _quantize_kernel's contract."""
        GW: tl.constexpr = G // 8
        src = src + g * G + m
        amax = tl.zeros(ok.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            amax = tl.maximum(amax, tl.abs(tl.load(src + j * GW, mask=ok, other=0.0).to(tl.float32)))
        amax = tl.max(amax, axis=1)[:, None]
        inv = tl.div_rn(127.0, tl.where(amax > 0, amax, 1.0))
        dx = tl.div_rn(amax, 127.0)
        even = tl.zeros(ok.shape, dtype=tl.int32)
        odd = tl.zeros(ok.shape, dtype=tl.int32)
        qsum = tl.zeros(ok.shape, dtype=tl.int32)
        for j in tl.static_range(8):
            y = tl.load(src + j * GW, mask=ok, other=0.0).to(tl.float32) * inv
            if INTERPRETED:  # round half to even by adding and taking away 1.5 2^23 (|y| <= 127)
                y = (y + 12582912.0) - 12582912.0
            else:
                y = libdevice.rint(y)
            q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int32)
            qsum += q
            if j % 2 == 0:
                even = even | ((q & 255) << (8 * (j // 2)))
            else:
                odd = odd | ((q & 255) << (8 * (j // 2)))
        ST: tl.constexpr = 1 if PAIRS else KW8  # (the four values' stride)
        dst = dst + (g * GW + m) * (4 if PAIRS else 1)
        tl.store(dst, even, mask=ok)
        tl.store(dst + ST, odd, mask=ok)
        tl.store(dst + 2 * ST, (qsum.to(tl.float32) * dx).to(tl.int32, bitcast=True), mask=ok)
        tl.store(dst + 3 * ST, (dx * 0.0625 + tl.zeros(ok.shape, dtype=tl.float32)).to(tl.int32, bitcast=True),
                 mask=ok)

    @triton.jit
    def _quantize_kernel(x, out, stride_x, n_groups, G: tl.constexpr, GB: tl.constexpr, KW8: tl.constexpr,
                         PAIRS: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """Row program_id(1) of x, groups GB a program: per group of G inputs, dx = amax / 127 and
        q = round-half-even(x 127 / amax) (int8); out [KW8, 4] (PAIRS) or [4, KW8] int32 a row: at word position
        g G/8 + m, the bytes q[g G + G/8 j + m] for j = 0, 2, 4, 6 (the even nibbles' inputs), for
        j = 1, 3, 5, 7, then dx sum_j q and dx / 16 (fp32 bits)."""
        GW: tl.constexpr = G // 8
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(1)
        g = tl.program_id(0) * GB + tl.arange(0, GB)[:, None]
        m = tl.arange(0, GW)[None, :]
        _quantize_groups(x + row * stride_x, out + row * 4 * KW8, g, m, (g < n_groups) & (m < GW), G, KW8, PAIRS,
                         INTERPRETED)

    @triton.jit
    def _norm_quantize_kernel(x, y, w, sum_out, norm_out, qout, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                              G: tl.constexpr, NGB: tl.constexpr, HAS_RES: tl.constexpr, PAIRS: tl.constexpr,
                              PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """One row: cuda_base's _add_rms_norm_kernel (the same operations: the same bits; the sum
        written where HAS_RES), then the normed row, re-read once stored, quantized as
        _quantize_kernel does, into qout (its layout: PAIRS). Each program sums the whole row's squares and
        writes groups NGB pid.. of the sum, the normed row and qout (a program of the whole row was
        slower: its stores, loads and rounding done by 4 warps, one after the other; ab_decode's nqp1)."""
        SL: tl.constexpr = NGB * G  # a program's elements
        mine = tl.program_id(0) * SL + tl.arange(0, SL)
        ok = mine < N
        nw = tl.load(w + mine, mask=ok, other=0.0)  # a weight: before the wait
        if PDL:  # the next GEMV launches once the one before this kernel has ended (not while it runs)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _add_norm(x, y, nw, sum_out, norm_out, mine, ok, eps, N, BLOCK, HAS_RES)
        tl.debug_barrier()  # (the block's stores seen by all its threads' loads below)
        GW: tl.constexpr = G // 8
        g = tl.program_id(0) * NGB + tl.arange(0, NGB)[:, None]
        m = tl.arange(0, GW)[None, :]
        _quantize_groups(norm_out, qout, g, m, (g < N // G) & (m < GW), G, N // 8, PAIRS, INTERPRETED)

    @triton.jit
    def _add_norm(x, y, nw, sum_out, norm_out, mine, ok, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_RES: tl.constexpr):
        """The norm-and-quantize launches' add_rms_norm (qruns.py's too): the whole row's squares
        summed (x + y, BLOCK at least N), then at `mine` (ok: which are real) the sum written
        where HAS_RES and the normed row (norm weights nw) stored; returns the normed values."""
        offs = tl.arange(0, BLOCK)
        sf = _summed(x, y, offs, offs < N, HAS_RES).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
        s = _summed(x, y, mine, ok, HAS_RES)
        if HAS_RES:
            tl.store(sum_out + mine, s, mask=ok)
        h = (s.to(tl.float32) * r * nw.to(tl.float32)).to(norm_out.dtype.element_ty)
        tl.store(norm_out + mine, h, mask=ok)
        return h

    @triton.jit
    def _summed(x, y, offs, mask, HAS_RES: tl.constexpr):
        """x + y at offs in x's dtype, as add_rms_norm rounds it (no y: x + 0, -0 becoming +0)."""
        s = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            s += tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            s += 0.0
        return s.to(x.dtype.element_ty)

    @triton.jit
    def _planar_gemv_kernel(x, w, aux, aux2, bias, out, part, idx, N, rows_e, stride_x, stride_w, stride_a, stride_z,
                            G: tl.constexpr, KW: tl.constexpr, STEPS: tl.constexpr, BLOCKS: tl.constexpr,
                            SPLIT: tl.constexpr, EXPERTS: tl.constexpr, PARTIAL: tl.constexpr, FMT: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, A8: tl.constexpr, PREFETCH: tl.constexpr,
                            PAIRS: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """Rows BLOCKS R a program (axis 0). Axis 1: SPLIT > 1, program (i, s) sums the s-th of
        SPLIT equal runs of STEPS // SPLIT steps; EXPERTS, program (i, s) the rows of expert
        idx[s] (rows_e rows an expert, expert e's from row e rows_e) against row s of x (stride_x
        apart), its output row s of `out`. PARTIAL: the fp32 sums go to part[s] (part[SPLIT + s]:
        the up rows') for _reduce_kernel instead of the epilogue."""
        GW: tl.constexpr = G // 8  # words a group
        NG: tl.constexpr = KW // GW  # groups a step
        RUN: tl.constexpr = STEPS // SPLIT
        pid = tl.program_id(0)
        b = pid * BLOCKS + tl.arange(0, BLOCKS)  # row blocks (R rows each)
        last = (N - 1) // 4
        rb = tl.minimum(b, last).to(tl.int64)[:, None, None, None]
        gi = tl.arange(0, NG)[None, :, None, None]
        wi = tl.arange(0, GW)[None, None, :, None]
        ri = tl.arange(0, 4)[None, None, None, :]
        if PDL:  # let the next kernel launch now: it reads its first weights while this one runs
            tl.extra.cuda.gdc_launch_dependents()
        if EXPERTS:  # (idx and x come from the kernels before: read after the wait)
            if PDL:
                tl.extra.cuda.gdc_wait()
            slot = tl.program_id(1)
            rb += tl.load(idx + slot).to(tl.int64) * (rows_e // 4)
            x += slot * stride_x
            out += slot * N
            first = slot * 0
        else:
            first = tl.program_id(1) * RUN
        up_rb = rb + N // 4  # SWIGLU: the up rows sit N rows below (N a multiple of R)
        # the first step's words before waiting on the previous kernel (no kernel writes weights;
        # an expert's rows are known only after it): their latency leaves a launch-bound step's path
        K8: tl.constexpr = STEPS * KW  # a row's words
        words, s16, c = _step_words(w, aux, aux2, rb, gi, wi, ri, first, stride_w, stride_a, stride_z, G, NG, FMT,
                                    K8)
        if SWIGLU:
            u_words, u_s16, u_c = _step_words(w, aux, aux2, up_rb, gi, wi, ri, first, stride_w, stride_a, stride_z,
                                              G, NG, FMT, K8)
        if PDL and not EXPERTS:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BLOCKS, NG, GW, 4), dtype=tl.float32)
        acc_up = acc
        if PREFETCH:  # step i + 1's words and scales read before step i's are summed
            if not SWIGLU:
                u_words, u_s16, u_c = words, s16, c
            for i in range(1, RUN):
                step = first + i
                n_words, n_s16, n_c = _step_words(w, aux, aux2, rb, gi, wi, ri, step, stride_w, stride_a, stride_z,
                                                  G, NG, FMT, K8)
                if SWIGLU:
                    nu_words, nu_s16, nu_c = _step_words(w, aux, aux2, up_rb, gi, wi, ri, step, stride_w, stride_a,
                                                         stride_z, G, NG, FMT, K8)
                acc = _words_dot(acc, x, words, s16, c, gi, wi, step - 1, G, NG, A8, K8, INTERPRETED, FMT, PAIRS)
                if SWIGLU:
                    acc_up = _words_dot(acc_up, x, u_words, u_s16, u_c, gi, wi, step - 1, G, NG, A8, K8,
                                        INTERPRETED, FMT, PAIRS)
                    u_words, u_s16, u_c = nu_words, nu_s16, nu_c
                words, s16, c = n_words, n_s16, n_c
            acc = _words_dot(acc, x, words, s16, c, gi, wi, first + RUN - 1, G, NG, A8, K8, INTERPRETED, FMT, PAIRS)
            if SWIGLU:
                acc_up = _words_dot(acc_up, x, u_words, u_s16, u_c, gi, wi, first + RUN - 1, G, NG, A8, K8,
                                    INTERPRETED, FMT, PAIRS)
        else:
            acc = _words_dot(acc, x, words, s16, c, gi, wi, first, G, NG, A8, K8, INTERPRETED, FMT, PAIRS)
            if SWIGLU:
                acc_up = _words_dot(acc_up, x, u_words, u_s16, u_c, gi, wi, first, G, NG, A8, K8,
                                    INTERPRETED, FMT, PAIRS)
            for i in range(1, RUN):
                step = first + i
                acc = _rows_dot(acc, x, w, aux, aux2, rb, gi, wi, ri, step, stride_w, stride_a, stride_z, G, NG, FMT,
                                A8, K8, INTERPRETED, PAIRS)
                if SWIGLU:
                    acc_up = _rows_dot(acc_up, x, w, aux, aux2, up_rb, gi, wi, ri, step, stride_w, stride_a, stride_z,
                                       G, NG, FMT, A8, K8, INTERPRETED, PAIRS)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCKS, R]
        n = b[:, None] * 4 + tl.arange(0, 4)[None, :]
        if PARTIAL:
            at = part + tl.program_id(1) * N + n
            tl.store(at, y, mask=n < N)
            if SWIGLU:
                tl.store(at + SPLIT * N, tl.sum(tl.sum(acc_up, axis=2), axis=1), mask=n < N)
            return
        _epilogue(y, tl.sum(tl.sum(acc_up, axis=2), axis=1) if SWIGLU else y, bias, out, n, N, HAS_BIAS, SWIGLU)

    @triton.jit
    def _epilogue(y, up, bias, out, n, N, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
        """The GEMVs' last step (qruns.py's too): outputs n (of N) from their fp32 sums y (and the up
        rows' sums `up` where SWIGLU), plus the bias (the up rows' from N on), silu(y) up, stored in
        out's dtype."""
        rows = tl.minimum(n, N - 1)
        if HAS_BIAS:
            y += tl.load(bias + rows).to(tl.float32)
        if SWIGLU:
            if HAS_BIAS:
                up += tl.load(bias + rows + N).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * up
        tl.store(out + n, y.to(out.dtype.element_ty), mask=n < N)

    @triton.jit
    def _reduce_kernel(part, bias, weights, shared, shared_gate, out, N, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SWIGLU: tl.constexpr, WEIGHTED: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
                       BLOCK: tl.constexpr):
        """out = the sum of part's PARTS rows in their order (deterministic, unlike atomics), each
        times weights[s] where WEIGHTED (the experts' routing weights); then the bias and SwiGLU
        as the one-launch kernel applies them; SHARED: plus shared * sigmoid(shared_gate) (a
        shared expert's output and its gate's logit)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = n < N
        y = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(PARTS):
            p = tl.load(part + s * N + n, mask=m, other=0.0)
            if WEIGHTED:
                p = p * tl.load(weights + s)
            y += p
        if HAS_BIAS:
            y += tl.load(bias + n, mask=m, other=0.0).to(tl.float32)
        if SWIGLU:
            up = tl.load(part + PARTS * N + n, mask=m, other=0.0)
            for s in tl.static_range(1, PARTS):
                up += tl.load(part + (PARTS + s) * N + n, mask=m, other=0.0)
            if HAS_BIAS:
                up += tl.load(bias + n + N, mask=m, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * up
        if SHARED:
            sg = tl.load(shared_gate).to(tl.float32)
            y += tl.load(shared + n, mask=m, other=0.0).to(tl.float32) / (1.0 + tl.exp(-sg))
        tl.store(out + n, y.to(out.dtype.element_ty), mask=m)


if triton is not None:
    @triton.jit
    def _planar_dequant_kernel(w, aux, aux2, out, start, stop, stride_w, stride_a, stride_z, stride_o, kw8,
                               G: tl.constexpr, NG: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                               FLAT: tl.constexpr):
        """Rows start..stop of W, NG groups of G weights a program: W = s code - offset. The tile
        is [rows, group, nibble j, word m]: weight g G + G/8 j + m of a row, so a row's NG G
        weights are contiguous in it (a store per nibble wrote G/8-weight pieces G apart: 8 bytes
        of each 32-byte sector at a time for Q4KP's 32-weight groups). FLAT: the tile reshaped to
        [rows, NG G] before the store, whose contiguity Triton then sees whole (in the 4-D tile it
        sees only the G/8 words of m: 8-byte stores for Q4KP's 4). FLAT=False, the 4-D store, is
        kept for bench/quant_bench.py --sweep-dequant and tests/kernels/test_qplanar.py only: the default
        tile (DEQUANT_TILE) stores flat."""
        GW: tl.constexpr = G // 8
        i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None, None]
        g = tl.program_id(1) * NG + tl.arange(0, NG)[None, :, None, None]
        j = tl.arange(0, 8)[None, None, :, None]
        m = tl.arange(0, GW)[None, None, None, :]
        n = tl.minimum(start + i, stop - 1).to(tl.int64)
        words = tl.load(w + (n // 4) * stride_w + (g * GW + m) * 4 + n % 4)  # [rows, NG, 1, GW]
        s16, cs = _scales(aux, aux2, n // 4, g, n % 4, stride_a, stride_z, FMT)  # [rows, NG, 1, 1]
        off = cs - s16  # the offset: exact for INT4P (s z) and Q4KP (dmin m) where cs did not round
        scale = s16 * 0.0625
        code = (words >> (4 * j)) & 15
        if FMT >= 2:  # Q6KP, Q5KP: the group's high bits (kw8: the row's words of low bits before them)
            HB: tl.constexpr = 4 - FMT
            hi = tl.load(w + (n // 4) * stride_w + (kw8 + g) * 4 + n % 4) >> (2 * HB * m)
            code = code | _code_high_bits(hi, j, HB)
        code = code.to(tl.float32)
        val = (scale * code - off).to(out.dtype.element_ty)
        if FLAT:
            r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
            kk = tl.program_id(1) * (NG * G) + tl.arange(0, NG * G)[None, :]
            tl.store(out + r.to(tl.int64) * stride_o + kk, tl.reshape(val, [BLOCK_N, NG * G]), mask=start + r < stop)
        else:
            tl.store(out + i.to(tl.int64) * stride_o + g * G + j * GW + m, val, mask=start + i < stop)


# (rows a program, weights a program at most, num_warps, flat store): the tile of the dequantize
# launch. bench/quant_bench.py --sweep-dequant on an H200, the 27B-like [34816, 5120] into bf16:
# the 4-D store of 16 x 128 x 4 (8-byte stores where a group's words are few) was several times
# slower for Q4KP, Q5KP and Q6KP, a large cost beside the GEMM of the 2k-token prefill it fed
DEQUANT_TILE = (16, 1024, 8, True)


def dequantize_rows(pw: QWeight, start: int, stop: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None, tile: tuple[int, int, int, bool] | None = None) -> torch.Tensor:
    """Rows start..stop of W in `dtype` ([stop - start, K]; into `out` where given, rows of unit
    stride along K): each weight scale * code - scale * zero in fp32, rounded once. `tile`:
    DEQUANT_TILE's form, that tile by default."""
    rows = stop - start
    out = torch.empty(rows, pw.k, dtype=dtype, device=pw.data.device) if out is None else out
    bn, most, warps, flat = tile or DEQUANT_TILE
    z = pw.zeros if pw.zeros is not None else pw.scales
    groups = pw.k // pw.group
    ng = 1  # groups a program: up to `most` weights, whole groups that divide the row's
    while ng * 2 * pw.group <= most and groups % (ng * 2) == 0:
        ng *= 2
    launch(_planar_dequant_kernel, (cdiv(rows, bn), groups // ng), pw.data, pw.scales, z, out, start,
           stop, pw.data.stride(0), pw.scales.stride(0), z.stride(0), out.stride(0), pw.k // 8, G=pw.group, NG=ng,
           FMT=FMTS[pw.fmt], BLOCK_N=bn, FLAT=flat, num_warps=warps)
    return out


# An LM head's rows (n >= HEAD_ROWS) on the float path (its fp32 normed row): 16 rows and 2 warps a
# program (the best of quant_bench.py --sweep-head on the 27B-like Q6KP head, faster than the
# general form's 8 x 2: ab_decode's head8x2; on int8 inputs the general form holds)
HEAD_ROWS = 16384
HEAD_FLOAT_TILE = (16, 2)


def pick_config(n: int, k: int, group: int, rows: int | None = None, warps: int | None = None,
                small: bool = True, int8: bool = True) -> tuple[int, int, int, int]:
    """(rows a program, num_warps, words a step, K split in): `rows` and `warps` where given, else
    8 rows and 2 warps (on float inputs, an LM head's rows: HEAD_FLOAT_TILE's); K split in the
    most parts, up to the fewest that give the grid ~PROGRAMS (8,192) programs, of at least 4 steps each;
    32 words a step, else 64, else 16 (that divide a row into whole groups and the steps into
    those parts). A small matrix (SMALL: at most SMALL_WEIGHTS weights, where that general form
    leaves K unsplit or has fewer than SMALL_GRID programs; `small`), rows of at most 4,096 in
    whole 64-word steps (the 0.8B-like shape's): 8 rows, 4 warps, 64 words a step, K unsplit
    (`--sweep-grid`: faster on the 0.8B-like gate/up [7168, 1024] and down [1024, 3584] than the
    general form with a reduce launch); other small matrices with fewer than SMALL_GRID programs
    (the 0.5B-like down [896, 4864]: 608 words) on 4 rows, 1 warp, 8 words a step, K in up to 4
    parts (faster than 8 x 2 x 32 x 1). Measured on an H200 (bench/quant_bench.py --sweep): one
    program's loads leave the memory idle, so parallel parts sped up INT4P on [5120, 17408] most,
    and 32 words a step beat 64 on every 27B-like shape. 2 warps over the 8 rows (`--sweep-planar`)
    beat 4 on all six 27B-like matrices but one (INT4P [10240, 5120] on int8 inputs). int8 False
    (float inputs) on an LM head's rows (n >= HEAD_ROWS): HEAD_FLOAT_TILE's rows and warps, unless
    given."""
    gw, words = group // 8, k // 8
    if rows is None or warps is None:
        rows, warps = HEAD_FLOAT_TILE if not int8 and n >= HEAD_ROWS else (8, 2)
    general = _general_config(n, words, gw, rows, warps)
    few = -(-n // general[0]) * general[3] < SMALL_GRID
    if small and SMALL and n * k <= SMALL_WEIGHTS and (general[3] == 1 or few):
        if words <= 512 and words % 64 == 0 and 64 % gw == 0:
            return 8, 4, 64, 1
        if few and words % 8 == 0 and 8 % gw == 0:  # (rows not in whole 64-word steps: 4 rows, 1 warp, 8-word steps)
            split = next((s for s in (4, 2) if (words // 8) % s == 0 and words // 8 // s >= 4), 1)
            return 4, 1, 8, split
    return general


def _general_config(n: int, words: int, gw: int, rows: int, warps: int) -> tuple[int, int, int, int]:
    """pick_config's form for any matrix (its docstring: 32 words a step, else 64, else 16; K split
    towards ~PROGRAMS programs)."""
    want = 1
    while -(-n // rows) * want < PROGRAMS and want < 16:
        want *= 2
    splits = [want >> i for i in range(want.bit_length())]
    for split, kw in [(s, w) for s in splits for w in (32, 64)] + [(s, 16) for s in splits]:
        if words % kw == 0 and kw % gw == 0 and (words // kw) % split == 0 and (split == 1 or words // kw // split >= 4):
            return rows, warps, kw, split
    kw = next(w for w in (32, 64, 16, 8, 4, 2, 1) if words % w == 0 and w % gw == 0)
    return rows, warps, kw, 1


# The 16-bit models' GEMVs on their inputs as given rather than int8 (int8_inputs)
A16 = False


def int8_inputs(dtype: torch.dtype) -> bool:
    """Whether the GEMVs of a model computing in `dtype` take their inputs as int8 per group
    (quantize_input; DP4A against the codes), as llama.cpp's CUDA GEMVs take theirs: for 16-bit
    models, whose inputs already carry 8 bits of mantissa, unless A16 (bench/ab_decode.py's a16
    variant, the tests of the float path); an fp32 model (the reference form) keeps its inputs as
    given, each code turned into a float."""
    return dtype in (torch.bfloat16, torch.float16) and not A16


def row_input(x: "torch.Tensor | NormedRow", int8: bool | None) -> tuple["torch.Tensor | NormedRow", torch.dtype, bool]:
    """(x, the row's dtype, int8) for a GEMV here or in qruns.py: int8 by default int8_inputs of
    the row's dtype; a NormedRow kept only for int8 inputs (normed and quantized in one launch),
    else materialized."""
    dtype = linear_row_dtype(x)
    int8 = int8_inputs(dtype) if int8 is None else int8
    if isinstance(x, NormedRow) and not int8:
        x = x.materialize()
    return x, dtype, int8


def pairs_for(fmt: "str | int") -> bool:
    """Whether GEMVs of this layout read their int8 input with a word position's four values side
    by side ([K/8, 4], two 8-byte loads a word) rather than in four planes ([4, K/8], four 4-byte
    loads): INT4P only. On an H200 (bench/ab_decode.py --format, the 27B-like shape) side by side
    sped up AWQ and slowed Q4_K."""
    return fmt in ("INT4P", 0)


def quantize_input(x: torch.Tensor, group: int, pairs: bool = False) -> torch.Tensor:
    """x [S, K] (rows of unit stride along K) → int32 [S, 4, K/8], or [S, K/8, 4] with `pairs`
    (_quantize_kernel's layouts: pairs_for): per group of `group` inputs, q = round(x 127 / amax)
    as int8 and dx = amax / 127, so the GEMVs compute with x~ = q dx (quantized_reference)."""
    S, K = x.shape
    out = torch.empty((S, K // 8, 4) if pairs else (S, 4, K // 8), dtype=torch.int32, device=x.device)
    n_groups, gb = K // group, 4
    launch(_quantize_kernel, (cdiv(n_groups, gb), S), x, out, x.stride(0), n_groups, G=group, GB=gb,
           KW8=K // 8, PAIRS=pairs, INTERPRETED=cuda_base.interpreted(), num_warps=1,
           **cuda_base.pdl(x))
    return out


def quantized_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """The x~ = q dx the int8-input GEMVs compute with (quantize_input), in fp64, from x [S, K]."""
    g = x.float().reshape(x.shape[0], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    # (a tensor's division, correctly rounded as the kernels' div_rn: torch turns `127.0 / t` into
    # reciprocal(t) * 127, two roundings, which moved a near tie of a bf16 input by one step)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(g * inv).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def normed_input(row: NormedRow, group: int, pairs: bool = False) -> torch.Tensor:
    """The int8 input (quantize_input's) of a NormedRow for GEMVs of `group`, made once a row (its
    other GEMVs of that group take the same): where the row is not normed yet, one launch norms
    it (the stream written, the row kept as materialize() would leave it) and quantizes it (the
    bits of add_rms_norm then quantize_input, one launch fewer). `pairs`: quantize_input's."""
    q = row.forms.get(("int8", group, pairs))
    if q is None:
        h = row.row_for_prologue() if NORM_QUANTIZE else None  # None: normed already, or two launches asked for
        if h is None:
            q = quantize_input(row.materialize(), group, pairs)
        else:
            K = row.x.shape[-1]
            q = torch.empty((1, K // 8, 4) if pairs else (1, 4, K // 8), dtype=torch.int32, device=row.x.device)
            ngb = next_pow2(-(-(K // group) // NORM_QUANTIZE_PROGRAMS))
            launch(_norm_quantize_kernel, (cdiv(K // group, ngb),), row.x,
                   row.res if row.res is not None else row.x, row.weight, row.stream, h, q, row.eps, N=K,
                   BLOCK=next_pow2(K), G=group, NGB=ngb, HAS_RES=row.res is not None, PAIRS=pairs,
                   INTERPRETED=cuda_base.interpreted(), num_warps=4, **cuda_base.pdl(row.x))
        row.forms[("int8", group, pairs)] = q
    return q


def gemv(x: "torch.Tensor | NormedRow", pw: QWeight, bias: torch.Tensor | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, config: tuple[int, int, int] | None = None,
         int8: bool | None = None) -> torch.Tensor:
    """x [1, K] contiguous (or a NormedRow of one: normed and quantized in one launch, normed_input);
    pw an INT4P, Q4KP, Q5KP or Q6KP QWeight (planar.repack_*). Returns [1, N] (swiglu: [1, N/2], the gate rows first;
    in one launch where N/2 is whole blocks of R rows) in out_dtype (the row's dtype by default).
    int8 (int8_inputs of the row's dtype by default): against x~ = quantized_reference(x) instead of x."""
    n_out = pw.n // 2 if swiglu else pw.n
    x, row_dtype, int8 = row_input(x, int8)
    normed = isinstance(x, NormedRow)
    if swiglu and n_out % R:  # halves not whole row blocks: both rows' sums, then the SwiGLU in torch
        both = gemv(x, pw, bias, out_dtype=torch.float32, config=config, int8=int8)
        gate, up = both[:, :n_out], both[:, n_out:]
        return (torch.nn.functional.silu(gate) * up).to(out_dtype or row_dtype)
    rows, warps, kw, split = config or pick_config(n_out, pw.k, pw.group, int8=int8)
    steps = pw.k // 8 // kw if (pw.k // 8) % kw == 0 else 0
    if not steps or kw % (pw.group // 8) or rows % R or steps % split:
        raise ValueError(f"config {rows} rows x {kw} words a step, K split in {split}, does not fit "
                         f"K = {pw.k}, group {pw.group}")
    if int8:
        pairs = pairs_for(pw.fmt)
        src = normed_input(x, pw.group, pairs) if normed else quantize_input(x, pw.group, pairs)
    else:
        src = x
    out = torch.empty(1, n_out, dtype=out_dtype or row_dtype, device=x.device)
    b = bias if bias is not None else src
    part = torch.empty(split * (2 if swiglu else 1), n_out, dtype=torch.float32, device=x.device) \
        if split > 1 else out
    _launch(src, pw, (cdiv(n_out, rows), split), b, out, part, src, n_out, 0, 0, kw, steps, rows, warps,
            split=split, experts=False, partial=split > 1, has_bias=bias is not None, swiglu=swiglu, int8=int8)
    if split > 1:
        _reduce(part, split, out, n_out, bias=bias, swiglu=swiglu)
    return out


def _launch(x, pw: QWeight, grid, bias, out, part, idx, n, rows_e, stride_x, kw, steps, rows, warps, *, split,
            experts, partial, has_bias, swiglu, int8) -> None:
    z = pw.zeros if pw.zeros is not None else pw.scales
    launch(_planar_gemv_kernel, grid, x, pw.data, pw.scales, z, bias, out, part, idx, n, rows_e, stride_x,
           pw.data.stride(0), pw.scales.stride(0), z.stride(0), G=pw.group, KW=kw, STEPS=steps, BLOCKS=rows // R,
           SPLIT=split, EXPERTS=experts, PARTIAL=partial, FMT=FMTS[pw.fmt], HAS_BIAS=has_bias, SWIGLU=swiglu, A8=int8,
           PREFETCH=PREFETCH[pw.fmt], PAIRS=pairs_for(pw.fmt), INTERPRETED=cuda_base.interpreted(), num_warps=warps, **cuda_base.pdl(x))


def _reduce(part, parts: int, out, n: int, bias=None, swiglu=False, weights=None, shared=None,
            shared_gate=None) -> None:
    launch(_reduce_kernel, (cdiv(n, REDUCE_BLOCK),), part, bias if bias is not None else part,
           weights if weights is not None else part, shared if shared is not None else part,
           shared_gate if shared_gate is not None else part, out, n, PARTS=parts, HAS_BIAS=bias is not None,
           SWIGLU=swiglu, WEIGHTED=weights is not None, SHARED=shared is not None, BLOCK=REDUCE_BLOCK,
           num_warps=max(1, min(4, REDUCE_BLOCK // 256)),
           **cuda_base.pdl(part))


def _expert_config(n: int, k: int, group: int) -> tuple[int, int, int, int]:
    """pick_config's rows, warps and words a step, unsplit (the top k experts fill axis 1; not its
    small-matrix form, measured on whole matrices only)."""
    rows, warps, kw, _ = pick_config(n, k, group, small=False)
    return rows, warps, kw, (k // 8) // kw


def experts_gate_up(x: torch.Tensor, pw: QWeight, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """x [1, H] contiguous; pw the experts' fused [gate; up] rows as one planar QWeight
    [E 2I, H] (expert e's 2I rows from row 2I e, gate rows first); idx [1, k] int64 (on the
    device). Returns h [k, I] fp32: silu(gate_e x) * up_e x for e = idx[s], in one launch."""
    rows_e = pw.n // num_experts
    n_out, k = rows_e // 2, idx.shape[-1]
    if rows_e * num_experts != pw.n or n_out % R:
        raise ValueError(f"{pw.n} rows do not hold {num_experts} experts of whole [gate; up] row blocks")
    rows, warps, kw, steps = _expert_config(n_out, pw.k, pw.group)
    h = torch.empty(k, n_out, dtype=torch.float32, device=x.device)
    int8 = int8_inputs(x.dtype)
    src = quantize_input(x, pw.group, pairs_for(pw.fmt)) if int8 else x
    _launch(src, pw, (cdiv(n_out, rows), k), x, h, h, idx, n_out, rows_e, 0, kw, steps, rows, warps,
            split=1, experts=True, partial=False, has_bias=False, swiglu=True, int8=int8)
    return h


def experts_down(h: torch.Tensor, pw: QWeight, idx: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 out_dtype: torch.dtype, shared: torch.Tensor | None = None,
                 shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """h [k, I] fp32 contiguous (experts_gate_up's, or moe.experts_gate_up's); pw the experts'
    down rows as one planar QWeight [E H, I]; weights [1, k] fp32. Returns [1, H] in out_dtype:
    sum_s weights[s] down_{idx[s]} h[s], summed in slot order by a second launch, plus
    shared * sigmoid(shared_gate) where given (a shared expert's output [1, H] and logit [1, 1])."""
    rows_e = pw.n // num_experts
    k = idx.shape[-1]
    if rows_e * num_experts != pw.n or rows_e % R:
        raise ValueError(f"{pw.n} rows do not hold {num_experts} experts of whole row blocks")
    rows, warps, kw, steps = _expert_config(rows_e, pw.k, pw.group)
    part = torch.empty(k, rows_e, dtype=torch.float32, device=h.device)
    out = torch.empty(1, rows_e, dtype=out_dtype, device=h.device)
    int8 = int8_inputs(out_dtype)  # (h is fp32 in every model: the model's dtype decides)
    src = quantize_input(h, pw.group, pairs_for(pw.fmt)) if int8 else h
    _launch(src, pw, (cdiv(rows_e, rows), k), h, part, part, idx, rows_e, rows_e, src.stride(0), kw, steps,
            rows, warps, split=1, experts=True, partial=True, has_bias=False, swiglu=False, int8=int8)
    _reduce(part, k, out, rows_e, weights=weights, shared=shared, shared_gate=shared_gate)
    return out
