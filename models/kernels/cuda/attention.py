"""Triton decode attention (CUDA): one query per head over the live cached slots, split-K.

Contract: `decode(q, k_cache, v_cache, positions)` is attention of q [H, 1, D] over cache slots
0..positions[0] of [KVH, S, D] caches (GQA: query head h reads KV head h // (H / KVH)), returning
[1, H*D]; with `gate` (the gated attention of Qwen3.5), the output times sigmoid(gate); with
`int8_out` (D a multiple of 32), that row carrying its int8 words for a runs o_proj
(qruns.carrying: quantize_input's bits, made by the merge).
The live length is read from the device, so one launch (and one CUDA graph) serves every position
and reads only the live slots, not a padded bucket; the torch form (layers.decode_attention) needs
a mask over a bucket and four kernels. Two launches: each program of the first takes one KV
head's query group over one of NSPLIT slices of the live slots (flash-decoding: the slices run
in parallel on a long context) and keeps a running max, sum and weighted value sum; the second
merges the slices per head. The slices depend only on the position, so results are the same run
to run and between a graph and the eager step (no atomics). Scores and softmax in fp32; the
probabilities meet the values in bf16 on the tensor cores, as the torch form's bmm does.
"""
from __future__ import annotations


import torch

from . import base as cuda_base, qruns
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter
    from .qruns import _quantize_head

    @triton.jit
    def _split_kernel(q, k_cache, v_cache, pos_ptr, m_out, l_out, acc_out, stride_kh, stride_vh, scale,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                      BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        n = tl.load(pos_ptr) + 1                                   # live slots
        chunk = tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        qv = tl.load(q + (kvh * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(start, end, BLOCK_N):
            slots = s0 + tl.arange(0, BLOCK_N)
            live = slots < end
            k = tl.load(k_cache + kvh * stride_kh + slots[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
            scores = tl.dot(qv, tl.trans(k)) * scale               # [GP, BLOCK_N], fp32
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))          # finite: the block holds a live slot
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache + kvh * stride_vh + slots[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        row = (kvh * G + g) * NSPLIT + sp                          # [head, slice]
        tl.store(m_out + row, m, mask=gm)
        tl.store(l_out + row, l_sum, mask=gm)
        tl.store(acc_out + row[:, None] * D + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def _merge_kernel(m_in, l_in, acc_in, gate, out, q8, GATE_STRIDE: tl.constexpr, HAS_GATE: tl.constexpr,
                      D: tl.constexpr, NSPLIT: tl.constexpr, Q8: tl.constexpr, KQ: tl.constexpr, PDL: tl.constexpr,
                      INTERPRETED: tl.constexpr):
        _pdl_enter(PDL)
        h = tl.program_id(0)
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, D)
        m = tl.load(m_in + h * NSPLIT + sp)
        w = tl.exp(m - tl.max(m, axis=0))                          # empty slices: exp(-inf) = 0
        total = tl.sum(tl.load(l_in + h * NSPLIT + sp) * w, axis=0)
        o = tl.sum(tl.load(acc_in + (h * NSPLIT + sp)[:, None] * D + d[None, :]) * w[:, None], axis=0) / total
        if HAS_GATE:
            z = tl.load(gate + h * GATE_STRIDE + d).to(tl.float32)
            o = o / (1.0 + tl.exp(-z))
        tl.store(out + h * D + d, o.to(out.dtype.element_ty))
        if Q8:  # the head's runs as qruns.quantize_input makes them from the stored row (KQ: the row's words)
            _quantize_head(o.to(out.dtype.element_ty), h * (D // 32), D // 32, q8, KQ, INTERPRETED)


def n_splits(max_context: int) -> int:
    """Slices of the live slots: about 512 slots each at the longest context, 4 to 64."""
    return min(64, max(4, next_pow2(cdiv(max_context, 512))))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
           gate: torch.Tensor | None = None, gate_stride: int = 0, int8_out: bool = False):
    """q [H, 1, D] contiguous; caches [KVH, S, D] with contiguous rows; positions [1] on the device
    (slots 0..positions[0] are live); gate: the tensor whose head h starts at h * gate_stride.
    int8_out (D a multiple of 32; for an o_proj that reads qruns.py's int8 words: qruns.reads_int8):
    the merge also writes the output's int8 words, and the output comes as a row carrying them
    (NormedRow.made)."""
    H, _, D = q.shape
    kvh = k_cache.shape[0]
    G = H // kvh
    ns = n_splits(k_cache.shape[1])
    m = torch.empty(H, ns, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(H, ns, D, dtype=torch.float32, device=q.device)
    launch(_split_kernel, (kvh, ns),
           q, k_cache, v_cache, positions, m, l_sum, acc, k_cache.stride(0), v_cache.stride(0),
           D ** -0.5, G=G, GP=max(16, next_pow2(G)), D=D, NSPLIT=ns, BLOCK_N=64, **cuda_base.pdl(q))
    out = torch.empty(1, H * D, dtype=q.dtype, device=q.device)
    q8 = int8_out and D % 32 == 0
    words = qruns.int8_words(H * D, q.device) if q8 else out
    launch(_merge_kernel, (H,), m, l_sum, acc, gate if gate is not None else q, out, words, GATE_STRIDE=gate_stride,
           HAS_GATE=gate is not None, D=D, NSPLIT=ns, Q8=q8, KQ=H * D // 4,
           INTERPRETED=cuda_base.interpreted(), **cuda_base.pdl(q))
    return qruns.carrying(out, words) if q8 else out
