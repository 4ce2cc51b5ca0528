"""Triton kernels for a mixture-of-experts MLP's one-token decode step (CUDA), with no host sync,
and the last step of its grouped prefill.

Contract (tests/kernels/test_moe_kernels.py compares them with the torch forms of
models/architectures/moe.py):
- route(logits, top_k, renormalise): softmax over the router's logits in fp32 and the top k
  (ids and fp32 weights, renormalised to sum 1 where asked), in one program a token (decode's
  one, and prefill's many): the torch form is ~5 kernels (softmax, topk, sum, divide, cast).
  Ties go to the lower expert id.
- experts(x, gate_up, down, idx, weights, ...): sum_k w_k * down_e(silu(gate_e x) * up_e x) over
  the chosen experts e = idx[k], reading only their weights, in two launches: gate/up with SwiGLU
  (one program per expert and block of intermediate rows; the intermediate kept in fp32), then
  down with the weighted sum over the k experts in each program (no atomics: the same bits every
  run; the experts are a dimension of its tiles, so a step loads every expert's columns at once). The shared expert, scaled by sigmoid(its gate), joins both launches as one more expert
  where its size is the experts' (Qwen3-Next, Qwen3.5-MoE), else its output is added in the
  second one's epilogue. The torch form gathers the k experts' weights into a copy first.
- sort_pairs(x, idx, E): the grouped prefill's (token, slot) pairs in expert order as a stable
  argsort leaves them, x's rows copied there (or each row's token), the inverse permutation and
  the experts' row bounds, by a per-block count, a scan and a placement (integer counts: the
  same rows every run).
- combine(ys, inv, weights[, shared, shared_gate]): the grouped prefill's per-token weighted sum
  of its k experts' outputs, read where the grouped GEMM left them (expert order), in slot order:
  no atomics; plus a shared expert's output scaled by sigmoid(its gate's logit) where given.
  combine_add_rms_norm: the same sum with the next residual add and RMSNorm in one launch (the
  bits of combine followed by base.add_rms_norm).
Everything accumulates in fp32 and rounds once to the output dtype. The model's sizes (H, I, k)
are compile-time constants: one compile per model, none per prompt. The expert ids are read on
the device, so the launches are recorded in the CUDA graph like any other.
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    @triton.jit(do_not_specialize=["stride"])
    def _route_kernel(logits, idx_out, w_out, E, stride, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        """One pass of TOP_K (max, lowest id at the max) reductions over a row of logits (a program
        a row); the chosen weights stay in registers until their sum is known (launched with one
        warp: the reductions are shuffles)."""
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        logits += row * stride
        idx_out += row * TOP_K
        w_out += row * TOP_K
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e < E, p, -1.0)
        slots = tl.arange(0, BLOCK_K)
        chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for k in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            i = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # the lowest id among equals
            chosen = tl.where(slots == k, best, chosen)
            ids = tl.where(slots == k, i.to(tl.int64), ids)
            p = tl.where(e == i, -1.0, p)
        if NORM:  # (summed in slot order: the torch form's sum may add in another order, 1e-6 apart)
            total = 0.0
            for k in tl.static_range(TOP_K):
                total += tl.sum(tl.where(slots == k, chosen, 0.0), axis=0)
            chosen = chosen / total
        tl.store(idx_out + slots, ids, mask=slots < TOP_K)
        tl.store(w_out + slots, chosen, mask=slots < TOP_K)

    @triton.jit
    def _combined(ys, inv, weights, shared, gate, t, c, m, H, stride_gate, TOP_K: tl.constexpr,
                  SHARED: tl.constexpr):
        """Token t's weighted sum of its k experts' rows of ys over the columns c, in slot order, in
        fp32 (+ sigmoid(its shared gate's logit) * its shared expert's row): combine's and
        combine_add_rms_norm's one code, so both give the same bits."""
        acc = tl.zeros(c.shape, dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            r = tl.load(inv + t * TOP_K + j)
            acc += tl.load(weights + t * TOP_K + j) * tl.load(ys + r * H + c, mask=m, other=0.0).to(tl.float32)
        if SHARED:  # + sigmoid(the shared expert's gate logit) * its output
            s = tl.sigmoid(tl.load(gate + t * stride_gate).to(tl.float32))
            acc += s * tl.load(shared + t * H + c, mask=m, other=0.0).to(tl.float32)
        return acc

    # t0, the first token (not views of inv, weights, ... at its rows): a view's 16-byte alignment,
    # on which Triton specializes, would follow the prompt's length where k is not a multiple of 4,
    # and compile a variant in the middle of a conversation
    @triton.jit(do_not_specialize=["t0"])
    def _combine_kernel(ys, inv, weights, shared, gate, out, H, stride_gate, t0, TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < H
        acc = _combined(ys, inv, weights, shared, gate, t0 + row, c, m, H, stride_gate, TOP_K, SHARED)
        tl.store(out + row * H + c, acc.to(out.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["t0"])
    def _combine_add_norm_kernel(ys, inv, weights, shared, gate, x, nw_ptr, sum_out, norm_out, eps, stride_gate, t0,
                                 N: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr,
                                 PDL: tl.constexpr):
        """A program a row: the branch as _combine_kernel rounds it, then base._add_rms_norm_kernel's
        steps on (x, branch) in the same order (the stream rounded to its dtype, the norm of the
        rounded stream), so the bits are those of the two launches."""
        c = tl.arange(0, BLOCK)
        m = c < N
        nw = tl.load(nw_ptr + c, mask=m, other=0.0)  # a weight: before the wait
        _pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        acc = _combined(ys, inv, weights, shared, gate, t0 + t, c, m, N, stride_gate, TOP_K, SHARED)
        b = acc.to(ys.dtype.element_ty)
        s = (tl.load(x + t * N + c, mask=m, other=0.0).to(tl.float32) + b.to(tl.float32))
        s = s.to(sum_out.dtype.element_ty)
        tl.store(sum_out + t * N + c, s, mask=m)
        sf = s.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
        out = sf * r * nw.to(tl.float32)
        tl.store(norm_out + t * N + c, out.to(norm_out.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["P"])
    def _count_kernel(idx, hist, P, E, SUB: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        """hist[s, e]: how many of the pairs s SUB .. s SUB + SUB - 1 chose expert e."""
        _pdl_enter(PDL)
        s = tl.program_id(0)
        p = s * SUB + tl.arange(0, SUB)
        ids = tl.load(idx + p, mask=p < P, other=0).to(tl.int32)
        counts = tl.histogram(ids, BLOCK_E, mask=p < P)
        e = tl.arange(0, BLOCK_E)
        tl.store(hist + s * E + e, counts, mask=e < E)

    @triton.jit(do_not_specialize=["nsub"])
    def _scan_kernel(hist, base, starts, offs, nsub, E, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                     PDL: tl.constexpr):
        """A program a block of BLOCK_C experts: base[s, e] = the pairs of sub-blocks before s that
        chose e; starts[e] = the pairs that chose an expert below e (where e's rows begin in expert
        order: the counts of the experts below the block, summed here by each program, plus the
        block's own running sum); offs[e] = starts[e] + e's count (torch._grouped_mm's group ends)."""
        _pdl_enter(PDL)
        c0 = tl.program_id(0) * BLOCK_C
        c = tl.arange(0, BLOCK_C)
        e = c0 + c
        em = e < E
        below = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.int32)
        for b0 in range(0, c0, BLOCK_C):  # (every column here is below c0)
            for s0 in range(0, nsub, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                below += tl.load(hist + s[:, None] * E + (b0 + c)[None, :], mask=(s < nsub)[:, None], other=0)
        start = tl.sum(tl.sum(below, axis=1), axis=0)
        run = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for s0 in range(0, nsub, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            m = (s < nsub)[:, None] & em[None, :]
            h = tl.load(hist + s[:, None] * E + e[None, :], mask=m, other=0)
            tl.store(base + s[:, None] * E + e[None, :], tl.cumsum(h, axis=0) - h + run[None, :], mask=m)
            run += tl.sum(h, axis=0)
        ends = tl.cumsum(run, axis=0) + start
        tl.store(starts + e, ends - run, mask=em)
        tl.store(offs + e, ends, mask=em)

    @triton.jit(do_not_specialize=["P"])
    def _place_kernel(x, idx, base, starts, xs, inv, P, E, stride_x, H: tl.constexpr, TOP_K: tl.constexpr,
                      SUB: tl.constexpr, BLOCK_H: tl.constexpr, COPY: tl.constexpr, PDL: tl.constexpr):
        """Pair p = t TOP_K + j (sub-block s = p // SUB) goes to row starts[e] + base[s, e] + its
        rank among the pairs of s that chose e (a stable sort by expert: ties keep pair order).
        Writes inv[p] and xs[that row] = x[t], BLOCK_H columns a step (COPY), or xs[that row] = t."""
        _pdl_enter(PDL)
        s = tl.program_id(0)
        i = tl.arange(0, SUB)
        p = s * SUB + i
        pm = p < P
        ids = tl.load(idx + p, mask=pm, other=0).to(tl.int32)
        earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        pos = tl.load(starts + ids, mask=pm, other=0) + tl.load(base + s * E + ids, mask=pm, other=0) + rank
        tl.store(inv + p, pos.to(tl.int64), mask=pm)
        if COPY:
            src = x + (p // TOP_K).to(tl.int64)[:, None] * stride_x
            dst = xs + pos.to(tl.int64)[:, None] * H
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                m = pm[:, None] & (h < H)[None, :]
                tl.store(dst + h[None, :], tl.load(src + h[None, :], mask=m), mask=m)
        else:
            tl.store(xs + pos, p // TOP_K, mask=pm)

    @triton.jit
    def _gate_up_kernel(x, w, idx, h, shared_w, stride_e, I: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr,
                        SF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                        PDL: tl.constexpr):
        """Program k < TOP_K: the k-th chosen expert; k >= TOP_K: part k - TOP_K of the shared
        expert (its I gate rows from row (k - TOP_K) I of shared_w [2 SF, H], its up rows SF below:
        a shared expert of SF = S I in S parts of the experts' size, each as one more expert)."""
        k = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        _pdl_enter(PDL)
        if k < TOP_K:
            e = tl.load(idx + k).to(tl.int64)
            rows = w + e * stride_e + n[:, None] * H  # gate rows; the up rows sit I rows below
            up = I * H
        else:
            rows = shared_w + ((k - TOP_K) * I + n[:, None]) * H
            up = SF * H
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, loop_unroll_factor=UNROLL):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < H
            xv = tl.load(x + kk, mask=km, other=0.0).to(tl.float32)
            m = nm[:, None] & km[None, :]
            acc_g += tl.load(rows + kk[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :]
            acc_u += tl.load(rows + up + kk[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :]
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        tl.store(h + k * I + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)

    @triton.jit
    def _down_rows(h, rows, n, nm, I: tl.constexpr, STRIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
        """sum_j rows[n, j] * h[j] for the program's rows (STRIDE apart), j < I, in fp32."""
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, loop_unroll_factor=UNROLL):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < I
            hv = tl.load(h + kk, mask=km, other=0.0)
            wv = tl.load(rows + n[:, None] * STRIDE + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += wv.to(tl.float32) * hv[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _routed_plus_shared(y, shared, n, nm, scale, out):
        """SHARED == 3 (Granite's): (routed + shared) * scale as torch rounds it, from the routed
        sum's fp32 y: the sum in out's dtype, plus the shared MLP's output, rounded, times scale."""
        r = y.to(out.dtype.element_ty).to(tl.float32) + tl.load(shared + n, mask=nm, other=0.0).to(tl.float32)
        return r.to(out.dtype.element_ty).to(tl.float32) * scale

    @triton.jit
    def _down_kernel(h, w, idx, weights, shared, shared_w, shared_gate, out, stride_e, scale, I: tl.constexpr,
                     H: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, SF: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        """SHARED: 0 none; 1 the shared expert's output, times sigmoid(its gate logit); 2 its
        weights, shared_w [H, SF] (SF = S I), as S more experts (h's rows TOP_K ..), times that
        sigmoid; 3 an ungated output added to the rounded routed sum, then times `scale`, each
        rounded (torch's form); 4 the weights as in 2 with weight 1, the whole sum times `scale`."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < H
        _pdl_enter(PDL)
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            e = tl.load(idx + k).to(tl.int64)
            y += tl.load(weights + k) * _down_rows(h + k * I, w + e * stride_e, n, nm, I, I, BLOCK_N, BLOCK_K,
                                                   UNROLL)
        if SHARED == 3:
            y = _routed_plus_shared(y, shared, n, nm, scale, out)
        elif SHARED > 0:
            if SHARED == 1:  # the shared expert's output, computed apart
                s = tl.load(shared + n, mask=nm, other=0.0).to(tl.float32)
            else:  # its parts' intermediates are rows TOP_K .. of h: their down rows here
                s = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for p in tl.static_range(SF // I):
                    s += _down_rows(h + (TOP_K + p) * I, shared_w + p * I, n, nm, I, SF, BLOCK_N, BLOCK_K, UNROLL)
            if SHARED == 4:
                y = (y + s) * scale
            else:
                y += s / (1.0 + tl.exp(-tl.load(shared_gate).to(tl.float32)))
        tl.store(out + n, y.to(out.dtype.element_ty), mask=nm)

    @triton.jit
    def _down_wide_kernel(h, w, idx, weights, shared, shared_w, shared_gate, out, stride_e, scale, I: tl.constexpr,
                          H: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, SF: tl.constexpr,
                          SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """_down_kernel with the experts as one more tile dimension: a step loads BLOCK_K columns of
        the program's rows of every chosen expert (the shared one's parts too where SHARED is 2 or 4) at once,
        so each thread has several 16-byte loads in flight where the expert-by-expert loop had one
        short load (at I = 768, 2 bf16 a thread a step)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < H
        j = tl.arange(0, SLOTS)
        PARTS: tl.constexpr = SHARED == 2 or SHARED == 4
        NS: tl.constexpr = TOP_K + (SF // I if PARTS else 0)
        jm = j < NS
        _pdl_enter(PDL)
        e = tl.load(idx + j, mask=j < TOP_K, other=0).to(tl.int64)
        if PARTS:  # the shared expert's part j - TOP_K: columns (j - TOP_K) I .. of its rows, SF apart
            base = tl.where(j < TOP_K, w + e * stride_e, shared_w + (j - TOP_K) * I)
            row_off = n[None, :, None] * tl.where(j < TOP_K, I, SF)[:, None, None]
        else:
            base = w + e * stride_e
            row_off = n[None, :, None] * I
        acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.static_range(0, I, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < I
            hv = tl.load(h + j[:, None, None] * I + kk[None, None, :], mask=jm[:, None, None] & km[None, None, :],
                         other=0.0)
            m = jm[:, None, None] & nm[None, :, None] & km[None, None, :]
            wv = tl.load(base[:, None, None] + row_off + kk[None, None, :], mask=m, other=0.0)
            acc += wv.to(tl.float32) * hv
        part = tl.sum(acc, axis=2)
        wk = tl.load(weights + j, mask=j < TOP_K, other=0.0)
        if SHARED == 1 or SHARED == 2:
            sg = tl.load(shared_gate).to(tl.float32)
            gate = 1.0 / (1.0 + tl.exp(-sg))
            if SHARED == 2:
                wk = tl.where((j >= TOP_K) & jm, gate, wk)
        if SHARED == 4:
            wk = tl.where((j >= TOP_K) & jm, 1.0, wk)
        y = tl.sum(part * wk[:, None], axis=0)
        if SHARED == 1:
            y += tl.load(shared + n, mask=nm, other=0.0).to(tl.float32) * gate
        elif SHARED == 3:
            y = _routed_plus_shared(y, shared, n, nm, scale, out)
        elif SHARED == 4:
            y = y * scale
        tl.store(out + n, y.to(out.dtype.element_ty), mask=nm)



def combine(ys: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """The last step of the grouped prefill (moe.Experts.grouped): out[t] = sum_j weights[t, j] *
    ys[inv[t k + j]] over j in slot order, in fp32, rounded once. ys [T k, H] contiguous: the
    experts' outputs in expert order; inv [T k] int64: the row of ys holding each (token, slot)
    pair; weights [T, k] fp32. With `shared` [T, H] contiguous (a shared expert's output) and
    shared_gate [T, 1] (its gate's logits, rows of any stride): + sigmoid(shared_gate) * shared,
    in the same sum. Returns [T, H] in ys' dtype; with `first`, the rows of tokens first .. T - 1
    only ([T - first, H]: the last row of a prefill, say). The torch form (scatter back into pair order,
    scale, sum over k; then the shared expert's sigmoid, product and sum) is three launches
    writing the T k rows twice, and three more."""
    T, k = weights.shape
    H = ys.shape[1]
    out = torch.empty(T - first, H, dtype=ys.dtype, device=ys.device)
    block = min(1024, next_pow2(H))
    on = shared is not None
    launch(_combine_kernel, (T - first, cdiv(H, block)), ys, inv, weights, shared.contiguous() if on else ys,
           shared_gate if on else ys, out, H, shared_gate.stride(0) if on else 0, first, TOP_K=k, BLOCK=block,
           SHARED=on, **cuda_base.pdl(ys))
    return out


def combine_add_rms_norm(ys: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float, shared: torch.Tensor | None = None,
                         shared_gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                         first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`combine` and the next residual add and RMSNorm in one launch: b = combine(ys, inv, weights,
    shared, shared_gate) (rounded to ys' dtype, as combine returns it), then base.add_rms_norm(x,
    b, norm_weight, eps, out_dtype=out_dtype)'s (x + b, rms_norm(x + b) * norm_weight), the same
    bits as those two launches (tests/kernels/test_moe_kernels.py). x [T - first, H] contiguous in ys' dtype (the
    rows of tokens first .. T - 1, as combine's `first`); b is never written (the two launches wrote
    and read back T rows)."""
    k = weights.shape[1]
    H = ys.shape[1]
    s, out = torch.empty_like(x), torch.empty_like(x, dtype=out_dtype)
    on = shared is not None
    launch(_combine_add_norm_kernel, (x.shape[0],), ys, inv, weights, shared.contiguous() if on else ys,
           shared_gate if on else ys, x, norm_weight, s, out, eps, shared_gate.stride(0) if on else 0, first, N=H,
           TOP_K=k, BLOCK=next_pow2(H), SHARED=on, **cuda_base.pdl(ys))
    return s, out


def route(logits: torch.Tensor, top_k: int, renormalise: bool,
          E: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, >= E] (any float dtype, rows of unit stride; the first E are the experts') →
    (ids [T, top_k] int64, weights [T, top_k] fp32): a program a token, decode's and prefill's the same."""
    T = logits.shape[0]
    E = E or logits.shape[-1]
    # (inside precompiling() the launch is skipped: ids a host reads, as the experts' loop form
    # and PlanarExperts do, must still be ids)
    idx = (torch.zeros if cuda_base.precompiling_now() else torch.empty)(T, top_k, dtype=torch.int64,
                                                                          device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    launch(_route_kernel, (T,), logits, idx, w, E, logits.stride(0), TOP_K=top_k, BLOCK_E=next_pow2(E),
           BLOCK_K=next_pow2(top_k), NORM=renormalise, num_warps=1, **cuda_base.pdl(logits))
    return idx, w


# Pairs (token, slot) a program of sort_pairs' count and place launches takes: a pair's rank among
# its sub-block's pairs of the same expert is a [SORT_SUB, SORT_SUB] comparison, done once a program
# (128 pairs and a program per 128 columns, 16 comparisons a pair, was slower than torch's gather of
# the rows alone in the 30B-A3B-like 2k prefill: bench/profile_step.py --prefill 2048)
SORT_SUB = 64
# sort_pairs' row copy: columns a step (8 warps; ptxas for sm_90: 186 registers, where 256 columns on
# 4 warps spilled 644 bytes, each element's 64-bit address held)
SORT_COLUMNS = 128
# Experts a program of sort_pairs' scan takes (one program for all of them was slower in a 2k
# prefill at E = 128: bench/profile_step.py --prefill 2048)
SCAN_EXPERTS = 32


def sort_pairs(x: torch.Tensor, idx: torch.Tensor, E: int, copy: bool = True):
    """The grouped prefill's sort (moe.Experts.grouped): x [T, H] (rows of unit stride), idx [T, k]
    int64 contiguous → (xs [T k, H]: x's row of each (token, slot) pair in expert order, ties in
    pair order, as a stable argsort of idx gives; inv [T k] int64: the row of xs holding each pair;
    offs [E] int32: where each expert's rows end, torch._grouped_mm's offsets). Three launches
    (count, scan, place) where the torch form takes ~13 (a radix sort among them); no host sync.
    With copy=False, (src [T k] int32: the token of each row of that order, inv, starts [E] int32:
    where each expert's rows begin, offs), x's rows not copied (grouped.py reads them in place)."""
    T, k = idx.shape
    P, H = T * k, x.shape[1]
    nsub = cdiv(P, SORT_SUB)
    # one allocation, each part at a multiple of 16 bytes (the kernels' pointers specialize on
    # alignment: none may change with the prompt's length)
    a, b = -(-E // 4) * 4, -(-nsub * E // 4) * 4
    ints = (torch.zeros if cuda_base.precompiling_now() else torch.empty)(  # (skipped launches: empty groups)
        2 * a + 2 * b, dtype=torch.int32, device=x.device)
    offs, starts = ints[:E], ints[a:a + E]
    hist, base = ints[2 * a:2 * a + nsub * E], ints[2 * a + b:2 * a + b + nsub * E]
    xs = torch.empty(P, H, dtype=x.dtype, device=x.device) if copy else torch.empty(P, dtype=torch.int32, device=x.device)
    inv = torch.empty(P, dtype=torch.int64, device=x.device)
    pdl = cuda_base.pdl(x)
    block_e = next_pow2(E)
    launch(_count_kernel, (nsub,), idx, hist, P, E, SUB=SORT_SUB, BLOCK_E=block_e, **pdl)
    block_c = min(block_e, SCAN_EXPERTS)
    launch(_scan_kernel, (cdiv(E, block_c),), hist, base, starts, offs, nsub, E, BLOCK_S=128, BLOCK_C=block_c,
           num_warps=4, **pdl)
    launch(_place_kernel, (nsub,), x, idx, base, starts, xs, inv, P, E, x.stride(0), H=H, TOP_K=k, SUB=SORT_SUB,
           BLOCK_H=min(SORT_COLUMNS, next_pow2(H)), COPY=copy, num_warps=8 if copy else 4, **pdl)
    return (xs, inv, offs) if copy else (xs, inv, starts, offs)


def pick_config(H: int, I: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int, bool]]:
    """((rows a program, K a step, num_warps, unroll) of gate/up, the same of down plus whether it
    takes the wide form) for experts of hidden size H and intermediate I. The fastest on an H200
    (bench/moe_sweep.py): gate/up 2 rows x 1024 x 2 warps, the loop unrolled (`--all-unrolled`:
    ahead of 4 x 128 x 8 at the 30B-A3B shape and 4 x 512 x 8 at the 35B-A3B shape). Down in the
    wide form (_down_wide_kernel): 4 rows x 128 x 2 warps where I <= 512, else 8 rows x 128 x 4
    warps (both faster than the best expert-by-expert loop). The wide form unrolls its whole loop
    over I (I / 128 steps, each for every expert): above WIDE_MAX_I, where it was not timed and its
    code would grow with I, down takes the expert-by-expert loop's 4 rows x 128 x 8 warps (its
    best before the wide form)."""
    gate_up = (2, 1024, 2, -(-H // 1024))
    if I <= 512:
        return gate_up, (4, 128, 2, 1, True)
    if I > WIDE_MAX_I:
        return gate_up, (4, 128, 8, 1, False)
    return gate_up, (8, 128, 4, 1, True)


# The largest intermediate size whose down launch takes the wide form (16 unrolled steps)
WIDE_MAX_I = 2048


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
            shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
            shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
            config=None, scale: float = 1.0) -> torch.Tensor:
    """x [1, H]; gate_up [E, 2I, H] (gate rows first), down [E, H, I], both contiguous; idx [1, k]
    int64, weights [1, k] fp32. The shared expert, where there is one: shared_gate [1, 1] (its
    gate's logit) and either its weights, shared_gate_up [2I, H] and shared_down [H, I] (the same
    I, or a multiple S I: it runs as S more programs of each launch), or its output `shared` [1, H].
    Returns [1, H] in x's dtype. Without shared_gate (Granite's shared MLP): `shared`, (routed +
    shared) * scale, rounded as torch rounds those two operations; its weights, (routed + shared) *
    scale summed in fp32 and rounded once. `config`: pick_config's pair by default."""
    gu_config, down_config = config or pick_config(gate_up.shape[2], down.shape[2])
    h = experts_gate_up(x, gate_up, idx, shared_gate_up, gu_config)
    return experts_down(h, down, idx, weights, x.dtype, shared, shared_gate, shared_down, down_config, scale)


def experts_gate_up(x: torch.Tensor, gate_up: torch.Tensor, idx: torch.Tensor,
                    shared_gate_up: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """The first launch of `experts`: h [k (+ S with shared_gate_up), I] fp32, silu(gate) * up of
    each chosen expert, then of the shared expert's S parts (shared_gate_up [2 S I, H], contiguous:
    its gate rows, then its up rows, as stored; part p the rows p I .. of each)."""
    E, I2, H = gate_up.shape
    I, k = I2 // 2, idx.shape[-1]
    block_n, block_k, warps, unroll = config or pick_config(H, I)[0]
    sf = shared_gate_up.shape[0] // 2 if shared_gate_up is not None else I
    assert sf % I == 0, "the shared expert's size: a multiple of the experts'"
    extra = sf // I if shared_gate_up is not None else 0
    h = torch.empty(k + extra, I, dtype=torch.float32, device=x.device)
    launch(_gate_up_kernel, (k + extra, cdiv(I, block_n)), x, gate_up, idx, h,
           shared_gate_up if extra else gate_up, gate_up.stride(0), I=I, H=H, TOP_K=k, SF=sf, BLOCK_N=block_n,
           BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, **cuda_base.pdl(x))
    return h


def experts_down(h: torch.Tensor, down: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                 out_dtype: torch.dtype, shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                 shared_down: torch.Tensor | None = None, config=None, scale: float = 1.0) -> torch.Tensor:
    """The second launch of `experts`: sum_k w_k down_e(h_k) [1, H] in out_dtype, from any h [k, I]
    fp32 (qplanar.experts' too), the shared expert's as `experts` takes it (shared_down [H, S I],
    contiguous: its S parts' intermediates are h's rows k ..; `shared` without shared_gate: added after
    the sum, then `scale`; shared_down without shared_gate: weight 1, the whole sum times `scale`)."""
    E, H, I = down.shape
    k = idx.shape[-1]
    block_n, block_k, warps, unroll, *wide = config or pick_config(H, I)[1]
    gated = shared_gate is not None
    mode = (2 if gated else 4) if shared_down is not None else 0 if shared is None else 1 if gated else 3
    assert mode in (3, 4) or scale == 1.0, "scale: only with an ungated shared expert"
    sf = shared_down.shape[1] if shared_down is not None else I
    out = torch.empty(1, H, dtype=out_dtype, device=h.device)
    plain = shared if mode in (1, 3) else h
    gate = shared_gate if gated else h
    parts = sf // I if mode in (2, 4) else 0
    if wide and wide[0]:
        launch(_down_wide_kernel, (cdiv(H, block_n),), h, down, idx, weights, plain, shared_down if parts else down,
               gate, out, down.stride(0), float(scale), I=I, H=H, TOP_K=k, SHARED=mode, SF=sf,
               SLOTS=next_pow2(k + parts), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **cuda_base.pdl(h))
        return out
    launch(_down_kernel, (cdiv(H, block_n),), h, down, idx, weights, plain, shared_down if parts else down, gate,
           out, down.stride(0), float(scale), I=I, H=H, TOP_K=k, SHARED=mode, SF=sf, BLOCK_N=block_n,
           BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, **cuda_base.pdl(h))
    return out
