"""The CUDA forms of the quantized modules (models/quant: GGUF blocks and their repacked layouts,
FP8, AWQ/GPTQ groups): a QuantLinear's rows through the dequant-GEMV (one row, or a NormedRow:
its norm in the GEMV's prologue) or, for more rows, the kernels' matmul where it takes the format
(FP8 on Hopper: the FP8 tensor cores) or chunks of rows dequantized by a kernel to the compute
dtype and torch's GEMM; a fused [gate; up] linear's SwiGLU in one GEMV launch; rows of a planar
expert half or of an embedding table dequantized.

A module reaches these through its `forms` attribute (FORMS), which the planner binds on each
module of a CUDA plan (models/plan: `bind`, or `bind_forms` for a module built by hand); quant imports no
kernel. Whether a form serves a call is the planner's rule (models/plan/serving.py: quant_serves,
quant_tensor_serves); where none does, the module's torch form, the oracle, runs."""
from __future__ import annotations

import torch

from ..kernels.cuda import qlinear as _qlinear
from ..plan.serving import quant_serves, quant_tensor_serves
from .serving import calls

__all__ = ["FORMS", "Forms", "dequantized", "dequantized_rows", "forward", "serves", "swiglu"]

_gemv = calls(_qlinear, "gemv")
_matmul = calls(_qlinear, "matmul")
_dequantize = calls(_qlinear, "dequantize")
_dequantize_rows = calls(_qlinear, "dequantize_rows")

# Elements of a weight dequantized at once for a multi-row product: the chunk bounds the
# transient copy of a large matrix (an LM head) at a few hundred MiB.
DEQUANT_ELEMENTS = 256 << 20


def serves(m, x) -> bool:
    """Whether `forward` takes rows x of the QuantLinear m: its format and row length among the
    kernels', and x rows on CUDA they serve (a NormedRow always is one)."""
    qw = m.qweight()
    return quant_serves(qw.fmt, m.in_features, qw.group, x)


def forward(m, x, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """m(x) on CUDA, in out_dtype (x's by default; an LM head asks for fp32 sums)."""
    qw = m.qweight()
    if not isinstance(x, torch.Tensor):  # a NormedRow: the norm in the GEMV's prologue
        return _gemv(x, qw, m.bias, out_dtype=out_dtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, m.in_features)
    if x2.shape[0] == 1:
        y = _gemv(x2.contiguous(), qw, m.bias, out_dtype=out_dtype)
    else:
        dtype = out_dtype if out_dtype == torch.float32 else x2.dtype  # (fp32 sums for the head)
        x2 = x2.to(dtype)
        y = _matmul(x2, qw, dtype)
        if y is None:
            y = _dequantized_matmul(m, x2, qw, dtype)
        if m.bias is not None:
            y = y + m.bias.to(dtype)
        y = y.to(out_dtype or x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], m.out_features)


def _dequantized_matmul(m, x2: torch.Tensor, qw, dtype: torch.dtype) -> torch.Tensor:
    """x2 @ W^T: W dequantized to `dtype` by the kernels in chunks of rows, then torch's GEMM."""
    rows = max(64, DEQUANT_ELEMENTS // m.in_features)
    if rows >= m.out_features:
        return x2 @ _dequantize(qw, 0, m.out_features, dtype).t()
    y = torch.empty(x2.shape[0], m.out_features, dtype=dtype, device=x2.device)
    for i in range(0, m.out_features, rows):
        stop = min(m.out_features, i + rows)
        y[:, i:stop] = x2 @ _dequantize(qw, i, stop, dtype).t()
    return y


def swiglu(m, x, int8_out: bool = False):
    """silu(x W_g^T) * (x W_u^T) of one row for the fused [gate; up] QuantLinear m, in one launch
    (where `serves(m, x)`). int8_out: the kernels' (a runs GEMV reads the result next: the row
    carrying its int8 words too)."""
    return _gemv(x if not isinstance(x, torch.Tensor) else x.contiguous(), m.qweight(), m.bias, swiglu=True,
                 int8_out=int8_out)


def dequantized(qw, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows start..stop of the quantized weight qw in `dtype` by a kernel, or None where none
    serves its tensors (the module's torch dequantizer then)."""
    if not quant_tensor_serves(qw.data):
        return None
    return _dequantize(qw, start, stop, dtype)


def dequantized_rows(qw, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """qw's rows `ids` (GGUF blocks: an embedding lookup) in `dtype` by a kernel, or None where
    none serves its tensors."""
    if not quant_tensor_serves(qw.data):
        return None
    return _dequantize_rows(qw, ids, dtype)


class Forms:
    """The forms above as the one object the planner binds to a module (`module.forms`); a copy
    of the module (copy.deepcopy) keeps this one."""
    serves = staticmethod(serves)
    forward = staticmethod(forward)
    swiglu = staticmethod(swiglu)
    dequantized = staticmethod(dequantized)
    dequantized_rows = staticmethod(dequantized_rows)

    def __deepcopy__(self, memo) -> "Forms":
        return self

    def __repr__(self) -> str:
        return "models.ops.quant.FORMS"


FORMS = Forms()
