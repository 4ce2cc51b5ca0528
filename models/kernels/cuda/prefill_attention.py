"""Triton causal attention for prefill (CUDA): T new queries over the cached keys up to their own.

Contract: `causal(q, k_cache, v_cache, start)` is softmax(q k^T / sqrt(D)) v for the T queries of
q [H, T, D] at positions start..start+T-1 (`start` an int, or an int64 tensor on the device whose
first element the kernel reads: the prefill's positions, so that a CUDA graph of the launch serves
any start) over slots 0..start+T-1 of the [KVH, S, D] caches (the
new keys and values already written), each query seeing the slots up to its own position (GQA:
query head h reads KV head h // (H / KVH)). Returns [T, H*D] in q's dtype. q may be any strided
view whose rows of D are contiguous (qk_rope_kv_write's [T, H, D] memory); the caches' rows too.
One launch: a program per block of BLOCK_M queries of one head, the latest blocks first (they
have the most keys to walk). Scores and the softmax in fp32 (exp2 of scores scaled by
log2(e) / sqrt(D)); the probabilities meet the values in the input dtype on the tensor cores, as
flash attention's do.

Why our own (bench/prefill_attention_sweep.py times it against both torch forms): torch's flash
kernel is slower on a 2k-token causal prefill on an H200, and a continued prefill (a later turn
over its cached prefix) took the memory-efficient kernel over a mask with the KV heads expanded;
cuDNN's kernel is faster but plans each new length for tens of milliseconds.

Bits: a query's output depends only on its own row, its position and the keys and values up to
it. The keys are walked in blocks of BLOCK_N from slot 0 whatever the query block, the unmasked
and the masked blocks take the same arithmetic, and a block wholly past a query's position
leaves its running max, sum and accumulator exactly as they were (its probabilities are 0 and
the rescale exp2(0) = 1). So a later turn's queries over the cached prefix
give the bits a cold prefill of the whole conversation gives them from the same q, k and v.
"""
from __future__ import annotations

import math

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    @triton.jit
    def _block(qv, k_ptrs, v_ptrs, cols, pos, end, m, l_sum, acc, scale, d_live,
               MASKED: tl.constexpr, D_PAD: tl.constexpr):
        """One block of BLOCK_N keys into the running max, sum and accumulator of each query."""
        if MASKED:
            live = cols < end
            if D_PAD:
                k = tl.load(k_ptrs, mask=d_live[:, None] & live[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=live[None, :], other=0.0)
        else:
            if D_PAD:
                k = tl.load(k_ptrs, mask=d_live[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
        dots = tl.dot(qv, k)                                        # [BLOCK_M, BLOCK_N]
        # exp2(dots * scale - max) as one explicit FMA in both stages: left to the compiler, the
        # unmasked stage's multiply and subtract contract into one and the masked stage's (a
        # select between them) do not, and a query's bits would hang on its block's alignment
        if MASKED:
            seen = cols[None, :] <= pos[:, None]
            m_new = tl.maximum(m, tl.max(tl.where(seen, dots * scale, float("-inf")), axis=1))
            p = tl.where(seen, tl.math.exp2(tl.fma(dots, scale, -m_new[:, None])), 0.0)
        else:
            m_new = tl.maximum(m, tl.max(dots * scale, axis=1))      # finite: key 0 is in every query's first block
            p = tl.math.exp2(tl.fma(dots, scale, -m_new[:, None]))
        alpha = tl.math.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if MASKED:
            if D_PAD:
                v = tl.load(v_ptrs, mask=live[:, None] & d_live[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
        else:
            if D_PAD:
                v = tl.load(v_ptrs, mask=d_live[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_sum, acc

    @triton.jit(do_not_specialize=["T", "start"])
    def _causal_kernel(q, k_cache, v_cache, out, T, start, start_ptr, stride_qh, stride_qt, stride_kh, stride_ks,
                       stride_vh, stride_vs, scale,
                       H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, START_PTR: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        if START_PTR:
            start = tl.load(start_ptr).to(tl.int32)
        mb = tl.cdiv(T, BLOCK_M) - 1 - tl.program_id(0)             # the latest queries first
        h = tl.program_id(1)
        kvh = h // G
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, DP)
        d_live = d < D
        row_live = rows < T
        qv = tl.load(q + h * stride_qh + rows[:, None] * stride_qt + d[None, :],
                     mask=row_live[:, None] & d_live[None, :], other=0.0)
        pos = start + rows
        first = start + mb * BLOCK_M
        end = tl.minimum(first + BLOCK_M, start + T)                # one past the block's last position
        full = (first + 1) // BLOCK_N * BLOCK_N                     # keys below: seen by every query here
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        n = tl.arange(0, BLOCK_N)
        kb = k_cache + kvh * stride_kh + d[:, None]                 # keys read as [DP, BLOCK_N]
        vb = v_cache + kvh * stride_vh + d[None, :]
        for n0 in range(0, full, BLOCK_N):
            cols = n0 + n
            m, l_sum, acc = _block(qv, kb + cols[None, :] * stride_ks, vb + cols[:, None] * stride_vs, cols, pos,
                                   end, m, l_sum, acc, scale, d_live, MASKED=False, D_PAD=DP != D)
        for n0 in range(full, end, BLOCK_N):
            cols = n0 + n
            m, l_sum, acc = _block(qv, kb + cols[None, :] * stride_ks, vb + cols[:, None] * stride_vs, cols, pos,
                                   end, m, l_sum, acc, scale, d_live, MASKED=True, D_PAD=DP != D)
        o = acc / l_sum[:, None]
        tl.store(out + rows[:, None] * (H * D) + h * D + d[None, :], o.to(out.dtype.element_ty),
                 mask=row_live[:, None] & d_live[None, :])


def _padded(head_dim: int) -> int:
    """The head size the kernel's tiles take: a power of two, at least the tensor cores' 16."""
    return max(16, next_pow2(head_dim))


def launch_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the padded head size, from
    bench/prefill_attention_sweep.py on an H200."""
    dp = _padded(head_dim)
    if dp <= 64:
        return 64, 64, 4, 4
    return 64, 64, 4, 3


def causal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: "int | torch.Tensor",
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q [H, T, D] (rows of D contiguous); caches [KVH, S, D] holding slots 0..start+T-1 (rows
    contiguous); start: an int, or an int64 tensor on q's device holding it first (the positions);
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages), launch_config's by default. Returns [T, H*D]."""
    H, T, D = q.shape
    kvh = k_cache.shape[0]
    bm, bn, warps, stages = config or launch_config(D)
    out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
    on_host = not isinstance(start, torch.Tensor)
    launch(_causal_kernel, (cdiv(T, bm), H),
           q, k_cache, v_cache, out, T, start if on_host else 0, q if on_host else start,
           q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
           v_cache.stride(0), v_cache.stride(1), math.log2(math.e) / math.sqrt(D),
           H=H, G=H // kvh, D=D, DP=_padded(D), BLOCK_M=bm, BLOCK_N=bn, START_PTR=not on_host,
           num_warps=warps, num_stages=stages, **cuda_base.pdl(q))
    return out
