"""A packed token bitmask applied to a row of logits on CUDA, in one kernel.

`masked_logits(logits, words, out)`: out[i] = logits[i] where bit i % 32 of int32 word i // 32 is
set, else -inf, for every i < logits.numel() (words may hold more bits than the vocabulary has
tokens). `masked_logits_torch` is the same in torch ops (the oracle, and the form where Triton is
absent or off): six kernels where this is one, which on an H200 decoding a small model is most of
what a constrained token costs over a free one (bench/constrained_bench.py --device cuda).
"""
from __future__ import annotations

import torch

from . import base as cuda_base
from .base import cdiv, launch, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _masked_logits_kernel(logits, words, out, V, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        w = tl.load(words + offs // 32, mask=inside, other=0)
        allowed = ((w >> (offs % 32)) & 1) != 0
        x = tl.load(logits + offs, mask=inside, other=0.0)
        tl.store(out + offs, tl.where(allowed, x, float("-inf")), mask=inside)

_BLOCK = 1024
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def masked_logits_torch(logits: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(32, dtype=torch.int32, device=words.device)
    n = logits.numel()
    allowed = ((words.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n] != 0
    torch.where(allowed, logits.reshape(-1), torch.full((), float("-inf"), device=logits.device,
                                                        dtype=logits.dtype), out=out.reshape(-1))
    return out


def masked_logits(logits: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """logits and out: contiguous, same shape and dtype, on CUDA; words: int32 on the same device."""
    if not (cuda_base.ENABLED and logits.is_cuda and logits.is_contiguous() and out.is_contiguous()):
        return masked_logits_torch(logits, words, out)
    n = logits.numel()
    launch(_masked_logits_kernel, (cdiv(n, _BLOCK),), logits, words, out, n, BLOCK=_BLOCK)
    return out
