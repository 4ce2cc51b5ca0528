"""Linear ops: a weight times rows. One CUDA row in a half dtype goes through the Triton GEMV (a
deferred norm, NormedRow, runs in its prologue); the quantized linears reach their CUDA forms
through their bound forms (models/ops/quant.py: quant imports no kernel). Elsewhere torch's
forms run. Which form serves a call is the planner's rule
(models/plan/serving.py). Shapes: rows [T, K], weight [N, K], out [T, N]."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cuda import base as _base, linear as _linear
from ..plan.serving import gemv_serves, head_gemv_serves, quant_fits, reads_int8, silu_mul_serves
from .serving import calls

__all__ = ["NormedRow", "as_tensor", "dense", "gemv", "gemv_and_row", "gemv_serves", "head_gemv_serves", "is_row",
           "quant_fits", "reads_int8", "row_dtype", "silu_mul", "silu_mul_kernel"]

NormedRow = _linear.NormedRow  # one row with its RMSNorm not applied yet: Linear layers take it as a row
gemv = calls(_linear, "gemv")
gemv_and_row = calls(_linear, "gemv_and_row")
row_dtype = calls(_linear, "row_dtype")
silu_mul_kernel = calls(_base, "silu_mul")  # (for callers that know it serves: the grouped MoE prefill)


def is_row(x) -> bool:
    """x is a NormedRow (a deferred norm that only a GEMV or materialize() computes)."""
    return isinstance(x, NormedRow)


def as_tensor(x: "torch.Tensor | NormedRow") -> torch.Tensor:
    """x as rows: a NormedRow normed now (one launch), a tensor as it is."""
    return x.materialize() if isinstance(x, NormedRow) else x


def dense(x: "torch.Tensor | NormedRow", weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in x's dtype: the Triton GEMV where it serves, F.linear elsewhere (a
    NormedRow of another dtype than the weight's normed first)."""
    if gemv_serves(x, weight.dtype) and x.dtype == weight.dtype:
        return gemv(x, weight, bias)
    return F.linear(as_tensor(x), weight, bias)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]: [T, 2N] → [T, N] in gu's dtype. On CUDA one kernel
    (fp32 inside, rounded once); elsewhere torch's two, rounded twice."""
    if silu_mul_serves(gu):
        return silu_mul_kernel(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up
