"""The gated delta rule in three forms sharing one state layout: naive oracle, chunked, one step.

Shapes (one sequence): q, k [T, H, dk] (already L2-normalised, q scaled by 1/sqrt(dk), key heads
repeated to the H value heads); v [T, H, dv]; g [T, H] log-decay (<= 0); beta [T, H] in (0, 1);
state [H, dk, dv] fp32, read as the initial state and overwritten in place with the final one.
Per step: S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S.  Output [T, H, dv] fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import recurrent as recurrent_ops


def example_inputs(T: int, H: int, dk: int, dv: int, device, seed: int = 6) -> tuple[torch.Tensor, ...]:
    """Random (q, k, v, g, beta, state) in the ranges a layer produces (unit-norm keys, queries
    scaled by 1/sqrt(dk), decays in (0.74, 1], a non-zero state): for tests and benchmarks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(T, H, dk, device=device, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(T, H, dk, device=device, generator=gen), dim=-1)
    v = torch.randn(T, H, dv, device=device, generator=gen)
    g = -torch.rand(T, H, device=device, generator=gen) * 0.3
    beta = torch.rand(T, H, device=device, generator=gen)
    state = torch.randn(H, dk, dv, device=device, generator=gen) * 0.1
    return q, k, v, g, beta, state


def recurrent_naive(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The oracle: one token at a time, exactly the rule above."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = state.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hk,hkv->hv", k[t], S)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    state.copy_(S)
    return out


def step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """T == 1, vectorised, in place (the decode path; graph-safe: no shape-dependent control flow)."""
    q, k, v, g, beta = (x[0].float() for x in (q, k, v, g, beta))
    state.mul_(g.exp()[:, None, None])
    kv_mem = torch.bmm(k[:, None, :], state)[:, 0]                  # [H, dv]: k^T S per head
    delta = (v - kv_mem) * beta[:, None]
    state.baddbmm_(k[:, :, None], delta[:, None, :])                # S += k delta^T, in place
    return torch.bmm(q[:, None, :], state).transpose(0, 1)          # [1, H, dv]: q^T S


def chunk_terms(q, k, v, g, beta, chunk: int) -> tuple[torch.Tensor, ...]:
    """The per-chunk terms of `chunked` in torch (recurrent_ops.scan_prepare computes the same in one
    kernel), fp32: (system [H, n, C, C]: (k_beta k^T) * decay, whose strict lower triangle is A
    of (I + A) u = v_beta; intra [H, n, C, C]: (q k^T) * decay; v_beta [H, n, C, dv]; k_cum:
    k_beta * exp(cum), q_dec: q * exp(cum), k_dec: k * exp(cum_last - cum) [H, n, C, dk];
    chunk_decay [H, n]). The prompt is padded to whole chunks (zero keys, beta 0 and decay
    exp(0) = 1 leave the state untouched). q and k: as `chunked` takes them."""
    H = v.shape[1]
    if q.shape[1] != H:
        q, k = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (q, k))
    T = q.shape[0]
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # [H, T, ...]
    pad = (chunk - T % chunk) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = q.shape[1] // chunk
    q, k, v = (x.reshape(H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)                                                  # [H, n, C]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay                           # causal, diagonal included
    return (system, intra, v_beta, k_beta * cum.exp()[..., None], q * cum.exp()[..., None],
            k * (cum[..., -1:] - cum).exp()[..., None], cum[..., -1].exp())


# Whether a fused prefill takes recurrent_ops.scan_solve (bench/ab_prefill.py's nosolve variants: torch's trsm)
FUSED_SOLVE = True


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64, fused: bool = False) -> torch.Tensor:
    """Prefill: the same rule with the WY/UT transform inside chunks and a scan across them.
    q and k may also come with Hk key heads, Hk dividing H (not repeated yet: value head h reads
    key head h // (H / Hk)). `fused` (CUDA): the chunks' terms in one Triton kernel
    (recurrent_ops.scan_prepare, reading q, k and v where they lie), the triangular solve and its products
    in a second (recurrent_ops.scan_solve, 64-token chunks) and the scan in a third (recurrent_ops.chunk_scan);
    else torch throughout."""
    fused = fused and recurrent_ops.scan_fits(chunk, k.shape[-1], v.shape[-1])
    terms = recurrent_ops.scan_prepare(q, k, v, g.float(), beta.float(), chunk) if fused else \
        chunk_terms(q, k, v, g, beta, chunk)
    return _solve_and_scan(terms, state, q.shape[0], chunk, fused)


def chunked_raw(q, k, v, a, b, neg_a, dt_bias, beta_scale: float, state: torch.Tensor,
                chunk: int = 64) -> torch.Tensor:
    """`chunked`'s fused form (CUDA, where recurrent_ops.scan_fits) from what the layer has before normalising: q, k
    [T, Hk, dk] as the conv left them, a and b its decay and beta projections [T, H], neg_a and
    dt_bias [H] fp32: recurrent_ops.scan_prepare_raw computes l2norm(q) / sqrt(dk), l2norm(k),
    g = neg_a softplus(a + dt_bias) and beta = sigmoid(b) beta_scale inside (qwen3_5.GatedDeltaNet's
    torch form of them: ~10 elementwise kernels a layer)."""
    terms = recurrent_ops.scan_prepare_raw(q, k, v, a, b, neg_a, dt_bias, beta_scale, chunk)
    return _solve_and_scan(terms, state, q.shape[0], chunk, True)


def _solve_and_scan(terms: tuple, state: torch.Tensor, T: int, chunk: int, fused: bool) -> torch.Tensor:
    system, intra, v_beta, k_cum, q_dec, k_dec, chunk_decay = terms
    H = v_beta.shape[0]
    # (I + A) u = v_beta with A strictly lower: the accumulated delta-rule corrections of a chunk
    # (the solver reads only the strict lower triangle; unitriangular supplies the identity).
    # One triangular solve for (I + A)^-1 (C right-hand sides), then two matmuls: a quarter of
    # the solver's work of solving for u and w directly (dk + dv right-hand sides)
    if fused and FUSED_SOLVE and recurrent_ops.scan_solve_fits(chunk):  # the solve and both products in one kernel
        u, w = recurrent_ops.scan_solve(system, v_beta, k_cum)
    else:
        eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
        inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
        u, w = inv @ v_beta, inv @ k_cum
    n = system.shape[1]
    if fused:
        out = recurrent_ops.chunk_scan(u, w, q_dec, k_dec, intra, chunk_decay, state)
        return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1)
    S = state.clone()
    out = torch.empty_like(v_beta)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    state.copy_(S)
    return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1)
