"""The residual add and RMSNorm of a decoder layer's input as one op: (x + branch, rms_norm(x +
branch) * weight). On CUDA one kernel for any number of rows, or for one row under `defer` none
at all: a NormedRow whose norm the next GEMV's prologue computes. x, branch [T, n] in one dtype;
weight [n] (fp32 where the norm is zero-centred); the normed rows in out_dtype (x's by default)."""
from __future__ import annotations

import torch

from ..kernels.cuda import base as _base, linear as _linear
from ..plan.serving import add_norm_serves


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 defer: bool = False, out_dtype: torch.dtype | None = None):
    """(stream, normed) from the kernels, or None where they do not serve x (then the caller adds
    and norms in torch). `branch` None: nothing to add (the stream is x); with defer and one row
    the normed row is a NormedRow; without a branch and without defer no kernel runs (None)."""
    if not add_norm_serves(x, branch):
        return None
    if defer and x.shape[0] == 1:
        row = _linear.NormedRow(x, branch, weight, eps, out_dtype)
        return row.stream, row
    if branch is not None and x.is_contiguous() and branch.is_contiguous():
        return _base.add_rms_norm(x, branch, weight, eps, out_dtype=out_dtype)
    return None
