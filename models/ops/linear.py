"""Linear ops: a weight times rows. One CUDA row in a half dtype goes through the Triton GEMV (a
deferred norm, NormedRow, runs in its prologue); the quantized linears reach their CUDA forms
through QuantLinear.kernels (set by kernels/cuda/qlinear.py, imported here: quant imports no
kernel). Elsewhere torch's forms run. Shapes: rows [T, K], weight [N, K], out [T, N]."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cuda import base as _base, linear as _linear, qruns as _qruns
from ..kernels.cuda import qlinear  # (imported, it sets QuantLinear.kernels: the quantized linears' CUDA forms)
from .serving import calls

NormedRow = _linear.NormedRow  # one row with its RMSNorm not applied yet: Linear layers take it as a row
gemv = calls(_linear, "gemv")
gemv_and_row = calls(_linear, "gemv_and_row")
row_dtype = calls(_linear, "row_dtype")
reads_int8 = calls(_qruns, "reads_int8")


def quant_fits(fmt: str, k: int, group: int | None) -> bool:
    """The quantized linears' CUDA kernels take a weight of this format, input width and group."""
    return qlinear.fits(fmt, k, group)


def is_row(x) -> bool:
    """x is a NormedRow (a deferred norm that only a GEMV or materialize() computes)."""
    return isinstance(x, NormedRow)


def as_tensor(x: "torch.Tensor | NormedRow") -> torch.Tensor:
    """x as rows: a NormedRow normed now (one launch), a tensor as it is."""
    return x.materialize() if isinstance(x, NormedRow) else x


def gemv_serves(x: "torch.Tensor | NormedRow", dtype: torch.dtype) -> bool:
    """The Triton GEMV takes x against a weight of `dtype`: a NormedRow, or one contiguous CUDA
    row of that dtype where the kernels serve."""
    return isinstance(x, NormedRow) or (_base.usable(x) and x.dtype == dtype and x.is_contiguous())


def dense(x: "torch.Tensor | NormedRow", weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in x's dtype: the Triton GEMV for one CUDA row, F.linear elsewhere."""
    if isinstance(x, NormedRow):
        if x.dtype != weight.dtype:
            return F.linear(x.materialize(), weight, bias)
        return _linear.gemv(x, weight, bias)
    if _base.usable(x) and x.dtype == weight.dtype and x.is_contiguous():
        return _linear.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]: [T, 2N] → [T, N] in gu's dtype. On CUDA one kernel
    (fp32 inside, rounded once); elsewhere torch's two, rounded twice."""
    if _base.prefill_usable(gu) and gu.dim() == 2 and gu.is_contiguous():
        return _base.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_kernel(gu: torch.Tensor) -> torch.Tensor:
    """silu_mul's CUDA kernel, for callers that know it serves (the grouped MoE prefill)."""
    return _base.silu_mul(gu)


def head_gemv_serves(h: "torch.Tensor | NormedRow", dtype: torch.dtype) -> bool:
    """An LM head of `dtype` takes h by the Triton GEMV with fp32 output: a NormedRow, or one row
    on a device and dtype the kernels serve, outside torch.compile."""
    return isinstance(h, NormedRow) or (h.shape[0] == 1 and _base.serves(h.device, dtype)
                                        and not torch.compiler.is_compiling())
