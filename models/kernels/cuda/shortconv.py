"""Triton kernel for an LFM2 short-convolution layer's one-token decode step (CUDA), one launch.

Contract: `decode(bcx, state, weight, bias)` computes what lfm2.ShortConv.forward computes for
T == 1 between its input projection and its output projection, C * conv_step(B * x), and moves
the conv window by one in place (tests/kernels/test_shortconv_kernel.py compares the two; under
TRITON_INTERPRET=1 the same test runs on the CPU). One program owns BLOCK channels, so no two
programs touch the same state row. The product B * x is rounded to the state's dtype once, as
the torch form rounds it; the conv and the output gate accumulate in fp32 and round once. The
torch form's ~10 launches per layer (chunk, two multiplies, the window's shift) become one.
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, next_pow2, triton

if triton is not None:
    import triton.language as tl

    from .base import _pdl_enter

    # The window and weights are read before waiting on the previous kernel (PDL): no kernel of a
    # step writes a layer's conv state but that layer's own step kernel (as in delta.py).
    @triton.jit
    def _short_conv_step_kernel(bcx, state, weight, bias, out, C, KM1: tl.constexpr, KP: tl.constexpr,
                                BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cm = c < C
        j = tl.arange(0, KP)  # window column: 0..K-2 the stored window, K-1 the new input
        w = tl.load(weight + c[:, None] * (KM1 + 1) + j[None, :], mask=cm[:, None] & (j[None, :] <= KM1),
                    other=0.0).to(tl.float32)
        old = tl.load(state + c[:, None] * KM1 + j[None, :], mask=cm[:, None] & (j[None, :] < KM1), other=0.0)
        _pdl_enter(PDL)
        b = tl.load(bcx + c, mask=cm, other=0.0)
        gate = tl.load(bcx + C + c, mask=cm, other=0.0).to(tl.float32)
        x = tl.load(bcx + 2 * C + c, mask=cm, other=0.0)
        new = (b.to(tl.float32) * x.to(tl.float32)).to(old.dtype)  # the torch form's rounded product
        win = tl.where(j[None, :] == KM1, new[:, None].to(tl.float32), old.to(tl.float32))
        y = tl.sum(win * w, axis=1)
        if HAS_BIAS:
            y += tl.load(bias + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(out + c, (gate * y).to(out.dtype.element_ty), mask=cm)
        # the window moves by one: column j takes column j + 1
        shifted = tl.load(state + c[:, None] * KM1 + j[None, :] + 1,
                          mask=cm[:, None] & (j[None, :] + 1 < KM1), other=0.0)
        shifted = tl.where(j[None, :] == KM1 - 1, new[:, None], shifted)
        tl.store(state + c[:, None] * KM1 + j[None, :], shifted, mask=cm[:, None] & (j[None, :] < KM1))


def decode(bcx: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bcx: the input projection's output [1, 3C] (B, C, x), contiguous; state: the window
    [C, K-1], updated in place; weight: [C, K] (any strides of a contiguous [C, 1, K]); bias [C]
    or None. Returns C * conv(B * x) [1, C] in bcx's dtype."""
    C, K = weight.shape[0], weight.shape[-1]
    out = torch.empty(1, C, dtype=bcx.dtype, device=bcx.device)
    block = 256
    launch(_short_conv_step_kernel, (cdiv(C, block),), bcx, state, weight, bias if bias is not None else out,
           out, C, KM1=K - 1, KP=next_pow2(K), BLOCK=block, HAS_BIAS=bias is not None,
           **cuda_base.pdl(bcx))
    return out
