"""Quantized weights as modules that compute. GGUF weights kept quantized on the CPU: 4-bit linears on torch's int4 kernel, Q8_0 embeddings,
and every other block type gguf_blocks.py knows (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) read as stored.

Contract: a module here computes what the dequantized fp32 module computes, up to bf16 rounding.
- Q4_0 / Q4_1 blocks (32 weights, an fp16 scale d and for Q4_1 an fp16 minimum m) map exactly
  onto torch's groupwise int4 layout, w = (q - 8) * scale + zero: scale = d, zero = m + 8d
  (Q4_1) or 0 (Q4_0). `Int4Linear` runs `_weight_int4pack_mm_for_cpu`, which takes bf16
  activations and a bf16 scale/zero and returns bf16; that rounding is the only numeric change
  from the dequantized path, and tests/formats/test_quant.py bounds it (the tolerance is documented
  there: tighter than llama.cpp's own distance from the fp32 path, bench/numerics.py).
- A Q8_0 matrix (the embedding table, tied as the LM head) splits exactly into two 4-bit
  planes, q + 128 = 16 * hi + lo, so the head runs as two int4 matmuls (`Q8Linear`) with the
  same rounding as above. The embedding lookup dequantizes only the rows it reads, exactly.
- Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks (and Q8_0 linears other than the head) stay as the
  file stores them (`GgufTensor`: the file's memory-mapped pages, no copy): `BlockLinear` and
  `BlockEmbedding` compute in fp32 on weights dequantized exactly as gguf-py dequantizes them (a
  block of rows at a time), or through the C++ step's kernels, which read the blocks directly;
  either way the dequantized fp32 modules' results up to fp32 rounding.
- MoE experts (3D tensors, any kept type) stay as stored too on the CPU (`BlockExperts`): a
  token's chosen experts are dequantized exactly, one at a time, and multiplied in the
  activations' dtype (on CUDA, a Q4_K, Q5_K or Q6_K half of them is repacked as one Q4KP, Q5KP
  or Q6KP matrix, `PlanarExperts`; another type is dequantized at load for the MoE kernels).
Weights are converted once at load. On CUDA every type above stays
in its blocks as BlockLinear / BlockEmbedding, but for the linears repacked after fusion
(`BlockLinear.to_planar`, where the kernel plan's rules say so: models/plan/table.py): Q4_K,
Q5_0 and Q5_1 in runs.py's layouts, the larger Q5_K and Q6_K in planar.py's (a head tied to its
embedding keeps its blocks). One-token products run the Triton
dequant-GEMV, longer ones dequantize a chunk of rows
to the activations' dtype in a Triton kernel and multiply with torch's GEMM (QuantLinear's
CUDA forms, models/ops/quant.py, which the kernel plan binds to each module; QuantLinear is
shared with the HF formats of hf_quant.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..formats import gguf_blocks
from ..formats import gguf_tensors
from ..formats.gguf_tensors import _PACK_ROWS, _TILE_ROWS, GROUP, GgufExperts, GgufTensor, QuantTensor
from . import runs as run_layout


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) for W in GGUF 4-bit blocks, in x's dtype (bf16 inside the kernel);
    rows of several matrices may be concatenated (`sizes`, `split`), as FusedLinear does."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, in_features: int, sizes: list[int]):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(sizes)
        self.sizes = sizes
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)  # [K/32, N, 2] bf16
        self.register_parameter("bias", None)

    @classmethod
    def from_quant(cls, qt: QuantTensor) -> "Int4Linear":
        n, k = qt.codes.shape
        # the packed layout is per row: pack row blocks, so the int32 copy the packer wants stays small
        packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(qt.codes[i:i + _PACK_ROWS].astype(np.int32)), 1) for i in range(0, n, _PACK_ROWS)])
        # the kernel computes (q - 8) * scale + zero: fold the +8 into the zero
        zero = qt.zero + 8.0 * qt.scale
        sz = torch.stack([torch.from_numpy(qt.scale.T.copy()), torch.from_numpy(zero.T.copy())], -1)
        lin = cls(packed, sz.to(torch.bfloat16), k, [n])
        lin.gguf_kind = qt.kind  # what the file stored (for /show's weight formats)
        return lin

    @classmethod
    def concat(cls, parts: list["Int4Linear"]) -> "Int4Linear | None":
        """Rows of several linears that read the same input, as one; None where a part's rows are
        not a whole number of the packer's 64-row tiles (its packed rows could not be appended)."""
        if any(p.out_features % _TILE_ROWS for p in parts[:-1]):
            return None
        fused = cls(torch.cat([p.packed for p in parts]), torch.cat([p.scale_zero for p in parts], 1),
                    parts[0].in_features, [s for p in parts for s in p.sizes])
        kinds = {getattr(p, "gguf_kind", "int4") for p in parts}
        fused.gguf_kind = kinds.pop() if len(kinds) == 1 else "int4"
        if parts[0].bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, K] inputs (every call in our models) skip the reshapes: the decode step is op-bound
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, GROUP, self.scale_zero)
        y = (y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


class Q8Embedding(nn.Module):
    """An embedding table in Q8_0 blocks; a lookup dequantizes only the rows it reads (exact)."""

    def __init__(self, qt: QuantTensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qt.codes.shape
        self.register_buffer("codes", torch.from_numpy(qt.codes.copy()))
        self.register_buffer("scale", torch.from_numpy(qt.scale.copy()))

    @property
    def quant(self) -> QuantTensor:
        scale = self.scale.numpy()
        return QuantTensor("q8_0", self.codes.numpy(), scale, np.zeros_like(scale))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].float().view(*ids.shape, -1, GROUP) * self.scale[ids][..., None]
        return rows.view(*ids.shape, self.embedding_dim)


class Q8Linear(nn.Module):
    """y = x @ W.T for W in Q8_0 blocks, as two int4 matmuls: with u = q + 128 = 16 * hi + lo,
    W = 16d * (hi - 8) + d * lo exactly (the first plane has zero 0, the second zero 8d)."""

    def __init__(self, qt: QuantTensor):
        super().__init__()
        self.out_features, self.in_features = qt.codes.shape
        # the blocks as stored, for the C++ step's fp32 form (models.kernels.cpu: q8_linear); a
        # head tied to a Q8Embedding shares its arrays (from_numpy over .numpy() copies nothing)
        self.register_buffer("codes", torch.from_numpy(qt.codes), persistent=False)
        self.register_buffer("scale", torch.from_numpy(np.ascontiguousarray(qt.scale, dtype=np.float32)),
                             persistent=False)
        # The two int4 planes are built at the first product that needs them (no fp32 kernel):
        # where the C++ step serves the head they never are, which spares their copy and the
        # load's transient of several vocabulary-sized arrays (bench/load_rss.py). Kept out of the
        # module tree (a plain attribute): they are a cache of `codes`, not weights of their own.
        self.__dict__["_qt"], self.__dict__["_planes"] = qt, None

    @property
    def hi(self) -> "Int4Linear":
        return self._built_planes()[0]

    @property
    def lo(self) -> "Int4Linear":
        return self._built_planes()[1]

    def _built_planes(self) -> tuple["Int4Linear", "Int4Linear"]:
        if self._planes is None:
            hi, lo = self.planes(self._qt)
            self.__dict__["_planes"] = (Int4Linear.from_quant(hi), Int4Linear.from_quant(lo))
        return self._planes

    def planes_built(self) -> bool:
        return self._planes is not None

    @staticmethod
    def planes(qt: QuantTensor) -> tuple[QuantTensor, QuantTensor]:
        u = qt.codes.view(np.uint8) ^ 0x80  # q + 128 as a byte: flipping the sign bit
        return (QuantTensor("q4", u >> 4, 16.0 * qt.scale, -128.0 * qt.scale),
                QuantTensor("q4", u & 0x0F, qt.scale, np.zeros_like(qt.scale)))

    # An fp32 form of this product, `fn(x, codes, scale, int8)`, set by a kernel that provides one (the
    # C++ CPU step, when a session decodes with it: its prefill and its steps then share it).
    fp32_kernel = None
    int8_inputs = False  # x rounded to int8 in fp32_kernel first, as llama.cpp rounds it (use_int8_inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_kernel is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.fp32_kernel(x.contiguous(), self.codes, self.scale, self.int8_inputs)
        return self.hi(x) + self.lo(x)  # (each plane's sums rounded to bf16 by the int4 kernel)


# Rows dequantized at a time by BlockLinear's torch path (an fp32 copy of ~16 MiB at most)
_DEQUANT_ELEMENTS = 4 << 20


@dataclass
class QWeight:
    """A quantized [N, K] matrix as the kernels read it: `data` (GGUF: uint8 [N, row bytes];
    FP8: float8_e4m3fn [N, K]; INT4: uint8 [N, K/2], byte 16r + l of a row holding weight 32r + l
    in its low nibble and 32r + 16 + l in its high one), and for FP8 `scales` fp32 [ceil(N/group),
    K/128] (group: rows per scale, 128 as stored, 1 where fused linears' blocks do not line up),
    for INT4 `scales` fp16 and `zeros` uint8 [N, K/group] (weight = (q - zero) * scale)."""
    fmt: str
    data: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros) if t is not None)



class QuantLinear(nn.Module):
    """A linear on quantized weights (GGUF blocks, FP8, 4-bit groups): a subclass gives
    `qweight()` (what the kernels read), `dequantize()` and, where it has them, its own CPU forms.
    On CUDA its forms are `forms` (models/ops/quant.py: the dequant-GEMV for one row, the kernels'
    matmul or dequantized chunks and torch's GEMM for more), which the kernel plan binds to each
    module it serves; where they are not bound or do not serve x, torch's linear on the weights
    dequantized to x's dtype runs. `sizes` splits the rows of fused linears back."""

    sizes: list[int] | None = None
    forms = None  # the CUDA forms, bound per module by the kernel plan (models/plan: bind_forms)

    def qweight(self) -> QWeight:
        raise NotImplementedError

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The CUDA forms where they serve x, else torch's linear on the weights dequantized to
        x's dtype (a subclass with its own CPU kernels overrides this)."""
        if self.cuda_serves(x):
            return self.forms.forward(self, x, out_dtype)
        x = self.plain(x)
        y = nn.functional.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if out_dtype is None else y.to(out_dtype)

    def cuda_serves(self, x) -> bool:
        """Whether the bound CUDA forms take x (this format and row length among the kernels',
        x rows on CUDA they serve; a NormedRow always is one). A NormedRow they do not take, the
        torch forward materializes (`plain`)."""
        return self.forms is not None and self.forms.serves(self, x)

    @staticmethod
    def plain(x) -> torch.Tensor:
        """x as a tensor: a NormedRow (kernels.cuda.linear) normed, and its stream written, now."""
        return x if isinstance(x, torch.Tensor) else x.materialize()

    def split(self, x) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


def with_bias(fused: "QuantLinear | None", parts: list[nn.Module]) -> "QuantLinear | None":
    """A fused linear with its parts' biases concatenated (None where only some have one)."""
    if fused is None or all(p.bias is None for p in parts):
        return fused
    if any(p.bias is None for p in parts):
        return None
    fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class BlockLinear(QuantLinear):
    """y = x @ W.T (+ bias) for W in GGUF blocks as stored (`BLOCK_TYPES`, and Q8_0 inside the
    layers, which the C++ step reads as blocks; any type gguf_blocks knows works), in fp32 on
    exactly the weights gguf-py's dequantization gives: rows of W are dequantized a block of rows
    at a time and multiplied, or, where a kernel is set (the C++ step sets both), read directly
    from the blocks (`fp32_kernel(x, blocks, type)`, for a few rows: decode) or dequantized by
    it (`dequant_kernel(blocks, type)`, bit for bit the same as gguf_blocks.dequantize). On CUDA
    the Triton kernels of QuantLinear read the blocks."""

    fp32_kernel = None
    dequant_kernel = None
    KERNEL_ROWS = 4  # fp32 inputs: up to this many rows go to fp32_kernel; more: dequantize + GEMM
    int8_inputs = False  # any rows to fp32_kernel, rounded to int8 there as llama.cpp rounds (use_int8_inputs)
    # With int8_inputs, how a prefill's PREFILL_ROWS rows or more are multiplied (set with the
    # kernels, by what the CPU runs fastest from about that many rows: bench/cpu_block_bench.py
    # --rows, bench/cpu_bench.py): "bf16", bf16 products (`bf16_kernel(x, blocks, type)`; AVX512-
    # BF16), nearer the fp32 product than int8 inputs; "fp32", x itself times the dequantized
    # weights by torch's GEMM (the library's AVX2 forms of the 32-weight types, whose int8 tiles
    # were slower: exact too); "int8", the int8 tiles (AVX-512 VNNI without BF16, and the AVX2
    # forms of the K-quants). A dict: the form of each GGUF type the module holds, where they differ
    bf16_kernel = None
    prefill_form: "str | dict[int, str]" = "int8"
    PREFILL_ROWS = 64

    def form_of(self, ggml_type: int) -> str:
        """The prefill form of this module's `ggml_type` blocks on rounded inputs (prefill_form)."""
        return self.prefill_form if isinstance(self.prefill_form, str) else self.prefill_form[ggml_type]

    def cpu_product(self, x2: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        """x2 [T, K] fp32 times the blocks' W^T by the library's kernels (bf16 products, int8 or fp32
        inputs, as the attributes above choose), or None where none takes x2 (the torch forms then)."""
        if self.fp32_kernel is None or x2.dtype != torch.float32:
            return None
        form = self.form_of(ggml_type)
        if self.int8_inputs and x2.shape[0] >= self.PREFILL_ROWS and form != "int8":
            return self.bf16_kernel(x2, blocks, ggml_type) if form == "bf16" else None
        if x2.shape[0] <= self.KERNEL_ROWS or self.int8_inputs:
            return self.fp32_kernel(x2.contiguous(), blocks, ggml_type, self.int8_inputs)
        return None

    # On the CPU, 32-weight blocks interleaved 16 rows at a time for the library's int8 products
    # (quant/rows16.py), beside the blocks, which the other kernels read: made by the kernel plan at
    # load (interleave()), read where int8_inputs
    rows16: torch.Tensor | None = None
    wide_inputs = False  # with rows16 and int8_inputs: inputs rounded to 16 bits (`cpu_int8: wide`)

    def __init__(self, blocks: torch.Tensor, ggml_type: int, sizes: list[int] | None = None):
        super().__init__()
        self.ggml_type = ggml_type
        self.in_features = gguf_blocks.row_weights(ggml_type, blocks.shape[1])
        self.out_features = blocks.shape[0]
        self.sizes = sizes or [blocks.shape[0]]
        self.register_buffer("blocks", blocks)
        self.register_parameter("bias", None)
        self.mapped = None  # the file's mapped array under the blocks, where they are its pages

    @classmethod
    def from_gguf(cls, t: GgufTensor, device=None) -> "BlockLinear":
        m = cls(t.blocks().to(device) if device is not None else t.blocks(), t.ggml_type)
        if device is None or torch.device(device).type == "cpu":
            m.mapped = t.raw
        return m

    def interleave(self) -> bool:
        """A rows16 type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on the CPU in whole 16-row groups: the rows16
        layout made (once), the blocks' file pages handed back (nothing reads them while the
        products take int8 inputs; a later fp32 product maps them in again). False where the
        layout does not fit."""
        from . import rows16
        if self.rows16 is not None:
            return True
        if self.planar or self.blocks.is_cuda or not rows16.fits(self.ggml_type, self.out_features):
            return False
        self.rows16 = rows16.interleave(self.blocks, self.ggml_type)
        if self.mapped is not None:
            gguf_tensors.release_pages(self.mapped)
        return True

    def first_rows(self, n: int) -> "BlockLinear | None":
        """Its first n rows as a BlockLinear over views of these weights (nothing copied), with the
        same kernels and rounding (instance attributes, set by the kernel plan); None where the
        weights are not row-major blocks on the CPU, or n is not a whole number of rows16 groups."""
        from . import rows16
        if self.planar or self.blocks.is_cuda or (self.rows16 is not None and n % rows16.ROWS):
            return None
        sub = copy.copy(self)
        sub._buffers = {"blocks": self.blocks[:n]}
        sub._parameters = {"bias": None if self.bias is None else nn.Parameter(self.bias[:n], requires_grad=False)}
        sub.out_features, sub.sizes, sub.mapped = n, [n], None
        if self.rows16 is not None:
            sub.rows16 = self.rows16[:n]
        return sub

    def int8_operand(self) -> tuple[torch.Tensor, int]:
        """What the library's int8 products of this matrix read: the rows16 layout and its type
        code where it is made, else the blocks and their GGUF type."""
        from . import rows16
        if self.rows16 is not None:
            return self.rows16, rows16.CODE + (rows16.WIDE if self.wide_inputs else 0) + self.ggml_type
        return self.blocks, self.ggml_type

    @classmethod
    def concat(cls, parts: list["BlockLinear"]) -> "BlockLinear | None":
        """Rows of several linears that read the same input, as one (on CUDA, where the GEMV
        reads any rows; the C++ step reads each matrix): None where types or devices differ."""
        if not all(not p.planar and p.blocks.is_cuda and p.ggml_type == parts[0].ggml_type for p in parts):
            return None
        return with_bias(cls(torch.cat([p.blocks for p in parts]), parts[0].ggml_type,
                             [s for p in parts for s in p.sizes]), parts)

    planar = False  # True once to_planar() replaced the blocks by a kernel's layout (quant/runs.py, planar.py)
    planar_fmt = ""

    @staticmethod
    def repack_for(ggml_type: int, runs: bool = True, five_bit: bool = True):
        """(repack function, the layout it makes) that to_planar applies to this GGUF type, or
        None: Q4_K into Q4KR (runs.py; Q4KP, planar.py, where not `runs`), Q5_K into Q5KP, Q6_K
        into Q6KP; with `runs` and `five_bit`, Q5_0 / Q5_1 into Q50R / Q51R."""
        from . import planar
        table = {"Q4_K": (run_layout.repack_q4k, "Q4KR") if runs else (planar.repack_q4k, "Q4KP"),
                 "Q5_K": (planar.repack_q5k, "Q5KP"), "Q6_K": (planar.repack_q6k, "Q6KP")}
        if runs and five_bit:
            table.update({t: (run_layout.repack_q5, layout) for t, layout in run_layout.FIVE_BIT.items()})
        return table.get(gguf_blocks.type_name(ggml_type))

    def to_planar(self, runs: bool = True, five_bit: bool = True) -> bool:
        """Q4_K, Q5_K and Q6_K on CUDA: the blocks repacked as Q4KR (runs.py: 4.625 bits a weight
        against 4.5) for qruns.py's GEMV (Q4KP for qplanar.py's where not `runs`), Q5KP (5.625
        against 5.5) or Q6KP (6.5625, as Q6_K) for qplanar.py's; with `runs` and `five_bit`, Q5_0
        and Q5_1 as Q50R and Q51R (runs.py: the blocks' bytes) for qruns.py's (repack_for's
        table); the blocks freed; once, after fusion. False for other types."""
        from . import planar
        repack = self.repack_for(self.ggml_type, runs, five_bit)
        if self.planar or repack is None or self.in_features % gguf_blocks.LAYOUTS[self.ggml_type].block:
            return self.planar
        self.hold(planar.one_storage(repack[0](self.qweight())))
        return True

    def hold(self, pw: QWeight) -> None:
        """Keep pw's layout (its three tensors as buffers) in place of the blocks."""
        del self.blocks
        self.register_buffer("words", pw.data)
        self.register_buffer("dd", pw.scales)
        self.register_buffer("sm", pw.zeros)
        self.planar, self.planar_fmt, self.planar_group = True, pw.fmt, pw.group

    def stored(self) -> list[torch.Tensor]:
        """The tensors that hold the weights (the blocks, or the planar layout's three)."""
        return [self.words, self.dd, self.sm] if self.planar else [self.blocks]

    def qweight(self) -> QWeight:
        if self.planar:
            return QWeight(self.planar_fmt, self.words, self.out_features, self.in_features, self.dd, self.sm,
                           self.planar_group)
        return QWeight(gguf_blocks.type_name(self.ggml_type), self.blocks, self.out_features, self.in_features)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        if self.planar:
            from . import planar
            rows = run_layout.dequantize_rows if self.planar_fmt in run_layout.REPACKED else planar.dequantize_planar_rows
            return rows(self.qweight(), start, min(stop, self.out_features)).float()
        return _dequantized(self.dequant_kernel, self.blocks[start:stop], self.ggml_type)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.stored()[0].is_cuda and self.cuda_serves(x):
            return self.forms.forward(self, x, out_dtype)
        x = self.plain(x)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = None
        if self.fp32_kernel is not None and self.int8_inputs and self.rows16 is not None and x2.dtype == torch.float32:
            y = self.fp32_kernel(x2.contiguous(), *self.int8_operand(), True)  # (any rows: rows16_int8.h)
        elif self.fp32_kernel is not None:
            y = self.cpu_product(x2, self.blocks, self.ggml_type)
        if y is None:
            y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
            rows = max(1, _DEQUANT_ELEMENTS // self.in_features)
            for i in range(0, self.out_features, rows):
                w = self.dequantize_rows(i, i + rows).to(x2.dtype)
                torch.mm(x2, w.t(), out=y[:, i:i + rows])
        y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        y = y if self.bias is None else y + self.bias
        return y if out_dtype is None else y.to(out_dtype)



class BlockExperts(nn.Module):
    """Routed SwiGLU experts in GGUF blocks as stored (any type gguf_blocks knows), computing what
    moe.Experts computes on the dequantized weights (fp32 products on exactly gguf-py's values):
    only the experts the tokens chose are dequantized, one at a time, so a 4-bit MoE file stays
    4-bit in memory and its unused experts are never read from the mapping. Where the C++
    library's kernels are set (kernels.cpu_block_kernels), an expert that a few rows chose is
    read from its blocks directly (`fp32_kernel`: decode) and the others dequantized by it
    (`dequant_kernel`, the same values)."""

    fp32_kernel = None
    dequant_kernel = None
    cpu_kernel = None  # the library's experts_decode for one token (kernels.cpu_block_kernels)
    cpu_kernel_name = "experts_decode"
    KERNEL_ROWS = BlockLinear.KERNEL_ROWS
    int8_inputs = False  # as BlockLinear's
    bf16_kernel = None
    prefill_form = BlockLinear.prefill_form
    form_of = BlockLinear.form_of
    PREFILL_ROWS = BlockLinear.PREFILL_ROWS
    cpu_product = BlockLinear.cpu_product

    def __init__(self, t: GgufExperts):
        super().__init__()
        self.types = (t.gate.ggml_type, t.up.ggml_type, t.down.ggml_type)
        self.register_buffer("gate_blocks", t.gate.blocks())
        self.register_buffer("up_blocks", t.up.blocks())
        self.register_buffer("down_blocks", t.down.blocks())

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; idx (int64), weights (fp32) [T, top_k]: the per-expert loop over the chosen ones
        (one token on the CPU with the library's kernels: the same products in one call,
        `cpu_kernel`)."""
        if self.cpu_kernel is not None and x.shape[0] == 1 and x.dtype == torch.float32 and not x.is_cuda:
            return self.cpu_kernel(x, self.gate_blocks, self.up_blocks, self.down_blocks, *self.types, idx,
                                   weights.float(), self.int8_inputs)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            xs = x[tok]
            g, u, d = self.types
            h = F.silu(self._product(xs, self.gate_blocks[e], g)) * self._product(xs, self.up_blocks[e], u)
            y = self._product(h, self.down_blocks[e], d)
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out

    def _product(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
        """x times one expert matrix's W^T: the library's kernels where they take x (cpu_product),
        else torch's linear on the weights dequantized to x's dtype (each matrix as its type's
        prefill form says: a K-quant mix may hold types whose forms differ)."""
        y = self.cpu_product(x, blocks, ggml_type)
        if y is not None:
            return y
        return F.linear(x, _dequantized(self.dequant_kernel, blocks, ggml_type).to(x.dtype))


def _dequantized(kernel, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF blocks dequantized to fp32: by the C++ library's `kernel` where one is set and the blocks
    are on the CPU, else by gguf_blocks (bit for bit the same values)."""
    if kernel is not None and blocks.device.type == "cpu":
        return kernel(blocks, ggml_type)
    return gguf_blocks.dequantize(blocks, ggml_type)


class PlanarExperts(nn.Module):
    """Routed SwiGLU experts of a GGUF on CUDA, what moe.Experts computes: each half, the fused
    [gate; up] rows [E, 2I, H] and the down rows [E, H, I], repacked as Q4KP, Q5KP or Q6KP where
    the file holds it in Q4_K, Q5_K or Q6_K (gate and up in one type) with whole super-blocks
    (quant/planar.py: the E experts' rows as one matrix, expert e's from row e * rows), else
    dequantized to the model's dtype as moe.Experts holds it (`gate_up_proj`, `down_proj`: a
    Q8_0 half, say). The decode step (architectures/moe.py) reads only the chosen experts on the
    device (qplanar.py's expert GEMVs take every planar layout); more tokens take each chosen
    expert's rows dequantized (the bound CUDA forms where they serve, else planar's oracle)."""

    forms = None  # the CUDA forms, bound per module by the kernel plan (models/plan: bind_forms)

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        # half: (layout, n, k, group, the GGUF type it was repacked from)
        self.planar_halves: dict[str, tuple[str, int, int, int, str]] = {}

    @staticmethod
    def layout_for(ggml_type: int) -> str | None:
        """The planar layout an experts' half of this GGUF type is repacked into (BlockLinear's
        table without runs: Q4_K → Q4KP, Q5_K → Q5KP, Q6_K → Q6KP), or None: kept dense."""
        repack = BlockLinear.repack_for(ggml_type, runs=False)
        return None if repack is None else repack[1]

    @classmethod
    def _repack(cls, tensors: "list[GgufTensor]", device: torch.device) -> QWeight | None:
        """The experts' rows of `tensors` (one half: gate and up, or down; [E, rows, K] each,
        joined row-wise per expert) as one planar QWeight on `device`, or None where their type
        has no planar layout (layout_for), they differ, or the rows or K are not whole blocks."""
        from . import planar
        ggml_type = tensors[0].ggml_type
        e, rows, k = tensors[0].shape[0], sum(t.shape[1] for t in tensors), tensors[0].shape[2]
        if cls.layout_for(ggml_type) is None or any(t.ggml_type != ggml_type for t in tensors) \
                or k % 256 or any(t.shape[1] % planar.ROWS for t in tensors):
            return None
        blocks = torch.cat([t.blocks() for t in tensors], 1).to(device).reshape(e * rows, -1)
        repack = BlockLinear.repack_for(ggml_type, runs=False)[0]
        return repack(QWeight(gguf_blocks.type_name(ggml_type), blocks, e * rows, k))

    @classmethod
    def from_gguf(cls, t: "GgufExperts", device: torch.device, dtype: torch.dtype) -> "PlanarExperts":
        e, i, h = t.gate.shape
        m = cls(e, h, i)
        gate_up = cls._repack([t.gate, t.up], device)
        if gate_up is not None:
            m.keep_planar("gate_up", gate_up, gguf_blocks.type_name(t.gate.ggml_type))
        else:
            m.gate_up_proj = nn.Parameter(torch.cat([t.gate.dequantize(), t.up.dequantize()], 1).to(device, dtype),
                                          requires_grad=False)
        down = cls._repack([t.down], device)
        if down is not None:
            m.keep_planar("down", down, gguf_blocks.type_name(t.down.ggml_type))
        else:
            m.down_proj = nn.Parameter(t.down.dequantize().to(device, dtype), requires_grad=False)
        return m

    def gguf_kinds(self) -> dict[str, str]:
        """The GGUF type each planar half was repacked from ("gate_up"/"down" → "Q4_K", ...)."""
        return {half: kind for half, (*_, kind) in self.planar_halves.items()}

    def keep_planar(self, half: str, pw: QWeight, kind: str) -> None:
        """Hold `pw` ([E rows, K], planar, repacked from GGUF type `kind`) as "gate_up" ([gate; up]
        rows of each expert) or "down"."""
        for name, tensor in (("words", pw.data), ("dd", pw.scales), ("sm", pw.zeros)):
            self.register_buffer(f"{half}_{name}", tensor)
        self.planar_halves[half] = (pw.fmt, pw.n, pw.k, pw.group, kind)

    def qweight(self, half: str) -> QWeight | None:
        """The planar QWeight of "gate_up" or "down" (its buffers as they are now), or None
        where that half is dense."""
        if half not in self.planar_halves:
            return None
        fmt, n, k, group, _ = self.planar_halves[half]
        return QWeight(fmt, getattr(self, f"{half}_words"), n, k, getattr(self, f"{half}_dd"), getattr(self, f"{half}_sm"),
                       group)

    def stored(self) -> list[torch.Tensor]:
        """The tensors of the planar halves (the dense ones are parameters)."""
        return [getattr(self, f"{half}_{name}") for half in self.planar_halves for name in ("words", "dd", "sm")]

    def _rows(self, half: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        dense = getattr(self, "gate_up_proj" if half == "gate_up" else "down_proj", None)
        if dense is not None:
            return dense[e].to(dtype)
        pw = self.qweight(half)
        rows = pw.n // self.num_experts
        y = None if self.forms is None else self.forms.dequantized(pw, e * rows, (e + 1) * rows, dtype)
        if y is not None:
            return y
        from . import planar
        return planar.dequantize_planar_rows(pw, e * rows, (e + 1) * rows).to(dtype)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; idx (int64), weights (fp32) [T, top_k]: the per-expert loop over the chosen
        ones, each expert's rows dequantized (moe.Experts' loop on these weights)."""
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self._rows("gate_up", e, x.dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self._rows("down", e, x.dtype)) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out



class BlockEmbedding(nn.Module):
    """An embedding table in GGUF blocks as stored; a lookup dequantizes only the rows it reads
    (exactly gguf-py's values; on CUDA by the Triton kernel, in `out_dtype`: the model's). Tied to
    an LM head that the loader repacked in runs (share_layout), it reads the head's layout instead:
    the same values, one copy of the table."""

    out_dtype: torch.dtype = torch.float32
    planar = False  # True once share_layout() replaced the blocks by a tied head's runs
    forms = None  # the CUDA forms, bound per module by the kernel plan (models/plan: bind_forms)

    def __init__(self, t: "GgufTensor | torch.Tensor", device=None, ggml_type: int | None = None):
        """t: the GGUF tensor, or its blocks as a uint8 tensor (with ggml_type)."""
        super().__init__()
        blocks = t if isinstance(t, torch.Tensor) else t.blocks()
        self.ggml_type = ggml_type if isinstance(t, torch.Tensor) else t.ggml_type
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = gguf_blocks.row_weights(self.ggml_type, blocks.shape[1])
        self.register_buffer("blocks", blocks.to(device) if device is not None else blocks)

    def share_layout(self, head: "BlockLinear") -> bool:
        """Read the rows of `head` (the tied LM head, built on these blocks by as_linear) once the
        loader has repacked it in one of runs.REPACKED (row-major: an embedding can gather rows of
        them); the blocks freed. False (nothing changed) where the head's layout is not one of them."""
        if not head.planar or head.planar_fmt not in run_layout.REPACKED or self.planar:
            return self.planar
        del self.blocks
        for name in ("words", "dd", "sm"):
            self.register_buffer(name, getattr(head, name))
        self.planar, self.planar_fmt, self.planar_group = True, head.planar_fmt, head.planar_group
        return True

    def stored(self) -> list[torch.Tensor]:
        return [self.words, self.dd, self.sm] if self.planar else [self.blocks]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        forms = self.forms
        if self.planar:  # the runs' rows gathered, then decoded
            qw = QWeight(self.planar_fmt, self.words[flat], flat.numel(), self.embedding_dim, self.dd[flat],
                         self.sm[flat], self.planar_group)
            y = None if forms is None else forms.dequantized(qw, 0, flat.numel(), self.out_dtype)
            if y is not None:
                return y.view(*ids.shape, -1)
            from . import runs
            return runs.dequantize(qw).to(self.out_dtype).view(*ids.shape, -1)
        if forms is not None:
            qw = QWeight(gguf_blocks.type_name(self.ggml_type), self.blocks, *self.blocks_shape())
            y = forms.dequantized_rows(qw, flat, self.out_dtype)
            if y is not None:
                return y.view(*ids.shape, -1)
        return gguf_blocks.dequantize(self.blocks[flat], self.ggml_type).to(self.out_dtype).view(*ids.shape, -1)

    def blocks_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def as_linear(self) -> BlockLinear:
        """The same blocks as a tied LM head."""
        return BlockLinear(self.blocks, self.ggml_type)


def use_int8_inputs(model: nn.Module, on: bool, wide: bool = False) -> int:
    """The `cpu_int8` setting: where the C++ library reads a CPU module's GGUF blocks (a Q8_0 head
    as Q8Linear holds it included), round its input rows to int8 first, as llama.cpp's CPU kernels
    round theirs for that type (K-quants per 256 inputs, the 32-weight types per 32;
    models/kernels/cpu/blocks_int8.h), decode's rows and
    prefill's alike, or (off) take decode's rows in fp32 and prefill's through the dequantized fp32
    GEMM. `wide` (`cpu_int8: wide`): only the rows16 matrices round, to 16 bits per 32 inputs
    (rows16_int8.h: within 2^-16 of a block's largest input), the other modules take fp32 inputs.
    Returns how many modules hold CPU blocks (0: the setting changes nothing)."""
    n, rounds, widens = 0, False, False
    for m in model.modules():
        if _cpu_blocks(m) or isinstance(m, Q8Linear):
            held = wide and isinstance(m, BlockLinear) and m.rows16 is not None
            m.int8_inputs = on and (held or not wide)
            if isinstance(m, BlockLinear):
                m.wide_inputs = on and held
            n += 1
        rounds |= bool(getattr(m, "int8_inputs", False))
        widens |= bool(getattr(m, "wide_inputs", False))
    # (what the session's decode_path and /show report: whether any product rounds, and how)
    model.cpu_int8, model.cpu_wide = rounds, widens
    return n


def rounding_by_default(model: nn.Module) -> str:
    """`cpu_int8: auto`'s choice for a loaded model, as a setting's value: "wide" where the only
    CPU blocks are rows16 matrices of the types every kernel set interleaves (rows16.EVERYWHERE: a
    Q4_0/Q4_1 file's linears, the embedded model's, or a Q5_0/Q5_1 file's; so a recording's choice
    is the same on any CPU): as fast as int8 inputs there, and its replies stay the fp32 model's
    where int8 inputs moved them (tests/e2e/test_e2e_pty.py's question); "on" where other layers hold
    blocks (int8_by_default); else "off"."""
    from . import rows16
    held = [m for m in model.modules() if _cpu_blocks(m)]
    if held and all(isinstance(m, BlockLinear) and m.rows16 is not None and m.ggml_type in rows16.EVERYWHERE
                    for m in held):
        return "wide"
    return "on" if held else "off"


def cpu_rounding(model) -> str:
    """What the C++ library's products of this CPU model's GGUF blocks take as inputs, in words
    (/show): decode's rows rounded to int8 as llama.cpp rounds them and each GGUF type's prefill
    form (models/kernels/cpu/step.py's prefill_form, set with the kernels; the rows16 matrices'
    prefill on their own products), or with `cpu_int8: wide` the rows16 matrices' inputs rounded
    to 16 bits and the others' fp32, or fp32 inputs; "" where no module holds blocks the library's
    kernels read."""
    held = [m for m in model.modules() if isinstance(m, (BlockLinear, BlockExperts, Q8Linear))
            and getattr(m, "fp32_kernel", None) is not None]
    if not held:
        return ""
    if not any(m.int8_inputs for m in held):
        return "fp32 inputs (the blocks' exact products)"
    if getattr(model, "cpu_wide", False):
        names = sorted({gguf_blocks.type_name(m.ggml_type) for m in held if getattr(m, "wide_inputs", False)})
        return (f"{', '.join(names)} inputs rounded to 16 bits per 32 (rows16), decode's and a prefill's; "
                "the other products on fp32 inputs")
    words = {"bf16": "bf16 products", "int8": "int8 tiles", "fp32": "x itself by the fp32 GEMM"}
    forms: dict[str, str] = {}
    for m in held:
        if isinstance(m, Q8Linear):
            continue
        types = m.types if isinstance(m, BlockExperts) else (m.ggml_type,)
        for t in types:
            rows16 = isinstance(m, BlockLinear) and m.rows16 is not None
            forms[gguf_blocks.type_name(t)] = "rows16 int8 products" if rows16 else words[m.form_of(t)]
    by_form: dict[str, list[str]] = {}
    for name, form in sorted(forms.items()):
        by_form.setdefault(form, []).append(name)
    prefill = "; ".join(f"{', '.join(names)} {form}" for form, names in by_form.items())
    return "decode's inputs rounded to int8 as llama.cpp rounds them" + (f"; a prefill's rows: {prefill}" if prefill else "")


def int8_by_default(model: nn.Module) -> bool:
    """`cpu_int8: auto`'s choice for a loaded model: on where its layers hold GGUF blocks on the
    CPU (BlockLinear, BlockExperts: a K-quant, Q5 or Q8_0 file, or Q4_0/Q4_1 where models.load kept
    them in blocks: the AVX2 forms), whose products on rounded inputs decode and prefill faster on
    AVX-512 and on AVX2 alike (bench/cpu_bench.py --cpu-int8 all on K-quant mixes of a dense, a
    DeltaNet and a short-conv model); off where only a Q8_0 head (Q8Linear) would round, beside
    int4-plane layers (the embedded Q4_1 model with the AVX-512 forms: no speed to gain there, and
    its replies stay nearer the fp32 model's: bench/numerics.py)."""
    return any(_cpu_blocks(m) for m in model.modules())


def _cpu_blocks(m: nn.Module) -> bool:
    """Whether m holds GGUF blocks on the CPU that the library's block products read."""
    return isinstance(m, BlockLinear) and not m.stored()[0].is_cuda or \
        isinstance(m, BlockExperts) and not m.gate_blocks.is_cuda


def weight_formats(model: nn.Module) -> dict[str, int]:
    """Bytes held per weight format ("Q4_K", "Q4_1", "float32", ...), each storage counted once
    (a head tied to its embedding shares its blocks)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(name: str, tensors):
        for t in tensors:
            if t is None or t.is_meta or t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            out[name] = out.get(name, 0) + t.untyped_storage().nbytes()

    for m in model.modules():
        if isinstance(m, BlockLinear):
            add(gguf_blocks.type_name(m.ggml_type), m.stored())
        elif isinstance(m, BlockEmbedding):
            add(gguf_blocks.type_name(m.ggml_type), m.stored())
        elif isinstance(m, BlockExperts):
            for ggml_type, blocks in zip(m.types, (m.gate_blocks, m.up_blocks, m.down_blocks)):
                add(gguf_blocks.type_name(ggml_type), [blocks])
        elif isinstance(m, PlanarExperts):  # (a dense half: a parameter, counted below)
            for half, kind in m.gguf_kinds().items():
                add(kind, [getattr(m, f"{half}_{name}") for name in ("words", "dd", "sm")])
        elif hasattr(m, "format_tensors"):  # hf_quant's linears: (format name, its tensors)
            name, tensors = m.format_tensors()
            add(name, tensors)
        elif isinstance(m, Int4Linear):
            add(getattr(m, "gguf_kind", "int4").upper(), [m.packed, m.scale_zero])
        elif isinstance(m, Q8Embedding):
            add("Q8_0", [m.codes, m.scale])
        elif isinstance(m, Q8Linear):
            add("Q8_0", [m.codes, m.scale] + ([m.hi.packed, m.hi.scale_zero, m.lo.packed, m.lo.scale_zero]
                                              if m.planes_built() else []))
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t.is_floating_point():
                add(str(t.dtype).replace("torch.", ""), [t])
    return out
