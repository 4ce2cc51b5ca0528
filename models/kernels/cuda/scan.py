"""Triton kernels for the chunked gated delta rule (CUDA prefill): its per-chunk terms (`prepare`,
or `prepare_raw` from the layer's projections before their norms, decay and beta), the triangular
solve inside each chunk (`solve`), the scan across chunks (`chunk_scan`) and the layer's gated
output norm (`gated_norm`).

Contract: `chunk_scan(u, w, q_dec, k_dec, intra, chunk_decay, state)` computes exactly the loop at
the end of gated_delta.chunked, for every chunk in order, in one launch:

    for i in chunks:  v_new = u_i - w_i S;  out_i = q_dec_i S + intra_i v_new;
                      S = chunk_decay_i S + k_dec_i^T v_new

Inputs are fp32 [H, n, C, dk|dv|C] (chunk_decay [H, n]); `state` [H, dk, dv] fp32 is read as the
initial state and overwritten with the final one; returns out [H, n, C, dv] fp32. One program
owns one head and a block of value columns (the columns of S evolve independently) and keeps its
[dk, BV] slice of S in registers across all chunks. Its products run on tensor cores as tf32x3
(each fp32 operand split into a TF32 head and tail: fp32-level accuracy), so it agrees with the
torch loop to ~1e-7 (tests/kernels/test_chunk_scan.py compares them). The torch loop launches ~9 kernels per
chunk: 32 chunks x 18 layers made a 2k-token prefill of the 0.8B-like model launch-bound (and
fp32 CUDA-core products made this kernel's first form slower than that loop: bench/scan_sweep.py);
this is one kernel a layer.
"""
from __future__ import annotations

import torch

from .base import cdiv, fits, launch, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _unit_lower_inverse(A):
        """(I + A)^-1 for a strictly lower [16, 16] A: forward substitution, row i of the inverse
        being e_i minus A's row i times the rows above it (exact fp32 sums)."""
        r = tl.arange(0, 16)
        X = (r[:, None] == r[None, :]).to(tl.float32)
        for i in tl.static_range(1, 16):
            a = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)  # A's row i (zero from column i on)
            row = (r == i).to(tl.float32) - tl.sum(a[:, None] * X, axis=0)
            X = tl.where(r[:, None] == i, row[None, :], X)
        return X

    @triton.jit
    def _block(ptr, a: tl.constexpr, b: tl.constexpr, C: tl.constexpr):
        """Block (a, b) of 16 x 16 of a [C, C] system at ptr (a diagonal one: its strict lower triangle)."""
        r = tl.arange(0, 16)
        t = tl.load(ptr + (16 * a + r)[:, None] * C + 16 * b + r[None, :])
        if a == b:
            t = tl.where(r[:, None] > r[None, :], t, 0.0)
        return t

    @triton.jit
    def _rows(ptr, a: tl.constexpr, n0, N: tl.constexpr, BN: tl.constexpr):
        """Rows 16 a .. 16 a + 15, columns n0 .. n0 + BN - 1, of a [C, N] matrix at ptr."""
        return tl.load(ptr + (16 * a + tl.arange(0, 16))[:, None] * N + n0 + tl.arange(0, BN)[None, :])

    @triton.jit
    def _apply(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, src, dst, N: tl.constexpr, BN: tl.constexpr,
               PREC: tl.constexpr):
        """dst = X src for the block lower-triangular X (16-row blocks) and src [64, N], BN columns a step."""
        r = tl.arange(0, 16)[:, None] * N + tl.arange(0, BN)[None, :]
        for n0 in tl.static_range(0, N, BN):
            s0 = _rows(src, 0, n0, N, BN)
            s1 = _rows(src, 1, n0, N, BN)
            tl.store(dst + n0 + r, tl.dot(X00, s0, input_precision=PREC))
            tl.store(dst + 16 * N + n0 + r, tl.dot(X10, s0, input_precision=PREC)
                     + tl.dot(X11, s1, input_precision=PREC))
            s2 = _rows(src, 2, n0, N, BN)
            tl.store(dst + 32 * N + n0 + r, tl.dot(X20, s0, input_precision=PREC)
                     + tl.dot(X21, s1, input_precision=PREC) + tl.dot(X22, s2, input_precision=PREC))
            s3 = _rows(src, 3, n0, N, BN)
            tl.store(dst + 48 * N + n0 + r, tl.dot(X30, s0, input_precision=PREC)
                     + tl.dot(X31, s1, input_precision=PREC) + tl.dot(X32, s2, input_precision=PREC)
                     + tl.dot(X33, s3, input_precision=PREC))

    @triton.jit
    def _solve_kernel(system, v_beta, k_cum, u, w, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BN: tl.constexpr, PREC: tl.constexpr):
        """One chunk's (I + A)^-1 (A: system's strict lower triangle, C = 64 in 16-row blocks) by
        block forward substitution, then u = (I + A)^-1 v_beta and w = (I + A)^-1 k_cum."""
        c = tl.program_id(0).to(tl.int64)
        sp = system + c * C * C
        D0 = _unit_lower_inverse(_block(sp, 0, 0, C))
        D1 = _unit_lower_inverse(_block(sp, 1, 1, C))
        D2 = _unit_lower_inverse(_block(sp, 2, 2, C))
        D3 = _unit_lower_inverse(_block(sp, 3, 3, C))
        A10, A21, A32 = _block(sp, 1, 0, C), _block(sp, 2, 1, C), _block(sp, 3, 2, C)
        # below the diagonal: X_kl = -D_k (sum over l <= m < k of A_km X_ml), X_ll = D_l
        X10 = -tl.dot(D1, tl.dot(A10, D0, input_precision=PREC), input_precision=PREC)
        X21 = -tl.dot(D2, tl.dot(A21, D1, input_precision=PREC), input_precision=PREC)
        X32 = -tl.dot(D3, tl.dot(A32, D2, input_precision=PREC), input_precision=PREC)
        A20, A31 = _block(sp, 2, 0, C), _block(sp, 3, 1, C)
        X20 = -tl.dot(D2, tl.dot(A20, D0, input_precision=PREC) + tl.dot(A21, X10, input_precision=PREC),
                      input_precision=PREC)
        X31 = -tl.dot(D3, tl.dot(A31, D1, input_precision=PREC) + tl.dot(A32, X21, input_precision=PREC),
                      input_precision=PREC)
        A30 = _block(sp, 3, 0, C)
        X30 = -tl.dot(D3, tl.dot(A30, D0, input_precision=PREC) + tl.dot(A31, X10, input_precision=PREC)
                      + tl.dot(A32, X20, input_precision=PREC), input_precision=PREC)
        _apply(D0, X10, D1, X20, X21, D2, X30, X31, X32, D3, v_beta + c * C * DV, u + c * C * DV, DV, min(BN, DV), PREC)
        _apply(D0, X10, D1, X20, X21, D2, X30, X31, X32, D3, k_cum + c * C * DK, w + c * C * DK, DK, min(BN, DK), PREC)

    @triton.jit(do_not_specialize=["n"])  # one compile for every prompt length (n: its chunks)
    def _chunk_scan_kernel(u, w, q_dec, k_dec, intra, chunk_decay, state, out, n,
                           C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                           PREC: tl.constexpr):
        h = tl.program_id(0)
        col = tl.program_id(1) * BV + tl.arange(0, BV)
        rows = tl.arange(0, C)
        dk = tl.arange(0, DK)
        s_ptrs = state + h * DK * DV + dk[:, None] * DV + col[None, :]
        S = tl.load(s_ptrs)                                                   # [DK, BV]
        for i in range(n):
            chunk = h * n + i
            kd_off = chunk * C * DK + rows[:, None] * DK + dk[None, :]        # [C, DK] tiles
            v_off = chunk * C * DV + rows[:, None] * DV + col[None, :]        # [C, BV] tiles
            W = tl.load(w + kd_off)
            v_new = tl.load(u + v_off) - tl.dot(W, S, input_precision=PREC)
            Q = tl.load(q_dec + kd_off)
            A = tl.load(intra + chunk * C * C + rows[:, None] * C + rows[None, :])
            o = tl.dot(Q, S, input_precision=PREC) + tl.dot(A, v_new, input_precision=PREC)
            tl.store(out + v_off, o)
            K = tl.load(k_dec + kd_off)
            S = S * tl.load(chunk_decay + chunk) + tl.dot(tl.trans(K), v_new, input_precision=PREC)
        tl.store(s_ptrs, S)


    @triton.jit(do_not_specialize=["T"])
    def _chunk_prep_kernel(q, k, v, g, beta, system, intra, v_beta, k_cum, q_dec, k_dec, chunk_decay, T,
                           stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                           stride_vd, stride_g, stride_b, neg_a, dt_bias, beta_scale, q_scale, eps,
                           H: tl.constexpr, HPK: tl.constexpr, C: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr):
        """One program a (value head, chunk). RAW: q and k as the conv left them (each row
        l2-normalised here, q also scaled by q_scale), g and beta from the layer's a and b
        projections (g = neg_a softplus(a + dt_bias), beta = sigmoid(b) beta_scale); else q, k
        normalised and g, beta given."""
        h = tl.program_id(0)
        i = tl.program_id(1)
        n = tl.num_programs(1)
        hk = (h // HPK).to(tl.int64)  # the key head this value head reads (64-bit: a conv's transposed
        h64 = h.to(tl.int64)  # output puts the heads T dk apart)
        rows = tl.arange(0, C)
        t = i * C + rows
        tm = t < T  # rows past the prompt: zero keys, beta 0, decay 1 (gated_delta.chunked's padding)
        dk = tl.arange(0, DK)
        dv = tl.arange(0, DV)
        t64 = t.to(tl.int64)
        # (the feature strides: 1 where the layer's tensors lie as it writes them, which Triton
        # specializes on; a torch conv's transposed output leaves v's at T)
        Q = tl.load(q + t64[:, None] * stride_qt + hk * stride_qh + dk[None, :] * stride_qd, mask=tm[:, None],
                    other=0.0)
        K = tl.load(k + t64[:, None] * stride_kt + hk * stride_kh + dk[None, :] * stride_kd, mask=tm[:, None],
                    other=0.0)
        V = tl.load(v + t64[:, None] * stride_vt + h64 * stride_vh + dv[None, :] * stride_vd, mask=tm[:, None],
                    other=0.0)
        Q, K, V = Q.to(tl.float32), K.to(tl.float32), V.to(tl.float32)
        gg = tl.load(g + t64 * stride_g + h, mask=tm, other=0.0).to(tl.float32)
        bb = tl.load(beta + t64 * stride_b + h, mask=tm, other=0.0).to(tl.float32)
        if RAW:  # (the layer's torch form: rms_norm with eps / dk and weight q_scale / sqrt(dk): the same)
            Q = Q * (tl.rsqrt(tl.sum(Q * Q, axis=1) + eps) * q_scale)[:, None]
            K = K * tl.rsqrt(tl.sum(K * K, axis=1) + eps)[:, None]
            gg = gg + tl.load(dt_bias + h)
            gg = tl.load(neg_a + h) * tl.where(gg > 20.0, gg, tl.log(1.0 + tl.exp(gg)))  # torch's softplus
            # rows past the prompt: decay exp(0) = 1 and beta 0, as the given forms' padding
            gg = tl.where(tm, gg, 0.0)
            bb = tl.where(tm, tl.sigmoid(bb) * beta_scale, 0.0)
        cum = tl.cumsum(gg, axis=0)
        last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
        decay = tl.where(rows[:, None] >= rows[None, :], tl.exp(cum[:, None] - cum[None, :]), 0.0)
        Kb = K * bb[:, None]
        A = tl.dot(Kb, tl.trans(K), input_precision=PREC) * decay
        S = tl.dot(Q, tl.trans(K), input_precision=PREC) * decay
        chunk = h * n + i
        cc = chunk * C * C + rows[:, None] * C + rows[None, :]
        tl.store(system + cc, A)
        tl.store(intra + cc, S)
        kd = chunk * C * DK + rows[:, None] * DK + dk[None, :]
        ec = tl.exp(cum)
        tl.store(k_cum + kd, Kb * ec[:, None])
        tl.store(q_dec + kd, Q * ec[:, None])
        tl.store(k_dec + kd, K * tl.exp(last - cum)[:, None])
        tl.store(v_beta + chunk * C * DV + rows[:, None] * DV + dv[None, :], V * bb[:, None])
        tl.store(chunk_decay + chunk, tl.exp(last))

    @triton.jit(do_not_specialize=["T"])
    def _gated_norm_kernel(o, z, w, out, T, stride_ot, stride_oh, stride_zt, stride_zh, eps,
                           H: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr):
        """BT rows of one head: RMSNorm(o) w SiLU(z) in fp32, rounded once."""
        t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, DV)
        m = (t < T)[:, None]
        x = tl.load(o + t[:, None] * stride_ot + h * stride_oh + d[None, :], mask=m, other=0.0).to(tl.float32)
        zz = tl.load(z + t[:, None] * stride_zt + h * stride_zh + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=1) / DV + eps)[:, None] * tl.load(w + d).to(tl.float32)[None, :]
        tl.store(out + t[:, None] * (H * DV) + h * DV + d[None, :], (y * zz * tl.sigmoid(zz)).to(out.dtype.element_ty),
                 mask=m)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk: int) -> tuple[torch.Tensor, ...]:
    """gated_delta.chunked's per-chunk terms in one launch, from the layer's tensors as they lie
    (any strides): q, k [T, Hk, dk] (normalised; Hk divides H: value head h reads key head
    h // (H / Hk), no repeated copy), v [T, H, dv] (any float dtype), g, beta [T, H] fp32.
    Returns fp32 (system [H, n, C, C]: (k_beta k^T) * decay, the triangular solve's matrix; intra [H, n, C, C]: (q k^T) * decay; v_beta [H, n, C, dv]; k_cum: k_beta * exp(cum)
    and q_dec: q * exp(cum), k_dec: k * exp(cum_last - cum) [H, n, C, dk]; chunk_decay [H, n])
    for chunk_scan, after the solve. The torch form: ~25 elementwise kernels and copies a layer."""
    g, beta = g.contiguous(), beta.contiguous()
    return _prepare(q, k, v, g, beta, (g.shape[1], beta.shape[1], g, g, 1.0, 1.0, 0.0), False, chunk)


def prepare_raw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                neg_a: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, chunk: int,
                eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """prepare's terms from what the Gated DeltaNet layer has before its torch form's ~10
    elementwise kernels: q, k [T, Hk, dk] not normalised yet (the conv's output, any strides),
    a, b [T, H] (its projections, rows of any stride, unit column stride, any float dtype),
    neg_a = -exp(A_log) and dt_bias [H] fp32. Inside: q = l2norm(q) / sqrt(dk), k = l2norm(k)
    (eps as qwen3_5.l2norm_scaled's), g = neg_a softplus(a + dt_bias), beta = sigmoid(b) beta_scale."""
    assert a.stride(-1) == 1 and b.stride(-1) == 1
    extra = (a.stride(0), b.stride(0), neg_a, dt_bias, float(beta_scale), q.shape[-1] ** -0.5, float(eps))
    return _prepare(q, k, v, a, b, extra, True, chunk)


def _prepare(q, k, v, g, beta, extra: tuple, raw: bool, chunk: int) -> tuple[torch.Tensor, ...]:
    T, Hk, DK = q.shape
    H, DV = v.shape[1], v.shape[2]
    n = cdiv(T, chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    system, intra = torch.empty(H, n, chunk, chunk, **f32), torch.empty(H, n, chunk, chunk, **f32)
    v_beta = torch.empty(H, n, chunk, DV, **f32)
    k_cum, q_dec, k_dec = (torch.empty(H, n, chunk, DK, **f32) for _ in range(3))
    chunk_decay = torch.empty(H, n, **f32)
    launch(_chunk_prep_kernel, (H, n), q, k, v, g, beta, system, intra, v_beta, k_cum, q_dec, k_dec, chunk_decay,
           T, *q.stride(), *k.stride(), *v.stride(), *extra, H=H, HPK=H // Hk, C=chunk, DK=DK, DV=DV,
           PREC=CONFIG["precision"], RAW=raw)
    return system, intra, v_beta, k_cum, q_dec, k_dec, chunk_decay


def solve(system: torch.Tensor, v_beta: torch.Tensor, k_cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta.chunked's triangular solve and its two products in one launch (a program a
    chunk): u = (I + A)^-1 v_beta and w = (I + A)^-1 k_cum, A the strict lower triangle of each
    [64, 64] chunk of system [H, n, 64, 64] (prepare's terms, contiguous fp32). The torch form is
    a batched triangular solve against the identity (cuBLAS's trsm) and two fp32 GEMMs."""
    H, n, C, _ = system.shape
    DV, DK = v_beta.shape[-1], k_cum.shape[-1]
    u, w = torch.empty_like(v_beta), torch.empty_like(k_cum)
    # (32 columns a product, 4 warps: ptxas for sm_90 237 registers at dk = dv = 128 and 256, no spill;
    # whole 128-column rows spilled 100 bytes)
    launch(_solve_kernel, (H * n,), system, v_beta, k_cum, u, w, C=C, DK=DK, DV=DV, BN=32, PREC=CONFIG["precision"],
           num_warps=4)
    return u, w


def solve_fits(chunk: int) -> bool:
    """solve's chunk: 64 rows (four 16-row blocks)."""
    return triton is not None and chunk == 64


def scan_fits(chunk: int, dk: int, dv: int) -> bool:
    """The sizes the kernel takes: powers of two, at least 16 (tensor-core tiles), dv >= the block."""
    return triton is not None and fits(chunk, dk, dv, least=16) and dk <= 256


def chunk_scan(u: torch.Tensor, w: torch.Tensor, q_dec: torch.Tensor, k_dec: torch.Tensor, intra: torch.Tensor,
               chunk_decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    H, n, C, DK = w.shape
    DV = u.shape[-1]
    u, w, q_dec, k_dec, intra = (x.contiguous() for x in (u, w, q_dec, k_dec, intra))
    chunk_decay = chunk_decay.reshape(H, n).contiguous()
    out = torch.empty_like(u)
    BV, warps, stages = min(DV, CONFIG["BV"]), CONFIG["num_warps"], CONFIG["num_stages"]
    launch(_chunk_scan_kernel, (H, DV // BV), u, w, q_dec, k_dec, intra, chunk_decay, state, out, n,
           C=C, DK=DK, DV=DV, BV=BV, PREC=CONFIG["precision"], num_warps=warps, num_stages=stages)
    return out


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet's output norm (qwen3_5.GatedRMSNorm: RMSNorm(o) weight SiLU(z)) over
    o [T, H, dv] fp32 as the scan leaves it (any strides, unit feature stride) and z [T, H, dv]
    (the layer's projection, rows of any stride), in one launch: fp32 inside, one rounding to z's
    dtype. Returns [T, H * dv] contiguous, out_proj's input. The torch form rounds o to z's dtype
    first and runs three kernels besides that copy."""
    T, H, DV = o.shape
    assert o.stride(-1) == 1 and z.stride(-1) == 1 and z.shape == o.shape
    out = torch.empty(T, H * DV, dtype=z.dtype, device=z.device)
    bt = max(1, min(16, 2048 // DV))
    launch(_gated_norm_kernel, (cdiv(T, bt), H), o, z, weight, out, T, o.stride(0), o.stride(1), z.stride(0),
           z.stride(1), float(eps), H=H, DV=DV, BT=bt)
    return out


# The fastest of a sweep on an H200 (bench/scan_sweep.py). tf32x3 (three TF32 products, the
# rounding of each corrected) matched the torch loop at fp32-level accuracy and beat the
# fp32-exact "ieee" dots; plain TF32 and more stages overflow shared memory; 8 warps at BV 16
# faulted (a Triton miscompile).
CONFIG = {"BV": 32, "num_warps": 4, "num_stages": 1, "precision": "tf32x3"}
