"""The ops on a step's logits that the engine's sampler runs: a constraint's allowed tokens
applied on the device (`masked_logits(logits, words, out)`: out[i] = logits[i] where bit i % 32 of
int32 word i // 32 is set, else -inf; the kernel's docstring states it, its torch form where Triton
is off)."""
from __future__ import annotations

from ..kernels.cuda import bitmask as _bitmask
from .serving import calls

__all__ = ["masked_logits"]

masked_logits = calls(_bitmask, "masked_logits")
