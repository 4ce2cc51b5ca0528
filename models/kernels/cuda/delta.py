"""Triton kernels for a Gated DeltaNet layer's one-token decode step (CUDA), in two launches.

Contract: `decode(proj, conv_state, conv_weight, rec_state, neg_A, dt_bias, norm_weight, ...)`
computes what GatedDeltaNet.forward computes for T == 1 between its input projection and its
output projection (tests/kernels/test_delta_split.py compares them), and updates both states in place:
- conv_step: the depthwise causal conv over [conv window, new column] with SiLU, and the window
  shifted by one (one program owns each channel, so no two programs touch the same state row);
- delta_step: L2-normalised q (scaled by 1/sqrt(dk)) and k of its key head, beta = beta_scale
  sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated delta rule on the head's fp32
  [dk, dv] state (gated_delta.step), and the gated RMSNorm RMSNorm(o) w SiLU(z). Given the layer's
  counters (`sync`), each head's dv value columns are split over programs of SPLIT_CONFIG's
  columns (every column's state, o and gate are its own), and the head's last program to finish
  sums the blocks' squares in a fixed order and norms the head: the same bits every run. Without
  them, one program a head.
With `int8_out` (dv a multiple of 32) the output comes carrying its int8 words for a runs out_proj
(qruns.carrying: quantize_input's bits, written by the program that writes the head).
Everything accumulates in fp32 and rounds once to the output dtype; the torch form rounds between
ops, so the two agree to bf16 rounding. The torch form replaces ~30 kernel launches per layer.
"""
from __future__ import annotations


import torch

from . import base as cuda_base, qruns
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter
    from .qruns import _quantize_head

    # Both kernels read their layer's own state before waiting on the previous kernel (PDL), as
    # they read weights: no kernel of a step writes a layer's conv or recurrent state but that
    # layer's own step kernels, and every step starts with torch ops (the embedding), launched
    # without PDL, which wait until every earlier kernel has ended. Reading it after the wait was
    # slower on both hybrid shapes (bench/ab_decode.py).

    @triton.jit
    def _conv_step_kernel(x, state, weight, bias, out, C, KM1: tl.constexpr, KP: tl.constexpr,
                          BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """The depthwise causal conv step of C channels (with Mamba2's bias where HAS_BIAS) and
        SiLU into `out` (fp32), the window in `state` [C, K-1] shifted by one. ssd.py's too."""
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cm = c < C
        j = tl.arange(0, KP)  # window column: 0..K-2 the stored window, K-1 the new input
        w = tl.load(weight + c[:, None] * (KM1 + 1) + j[None, :], mask=cm[:, None] & (j[None, :] <= KM1), other=0.0)
        old = tl.load(state + c[:, None] * KM1 + j[None, :], mask=cm[:, None] & (j[None, :] < KM1), other=0.0)
        _pdl_enter(PDL)
        new = tl.load(x + c, mask=cm, other=0.0)
        win = tl.where(j[None, :] == KM1, new[:, None].to(tl.float32), old.to(tl.float32))
        y = tl.sum(win * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            y += tl.load(bias + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(out + c, y / (1.0 + tl.exp(-y)), mask=cm)
        # the window moves by one: column j takes column j + 1 (the state row keeps its dtype)
        shifted = tl.load(state + c[:, None] * KM1 + j[None, :] + 1,
                          mask=cm[:, None] & (j[None, :] + 1 < KM1), other=0.0)
        shifted = tl.where(j[None, :] == KM1 - 1, new[:, None].to(shifted.dtype), shifted)
        tl.store(state + c[:, None] * KM1 + j[None, :], shifted, mask=cm[:, None] & (j[None, :] < KM1))

    @triton.jit
    def _delta_step_kernel(act, proj, rec, neg_A, dt_bias, norm_w, out, part, ssq, sync, q8, z_off, b_off, a_off, eps,
                           q_scale, beta_scale, KEY_DIM: tl.constexpr, R: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BV: tl.constexpr, Q8: tl.constexpr, KQ: tl.constexpr,
                           TILED: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
        """Value head program_id(0)'s columns program_id(1) BV.. (grid [nv, DV / BV]). With BV = DV
        one program owns the head (part, ssq and sync unread). Split, each column's state, o and
        gate are its program's own, but the head's gated RMSNorm needs all of o's squares: each
        program stores its gated o (part) and its sum of squares (ssq), and the last of the
        head's programs to count itself in (`sync`, an acq_rel atomic after a barrier) sums the
        squares in column-block order (the same bits whatever the order of arrival), writes the
        head's output and sets the count back to zero. Q8: the program writing a head's output
        also writes its int8 runs (qruns.quantize_input's words from the stored output; KQ: the
        row's words). TILED: head h's output (and words) go to slot (h % R) NK + h // R, the
        tiled order of a qwen35 GGUF's out_proj columns (NK = the key heads)."""
        SPLIT: tl.constexpr = DV // BV
        h = tl.program_id(0)
        c = tl.program_id(1)
        kh = h // R
        if TILED:
            slot = (h % R) * (KEY_DIM // DK) + kh
        else:
            slot = h
        dk = tl.arange(0, DK)
        dv = c * BV + tl.arange(0, BV)
        s_ptr = rec + h * DK * DV + dk[:, None] * DV + dv[None, :]
        nw = tl.load(norm_w + dv).to(tl.float32)
        neg_a, dtb = tl.load(neg_A + h), tl.load(dt_bias + h)
        S = tl.load(s_ptr)
        _pdl_enter(PDL)
        q = tl.load(act + kh * DK + dk)
        k = tl.load(act + KEY_DIM + kh * DK + dk)
        v = tl.load(act + 2 * KEY_DIM + h * DV + dv)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        b = tl.load(proj + b_off + h).to(tl.float32)
        a = tl.load(proj + a_off + h).to(tl.float32) + dtb
        beta = beta_scale / (1.0 + tl.exp(-b))
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))  # torch's threshold
        decay = tl.exp(neg_a * softplus)
        S = S * decay
        kv_mem = tl.sum(k[:, None] * S, axis=0)                   # k^T S, [BV]
        delta = (v - kv_mem) * beta
        S = S + k[:, None] * delta[None, :]
        tl.store(s_ptr, S)
        o = tl.sum(q[:, None] * S, axis=0)                        # q^T S, [BV]
        z = tl.load(proj + z_off + h * DV + dv).to(tl.float32)
        if SPLIT == 1:
            o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * nw
            y = (o * z / (1.0 + tl.exp(-z))).to(out.dtype.element_ty)
            tl.store(out + slot * DV + dv, y)
            if Q8:
                _quantize_head(y, slot * (DV // 32), DV // 32, q8, KQ, INTERPRETED)
        else:
            tl.store(part + h * DV + dv, o * nw * (z / (1.0 + tl.exp(-z))))
            tl.store(ssq + h * SPLIT + c, tl.sum(o * o, axis=0))
            tl.debug_barrier()  # every thread's stores before the count (the release covers them)
            if tl.atomic_add(sync + h, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                ms = tl.sum(tl.load(ssq + h * SPLIT + tl.arange(0, SPLIT), cache_modifier=".cg"), axis=0) / DV
                col = tl.arange(0, DV)
                gated = tl.load(part + h * DV + col, cache_modifier=".cg")  # (other programs wrote it: from L2)
                y = (gated / tl.sqrt(ms + eps)).to(out.dtype.element_ty)
                tl.store(out + slot * DV + col, y)
                if Q8:
                    _quantize_head(y, slot * (DV // 32), DV // 32, q8, KQ, INTERPRETED)
                tl.store(sync + h, 0)


# The delta step's value columns a program and its warps, (BV, num_warps); BV >= DV: one program
# a head. Split, a head's programs meet through counters the caller keeps
# (decode's `sync`). 32 columns on 4 warps: faster than one program a head in 27B-like FP8 and
# 0.8B-like bf16 decode; 16 or 64 columns, 2 or 4 warps were slower (bench/ab_decode.py's
# deltaone and delta{16,32,64}w* variants).
SPLIT_CONFIG = (32, 4)


def decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, rec_state: torch.Tensor,
           neg_A: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
           nk: int, nv: int, dk: int, dv: int, beta_scale: float = 1.0,
           sync: torch.Tensor | None = None, int8_out: bool = False, tiled: bool = False):
    """proj: the fused input projection's output [1, conv_dim + value_dim + 2 nv] (mixed qkv, z,
    b, a), contiguous; conv_state [conv_dim, K-1] and rec_state [nv, dk, dv] fp32, both updated in
    place; conv_weight [conv_dim, 1, K]. beta = beta_scale * sigmoid(b) (2 for OLMo-Hybrid).
    sync: int32 zeros, at least nv, this layer's own (`counters`; every launch leaves them zero):
    with them the delta step splits each head's value columns over programs (SPLIT_CONFIG).
    Returns the normed, gated output [1, nv * dv]; with int8_out (dv a multiple of 32: for an
    out_proj that reads qruns.py's int8 words, qruns.reads_int8) as a row carrying its int8 words
    too, written by the same launch (NormedRow.made). tiled: the heads in llama.cpp's tiled
    order (qwen3_5.GatedDeltaNet.out_tiled), not HF's grouped one."""
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    k = conv_weight.shape[-1]
    act = torch.empty(conv_dim, dtype=torch.float32, device=proj.device)
    block = 256
    launch(_conv_step_kernel, (cdiv(conv_dim, block),), proj, conv_state, conv_weight, conv_weight, act,
           conv_dim, KM1=k - 1, KP=next_pow2(k), BLOCK=block, HAS_BIAS=False, **cuda_base.pdl(proj))
    out = torch.empty(1, value_dim, dtype=proj.dtype, device=proj.device)
    offsets = (conv_dim, conv_dim + value_dim, conv_dim + value_dim + nv, eps, dk ** -0.5, float(beta_scale))
    bv, warps = SPLIT_CONFIG
    if sync is not None and bv < dv and dv % bv == 0 and sync.numel() >= nv:
        part = torch.empty(nv, dv, dtype=torch.float32, device=proj.device)
        ssq = torch.empty(nv, dv // bv, dtype=torch.float32, device=proj.device)
    else:  # one program a head (part, ssq and sync unread)
        bv, warps, part, ssq, sync = dv, 8, out, out, out
    q8 = int8_out and dv % 32 == 0
    words = qruns.int8_words(value_dim, proj.device) if q8 else out
    launch(_delta_step_kernel, (nv, dv // bv), act, proj, rec_state, neg_A, dt_bias, norm_weight, out, part, ssq,
           sync, words, *offsets, KEY_DIM=key_dim, R=nv // nk, DK=dk, DV=dv, BV=bv, Q8=q8, KQ=value_dim // 4,
           TILED=bool(tiled) and nv != nk, INTERPRETED=cuda_base.interpreted(), num_warps=warps, **cuda_base.pdl(proj))
    return qruns.carrying(out, words) if q8 else out


def counters(nv: int, device: torch.device) -> torch.Tensor:
    """A layer's `sync` for decode: nv int32 zeros (each launch leaves them zero again)."""
    return torch.zeros(nv, dtype=torch.int32, device=device)
