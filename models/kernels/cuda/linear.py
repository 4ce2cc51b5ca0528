"""Triton GEMV for one-token linear layers on CUDA (x [1, K] @ W^T), with SwiGLU fused in.

Contract: `gemv(x, w, bias)` equals F.linear(x, w, bias) for one row, accumulated in fp32 and
rounded once; `gemv(x, w, swiglu=True)` with w = [gate; up] ([2F, K]) returns silu(x W_g^T) *
(x W_u^T), [1, F], in one launch (the torch form: a GEMM and a silu-mul kernel). x may be a
NormedRow: the pending residual add and RMSNorm are then computed in the kernel's prologue (and
the stream written once), as add_norm + F.linear would but for one rounding: the normed row is
not rounded to the input dtype, 1/rms scales the fp32 sums at the end. Each program owns
BLOCK_N output rows and walks K in BLOCK_K steps: no split-K, so no atomics and the same bits
every run. With PDL, a program loads its first weight tile (all of it, for the small weights
read in one K step) before it waits on the previous kernel. Why not cuBLAS: on the one-row
shapes of the benchmark models ours reads the weights faster, small matrices and large
(bench/gemv_sweep.py).
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _input_chunk(x, res, norm_w, sum_out, write, kk, K, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                     EVEN: tl.constexpr):
        """(x[kk] in fp32, and with NORM: (x + res)[kk] * norm_w[kk] (the norm's 1/rms applied to
        the sum at the end) and (x + res)[kk]^2 for the norm's mean square). With HAS_RES the
        sum is rounded as the residual stream is, and written into sum_out where `write`."""
        km = None if EVEN else kk < K
        zero = None if EVEN else 0.0  # (a load without a mask takes no fill value)
        xr = tl.load(x + kk, mask=km, other=zero)
        if NORM:
            if HAS_RES:
                xr = (xr.to(tl.float32) + tl.load(res + kk, mask=km, other=zero).to(tl.float32)).to(xr.dtype)
                tl.store(sum_out + kk, xr, mask=kk < write)  # one program writes the stream
            sf = xr.to(tl.float32)
            return sf * tl.load(norm_w + kk, mask=km, other=zero).to(tl.float32), sf * sf
        return xr.to(tl.float32), xr.to(tl.float32)

    @triton.jit
    def _rows_epilogue(y, y_up, bias, rows, n, nm, out, N, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
        """The quantized GEMVs' last step (fp8.py, qlinear.py): the bias (the up rows' N rows below
        the gate rows'), SwiGLU, the store of the program's real rows. `rows` are the rows read
        (clamped to N - 1), `n` and `nm` the rows stored."""
        if HAS_BIAS:
            y += tl.load(bias + rows).to(tl.float32)
            if SWIGLU:
                y_up += tl.load(bias + rows + N).to(tl.float32)
        if SWIGLU:
            y = y / (1.0 + tl.exp(-y)) * y_up
        tl.store(out + n, y.to(out.dtype.element_ty), mask=nm)

    @triton.jit
    def _gemv_kernel(x, w, bias, out, N, K, stride_w, res, norm_w, sum_out, eps, normed_out, scale,
                     HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                     NORM_OUT: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        if PDL:  # let the next kernel launch now: it prefetches its weights while this one runs
            tl.extra.cuda.gdc_launch_dependents()
        # the first weight tile before waiting on the previous kernel (no kernel writes weights)
        kk = tl.arange(0, BLOCK_K)
        w_rows = w + n[:, None] * stride_w
        m2 = None if EVEN else nm[:, None] & (kk[None, :] < K)  # EVEN: whole blocks, no masks
        zero = None if EVEN else 0.0
        wv = tl.load(w_rows + kk[None, :], mask=m2, other=zero)
        uv = wv
        if SWIGLU:  # the up rows sit N rows below the gate rows
            uv = tl.load(w_rows + N * stride_w + kk[None, :], mask=m2, other=zero)
        if PDL:  # the input row (and anything this kernel writes) follows the previous kernel
            tl.extra.cuda.gdc_wait()
        # NORM (the prologue): one pass over the input, the mean square summed alongside the
        # products, 1/rms applied to the sums at the end (a first pass for it cost every program
        # a round of dependent loads before its first product)
        write = tl.where(pid == 0, K, 0)
        xv, sq = _input_chunk(x, res, norm_w, sum_out, write, kk, K, NORM, HAS_RES, EVEN)
        ss = sq
        acc = wv.to(tl.float32) * xv[None, :]
        acc_up = uv.to(tl.float32) * xv[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kc = k0 + tl.arange(0, BLOCK_K)
            xv, sq = _input_chunk(x, res, norm_w, sum_out, write, kc, K, NORM, HAS_RES, EVEN)
            ss += sq
            mc = None if EVEN else nm[:, None] & (kc[None, :] < K)
            acc += tl.load(w_rows + kc[None, :], mask=mc, other=zero).to(tl.float32) * xv[None, :]
            if SWIGLU:
                acc_up += tl.load(w_rows + N * stride_w + kc[None, :], mask=mc, other=zero).to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            y = y * r
            y_up = y_up * r
            if NORM_OUT:  # program 0 also writes the normed row, as add_rms_norm computes it
                if pid == 0:
                    for k0 in range(0, K, BLOCK_K):
                        kc = k0 + tl.arange(0, BLOCK_K)
                        km = kc < K
                        sf = tl.load(x + kc, mask=km, other=0.0)
                        if HAS_RES:
                            sf = (sf.to(tl.float32) + tl.load(res + kc, mask=km, other=0.0).to(tl.float32)).to(sf.dtype)
                        h = sf.to(tl.float32) * r * tl.load(norm_w + kc, mask=km, other=0.0).to(tl.float32)
                        tl.store(normed_out + kc, h.to(normed_out.dtype.element_ty), mask=km)
        if HAS_BIAS:
            y += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)
        if SWIGLU:
            y = y / (1.0 + tl.exp(-y)) * y_up
        if SCALE:  # `F.linear(...) * scale` as torch rounds it: the output in its dtype, then the product
            y = y.to(out.dtype.element_ty).to(tl.float32) * scale
        tl.store(out + n, y.to(out.dtype.element_ty), mask=None if EVEN else nm)


# Weights up to this size are read in one K step per program, all of it before the kernel waits
# on its predecessor (PDL): the weight loads leave the critical path. Larger ones stream.
WHOLE_K_MAX_BYTES = 32 << 20


def pick_config(K: int, N: int, pair: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [N, K] weight (pair: a SwiGLU pair's N gate rows, and
    as many up rows), from bench/gemv_sweep.py on an H200: few rows per program
    below 4k rows (more programs in flight), more above; an LM head's ~50-250k rows take short K
    steps."""
    whole = next_pow2(K)
    if N * K * 2 * (2 if pair else 1) <= WHOLE_K_MAX_BYTES and whole <= 4096:
        return (4 if N < 4096 else 8), whole, 8
    if N >= 40000:  # K = 2048 (the MoE shapes' heads): faster than (8, 64, 4)
        return (8, 512, 4) if K >= 2048 else (8, 64, 4)
    if N >= 9000:  # K = 2048: faster than (16, 128, 8)
        return (8, 256, 4) if K <= 2048 else (16, 128, 8)
    if N >= 4096:
        return 8, 128, 8
    # Rows too long to read whole, few of them: long K steps (16-byte loads a thread, where steps of
    # 128 gave each thread 4 bytes a load), fewer rows a program below 2,048 rows (more programs).
    # LFM2-1.2B's down [2048, 8192] faster than at (4, 128, 8), Qwen2.5-0.5B's [896, 4864] than at
    # (4, 2048, 8) (bench/gemv_sweep.py --wide).
    return (4, 2048, 8) if N >= 2048 else (2, 4096, 4)


# Weights above this size take their norm from a separate add_rms_norm launch: every program of
# a fused prologue re-reads the input row, which pays only while launches, not bytes, dominate
# (the prologue in every GEMV slowed both hybrid shapes: bench/ab_decode.py's prologueall variant).
PROLOGUE_MAX_BYTES = 32 << 20


# When the GEMV after a materialized norm may launch (add_rms_norm's `early`): once the GEMV before
# the norm has ended ("wait": its first weights load while the norm runs), not when the norm ends
# ("end"): faster in 27B-like FP8 decode, the same tokens (bench/ab_decode.py's normwait / normend).
MATERIALIZE_LAUNCH = "wait"


class NormedRow:
    """A one-token RMSNorm input not computed yet: rms_norm(x + res) * weight, with x + res (the
    residual stream) still to be written into `stream`. The first GEMV that reads it computes
    both in its prologue (or `materialize()` does, in one add_rms_norm launch). res may be None
    (nothing pending: the stream is x). Linear layers take it in place of a tensor. `made`: a
    row computed already, carrying other forms of it (`forms`) that the GEMVs read."""

    def __init__(self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None):
        self.x, self.res, self.weight, self.eps = x, res, weight, eps
        self.out_dtype = out_dtype  # the normed row's dtype where materialized (x's by default)
        self.stream = x if res is None else torch.empty_like(x)
        self.shape, self.dtype, self.device, self.is_cuda = x.shape, x.dtype, x.device, x.is_cuda
        self._h: torch.Tensor | None = None
        self.forms: dict = {}  # other forms of the normed row, made once for the GEMVs that read them (qplanar's int8)

    @classmethod
    def made(cls, row: torch.Tensor, forms: dict) -> "NormedRow":
        """A row computed already (no norm pending: materialize() returns it), carrying other forms
        of it that its launch made too (qruns.py's int8 words, for the runs GEMV that reads it)."""
        made = cls(row, None, row, 0.0)
        made._h, made.forms = row, forms
        return made

    def row_for_prologue(self) -> torch.Tensor | None:
        """Where the normed row is not computed yet: an empty tensor for it, now this row's, for
        the GEMV whose prologue normalizes it to write (gemv's normed_out); else None."""
        if self._h is not None:
            return None
        self._h = torch.empty_like(self.x, dtype=self.out_dtype)
        return self._h

    def materialize(self) -> torch.Tensor:
        """The normed row as a tensor (and the stream written), once."""
        if self._h is None:
            # The next GEMV must not launch as this launch starts (PDL): its programs would launch
            # while the previous GEMV still runs and hold SM slots it needs; a copy of the stream
            # after this launch was one launch more for the same effect (bench/ab_decode.py).
            y = self.res if self.res is not None else torch.zeros_like(self.x)
            _, self._h = cuda_base.add_rms_norm(self.x, y, self.weight, self.eps, early=MATERIALIZE_LAUNCH,
                                                 sum_out=self.stream if self.res is not None else None,
                                                 out_dtype=self.out_dtype)
        return self._h


def row_dtype(x: "torch.Tensor | NormedRow") -> torch.dtype:
    """The dtype of the row a GEMV reads: a NormedRow's normed row's (out_dtype, else x's)."""
    return (x.out_dtype or x.dtype) if isinstance(x, NormedRow) else x.dtype


def gemv_and_row(x: "torch.Tensor | NormedRow", w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(x, w), the input row as a tensor): a NormedRow's normed row written by the GEMV's
    prologue where it runs there (no add_rms_norm launch: an MoE router's GEMV, whose input the
    experts read next), else materialized."""
    if isinstance(x, NormedRow) and w.numel() * w.element_size() <= PROLOGUE_MAX_BYTES:
        h = x.row_for_prologue()
        if h is not None:
            return gemv(x, w, normed_out=h), h
    row = x.materialize() if isinstance(x, NormedRow) else x
    return gemv(row, w), row


def gemv(x: "torch.Tensor | NormedRow", w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
         config: tuple[int, int, int] | None = None, out_dtype: torch.dtype | None = None,
         normed_out: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """x [1, K] contiguous (or a NormedRow of one), any float dtype; w [N, K] with contiguous
    rows. Returns [1, N] (swiglu: [1, N/2]) in out_dtype (x's by default; the LM head: fp32).
    normed_out (gemv_and_row's): where x is a NormedRow normed in this prologue, its row goes there.
    scale: the output times it, with torch's roundings (gemv(...) * scale: the same bits)."""
    N, K = w.shape
    if isinstance(x, NormedRow) and (N * K * w.element_size() > PROLOGUE_MAX_BYTES or
                                     (x._h is not None and normed_out is None)):
        x = x.materialize()
    pre = x if isinstance(x, NormedRow) else None
    src = pre.x if pre is not None else x
    n_out = N // 2 if swiglu else N
    bn, bk, warps = config or pick_config(K, n_out, swiglu)
    out = torch.empty(1, n_out, dtype=out_dtype or src.dtype, device=src.device)
    res = pre.res if pre is not None and pre.res is not None else src
    norm_w, stream, eps = (pre.weight, pre.stream, pre.eps) if pre is not None else (w, src, 0.0)  # unread without NORM
    launch(_gemv_kernel, (cdiv(n_out, bn),),
        src, w, bias if bias is not None else w, out, n_out, K, w.stride(0), res, norm_w, stream, eps,
        normed_out if normed_out is not None and pre is not None else out, 1.0 if scale is None else float(scale),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=pre is not None, HAS_RES=pre is not None and pre.res is not None,
        NORM_OUT=normed_out is not None and pre is not None, EVEN=K % bk == 0 and n_out % bn == 0,
        SCALE=scale is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **cuda_base.pdl(src))
    return out
