"""HF quantized linears as modules: FP8 with 128 x 128 block scales (`Fp8Linear`) and AWQ / GPTQ
4-bit groups repacked as QWeight's INT4 (`GroupInt4Linear`), built from formats/hf_quant.py's
tensors by `module(t, device)`. Contract: each computes what its tensor's `dequantize()` gives,
times x (tests/formats/test_quant.py, tests/formats/test_hf_quant.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..formats.hf_quant import Fp8Tensor, Int4GroupTensor, QuantizedTensor
from . import runs
from .layers import QuantLinear, QWeight, with_bias
from .planar import dequantize_int4p, one_storage, repack_int4p


def module(t: QuantizedTensor, device) -> nn.Module:
    """The linear that computes with `t`'s weights on `device`, kept quantized."""
    if isinstance(t, Fp8Tensor):
        return Fp8Linear(t.weight.to(device), t.scale.to(device))
    if isinstance(t, Int4GroupTensor):
        n, k = t.shape
        c = t.codes.reshape(n, k // 32, 2, 16)  # per 32-run: low nibbles the first 16 weights
        packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
        return GroupInt4Linear(t.fmt, packed.to(device), t.scales.to(device), t.zeros.to(device), t.group)
    raise TypeError(f"no module for {type(t).__name__}")


class Fp8Linear(QuantLinear):
    """y = x @ W.T (+ bias) for FP8 e4m3 weights with 128 x 128 block scales. CUDA: the Triton
    kernels; elsewhere the oracle's weights, a chunk of rows at a time."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, sizes: list[int] | None = None,
                 scale_rows: int = 128):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.sizes = sizes or [weight.shape[0]]
        self.scale_rows = scale_rows  # rows per scale: 128, or 1 (see concat)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_parameter("bias", None)

    def qweight(self) -> QWeight:
        return QWeight("FP8", self.weight, self.out_features, self.in_features, scales=self.scale,
                               group=self.scale_rows)

    def format_tensors(self):
        return "FP8", [self.weight, self.scale]

    @classmethod
    def concat(cls, parts: list["Fp8Linear"]) -> "Fp8Linear | None":
        """Rows of several linears as one. Where a part but the last ends inside a 128-row block
        (Gated DeltaNet's b and a projections: a row per head), the scales are repeated per row
        (4 bytes per 128 weights, 3% more to read) so that every row finds its own."""
        sizes = [s for p in parts for s in p.sizes]
        if all(p.scale_rows == 128 for p in parts) and not any(p.out_features % 128 for p in parts[:-1]):
            return with_bias(cls(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), sizes),
                             parts)
        rows = [p.scale.repeat_interleave(p.scale_rows, 0)[:p.out_features] for p in parts]
        return with_bias(cls(torch.cat([p.weight for p in parts]), torch.cat(rows), sizes, scale_rows=1), parts)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        s = self.scale.repeat_interleave(self.scale_rows, 0)[:self.out_features].repeat_interleave(128, 1)
        return (self.weight.float() * s[:, :self.in_features]).to(dtype)


class GroupInt4Linear(QuantLinear):
    """y = x @ W.T (+ bias) for AWQ / GPTQ 4-bit weights repacked as QWeight's INT4."""

    def __init__(self, fmt: str, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 sizes: list[int] | None = None):
        super().__init__()
        self.fmt, self.group = fmt, group
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.sizes = sizes or [packed.shape[0]]
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_parameter("bias", None)

    planar = False  # True once to_planar() replaced the stored layout by INT4P

    def to_planar(self, runs: bool = True) -> bool:
        """For CUDA's GEMVs, once, after fusion: groups of a multiple of 32 stay as stored (runs,
        quant/runs.py: models/kernels/cuda/qruns.py reads them), their three tensors moved into
        one allocation (one_storage); others are repacked as INT4P (qplanar.py), the stored layout
        freed (all of them where not `runs`: bench/ab_decode.py's planar4 variant). True where repacked."""
        if self.planar or self.group % 8 or self.in_features % self.group:
            return self.planar
        if runs and self.group % 32 == 0:
            if len({t.untyped_storage().data_ptr() for t in (self.packed, self.scales, self.zeros)}) > 1:
                one = one_storage(self.qweight())
                self.packed, self.scales, self.zeros = one.data, one.scales, one.zeros
            return False
        pw = one_storage(repack_int4p(self.qweight()))
        del self.packed, self.scales, self.zeros
        self.register_buffer("words", pw.data)
        self.register_buffer("aux", pw.scales)
        self.register_buffer("aux_zeros", pw.zeros)
        self.planar = True
        return True

    def qweight(self) -> QWeight:
        if self.planar:
            return QWeight("INT4P", self.words, self.out_features, self.in_features, self.aux, self.aux_zeros,
                           self.group)
        return QWeight("INT4", self.packed, self.out_features, self.in_features, self.scales, self.zeros,
                               self.group)

    def format_tensors(self):
        return self.fmt, [self.words, self.aux, self.aux_zeros] if self.planar else [self.packed, self.scales,
                                                                                        self.zeros]

    @classmethod
    def concat(cls, parts: list["GroupInt4Linear"]) -> "GroupInt4Linear | None":
        p0 = parts[0]
        if any(p.group != p0.group or p.fmt != p0.fmt or p.planar for p in parts):
            return None
        return with_bias(cls(p0.fmt, torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                             torch.cat([p.zeros for p in parts]), p0.group, [s for p in parts for s in p.sizes]), parts)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.planar:
            return dequantize_int4p(self.qweight()).to(dtype)
        n, k = self.out_features, self.in_features
        return Int4GroupTensor(self.fmt, runs.codes(self.packed, n, k), self.zeros, self.scales, self.group).dequantize(dtype)
