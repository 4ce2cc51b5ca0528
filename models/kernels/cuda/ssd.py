"""Triton kernels for Mamba2 (SSD) layers on CUDA: the one-token decode step in three launches and
the chunked prefill's scan across chunks in one.

Contract, decode: `decode(proj, conv_state, conv_weight, conv_bias, ssm_state, A, dt_bias, D,
norm_weight, eps, dt_limit, H, P, N, G)` computes what mamba2.Mamba2Mixer.forward computes for
T == 1 between its input projection and its output projection, and updates both states in place:
- conv_step: the depthwise causal conv (with bias) over [conv window, new column] and SiLU, the
  window shifted by one (one program owns each channel: no two programs touch one state row);
- ssm_step, one program per head: dt = clamp(softplus(dt + dt_bias)), the head's fp32 [P, N]
  state decayed by exp(dt A) plus (dt x) B^T, y = S C + D x, gated by SiLU(z) (mamba2.step);
- group_norm, one program per group: RMSNorm over the group's channels, times the weight.
Everything accumulates in fp32 and rounds once to the output dtype; the torch form rounds between
ops, so the two agree to bf16 rounding (tests/kernels/test_mamba2_kernels.py). The torch form is ~25 launches.

Contract, prefill: `chunk_scan(out, C_dec, chunk_states, chunk_decay, state)` runs exactly the
loop at the end of mamba2.chunked, for every chunk in order, adding each chunk's reads of the
carried state into `out` in place: for i in chunks: out_i += C_dec_i S^T; S = decay_i S + states_i.
Inputs fp32 [H, n, C, P|N], chunk_states [H, n, P, N], chunk_decay [H, n]; `state` [H, P, N] is
read as the initial state and overwritten with the final one. One program owns one head and a
block of P rows (rows of S evolve independently) and keeps its [BP, N] slice in registers.
"""
from __future__ import annotations


import torch

from . import base as cuda_base
from .base import cdiv, fits, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter
    from .delta import _conv_step_kernel  # the conv step, with the bias Mamba2's conv has

    @triton.jit
    def _ssm_step_kernel(act, proj, ssm, A, dt_bias, D, gated, dt_off, dt_lo, dt_hi,
                         INNER: tl.constexpr, G: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                         N: tl.constexpr, PDL: tl.constexpr):
        h = tl.program_id(0)
        g = h // R
        p = tl.arange(0, P)
        n = tl.arange(0, N)
        s_ptr = ssm + h * P * N + p[:, None] * N + n[None, :]
        S = tl.load(s_ptr)
        a, dtb, d = tl.load(A + h), tl.load(dt_bias + h), tl.load(D + h)
        _pdl_enter(PDL)
        x = tl.load(act + h * P + p)
        b = tl.load(act + INNER + g * N + n)
        c = tl.load(act + INNER + G * N + g * N + n)
        dt = tl.load(proj + dt_off + h).to(tl.float32) + dtb
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # softplus, torch's threshold
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        S = S * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        tl.store(s_ptr, S)
        y = tl.sum(S * c[None, :], axis=1) + d * x
        z = tl.load(proj + h * P + p).to(tl.float32)
        tl.store(gated + h * P + p, y * z / (1.0 + tl.exp(-z)))

    @triton.jit
    def _group_norm_kernel(gated, weight, out, eps, GS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        g = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        m = i < GS
        w = tl.load(weight + g * GS + i, mask=m, other=0.0).to(tl.float32)
        _pdl_enter(PDL)
        v = tl.load(gated + g * GS + i, mask=m, other=0.0)
        v = v / tl.sqrt(tl.sum(v * v, axis=0) / GS + eps) * w
        tl.store(out + g * GS + i, v.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _scan_chunk(out, c_dec, chunk_states, chunk_decay, S, chunk, rows, t, k, C: tl.constexpr, P: tl.constexpr,
                    N: tl.constexpr, PREC: tl.constexpr):
        Cd = tl.load(c_dec + chunk * C * N + t[:, None] * N + k[None, :])   # [C, N]
        o_ptrs = out + chunk * C * P + t[:, None] * P + rows[None, :]       # [C, BP]
        tl.store(o_ptrs, tl.load(o_ptrs) + tl.dot(Cd, tl.trans(S), input_precision=PREC))
        return S * tl.load(chunk_decay + chunk) + tl.load(chunk_states + chunk * P * N + rows[:, None] * N + k[None, :])

    @triton.jit(do_not_specialize=["n"])  # one compile for every prompt length (n: its chunks)
    def _chunk_scan_kernel(out, c_dec, chunk_states, chunk_decay, state, n, C: tl.constexpr, P: tl.constexpr,
                           N: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr, INTERPRETED: tl.constexpr):
        h = tl.program_id(0)
        rows = tl.program_id(1) * BP + tl.arange(0, BP)
        t = tl.arange(0, C)
        k = tl.arange(0, N)
        s_ptrs = state + h * P * N + rows[:, None] * N + k[None, :]
        S = tl.load(s_ptrs)                                                   # [BP, N]
        if INTERPRETED:  # Triton 3.6's interpreter cannot run range() over an argument; a while loop it can
            i = 0
            while i < n:
                S = _scan_chunk(out, c_dec, chunk_states, chunk_decay, S, h * n + i, rows, t, k, C, P, N, PREC)
                i += 1
        else:  # the compiled loop, as cuda_scan's
            for i in range(n):
                S = _scan_chunk(out, c_dec, chunk_states, chunk_decay, S, h * n + i, rows, t, k, C, P, N, PREC)
        tl.store(s_ptrs, S)


def decode_fits(head_dim: int, state_size: int) -> bool:
    """The sizes the decode kernels take: head and state sizes powers of two."""
    return triton is not None and fits(head_dim, state_size)


def decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
           ssm_state: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, D: torch.Tensor,
           norm_weight: torch.Tensor, eps: float, dt_limit: tuple[float, float], H: int, P: int, N: int,
           G: int) -> torch.Tensor:
    """proj: the input projection's output [1, inner + conv_dim + H] (z, xBC, dt), contiguous;
    conv_state [conv_dim, K-1] and ssm_state [H, P, N] fp32, both updated in place; conv_weight
    [conv_dim, 1, K]; A, dt_bias, D [H] fp32. Returns the normed, gated output [1, H * P]."""
    inner = H * P
    conv_dim = inner + 2 * G * N
    k = conv_weight.shape[-1]
    act = torch.empty(conv_dim, dtype=torch.float32, device=proj.device)
    block = 256
    opts = cuda_base.pdl(proj)
    launch(_conv_step_kernel, (cdiv(conv_dim, block),), proj[0, inner:], conv_state, conv_weight,
           conv_bias if conv_bias is not None else conv_weight, act, conv_dim, KM1=k - 1,
           KP=next_pow2(k), BLOCK=block, HAS_BIAS=conv_bias is not None, **opts)
    gated = torch.empty(inner, dtype=torch.float32, device=proj.device)
    lo, hi = (min(max(v, -3.0e38), 3.0e38) for v in dt_limit)  # finite: a float argument, not inf
    launch(_ssm_step_kernel, (H,), act, proj, ssm_state, A, dt_bias, D, gated, inner + conv_dim, lo, hi,
           INNER=inner, G=G, R=H // G, P=P, N=N, num_warps=4, **opts)
    out = torch.empty(1, inner, dtype=proj.dtype, device=proj.device)
    gs = inner // G
    launch(_group_norm_kernel, (G,), gated, norm_weight, out, eps, GS=gs, BLOCK=next_pow2(gs),
           num_warps=8, **opts)
    return out


def scan_fits(chunk: int, head_dim: int, state_size: int) -> bool:
    """The sizes the scan kernel takes: powers of two, at least 16 (tensor-core tiles)."""
    return triton is not None and fits(chunk, head_dim, state_size, least=16) and state_size <= 256


def chunk_scan(out: torch.Tensor, c_dec: torch.Tensor, chunk_states: torch.Tensor, chunk_decay: torch.Tensor,
               state: torch.Tensor) -> None:
    H, n, C, P = out.shape
    N = c_dec.shape[-1]
    assert out.is_contiguous() and state.is_contiguous()
    c_dec, chunk_states, chunk_decay = (x.contiguous() for x in (c_dec, chunk_states, chunk_decay))
    BP = min(P, CONFIG["BP"])
    launch(_chunk_scan_kernel, (H, P // BP), out, c_dec, chunk_states, chunk_decay, state, n, C=C, P=P, N=N, BP=BP,
           PREC=CONFIG["precision"], INTERPRETED=cuda_base.interpreted(),
           num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])


# As cuda_scan's gated delta scan (bench/scan_sweep.py): tf32x3 products (fp32-level accuracy on
# tensor cores), one stage; not swept for this kernel on an H200 yet.
CONFIG = {"BP": 32, "num_warps": 4, "num_stages": 1, "precision": "tf32x3"}
