"""Triton kernels for the CUDA decode step (one token), where torch would launch several kernels.

Contract: each function computes what its torch form computes, in fp32 inside and one rounding to
the output dtype (torch's forms round between ops, so results agree to bf16 rounding, and
tests/test_gpu.py compares them). They are used only for one-token forwards on CUDA, so the eager
step and the CUDA graph that records it run the same kernels; the CPU, prefill and machines
without Triton use the torch forms. `CHAT_TRITON=0` turns them off.
- rope_kv_write: RoPE over the query and key heads of the fused QKV output, keys and values
  written into the caches at the position read from the device (5 kernels → 1);
- add_rms_norm: the residual add and the next RMSNorm (2 → 1);
- silu_mul: SwiGLU's silu(gate) * up (2 → 1).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch forms run instead
    triton = None

ENABLED = triton is not None and os.environ.get("CHAT_TRITON", "1").lower() not in ("0", "false", "off", "no")


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this forward: one token, on CUDA, Triton present and on, and
    not inside torch.compile (Inductor fuses the torch forms itself, and further than these: with
    them as opaque calls the compiled SmolLM2 step measured 977 tok/s against 1,090 without)."""
    return ENABLED and x.is_cuda and x.shape[0] == 1 and not torch.compiler.is_compiling()


if triton is not None:
    @triton.jit
    def _rope_kv_kernel(qkv, cos, sin, pos_ptr, q_out, k_cache, v_cache, stride_kh, stride_vh,
                        H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
        head = tl.program_id(0)
        d = tl.arange(0, D)
        x = tl.load(qkv + head * D + d).to(tl.float32)
        pos = tl.load(pos_ptr)
        if head < H + KVH:
            rolled = tl.load(qkv + head * D + (d + D // 2) % D).to(tl.float32)
            y = x * tl.load(cos + d).to(tl.float32) + rolled * tl.load(sin + d).to(tl.float32)
            if head < H:
                tl.store(q_out + head * D + d, y.to(q_out.dtype.element_ty))
            else:
                tl.store(k_cache + (head - H) * stride_kh + pos * D + d, y.to(k_cache.dtype.element_ty))
        else:
            tl.store(v_cache + (head - H - KVH) * stride_vh + pos * D + d, x.to(v_cache.dtype.element_ty))

    @triton.jit
    def _add_rms_norm_kernel(x, y, w, sum_out, norm_out, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        s = (tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
             + tl.load(y + offs, mask=mask, other=0.0).to(tl.float32))
        s = s.to(sum_out.dtype.element_ty)  # the residual stream keeps its dtype, as `x + y` would
        tl.store(sum_out + offs, s, mask=mask)
        sf = s.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
        out = sf * r * tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(norm_out + offs, out.to(norm_out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu, out, N: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu + N + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + offs, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=mask)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """qkv: [1, (H + 2 KVH) * D] contiguous; cos, sin: [1, D] from Rope.cos_sin (signed sin);
    caches [KVH, S, D] with contiguous rows. Returns q [H, 1, D]; writes k and v at positions[0]."""
    D = k_cache.shape[-1]
    q = torch.empty(n_heads, 1, D, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(n_heads + 2 * n_kv,)](qkv, cos, sin, positions, q, k_cache, v_cache,
                                           k_cache.stride(0), v_cache.stride(0), H=n_heads, KVH=n_kv, D=D)
    return q


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) for one row."""
    n = x.shape[-1]
    s, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(1,)](x, y, weight, s, out, eps, N=n, BLOCK=triton.next_power_of_2(n))
    return s, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[1, 2F] (gate then up) → silu(gate) * up, [1, F]."""
    f = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(triton.cdiv(f, block),)](gate_up, out, N=f, BLOCK=block)
    return out
