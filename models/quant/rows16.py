"""Q4_0 / Q4_1 blocks interleaved 16 rows at a time (the "rows16" layout): what the C++ library's
int8 products of those types read on the CPU (models/kernels/cpu/rows16_int8.h states the layout
and the kernels' contract). No kernel is imported here.

Contract: `interleave(blocks, ggml_type)` takes a matrix's GGUF blocks [N, row bytes] uint8 (N a
multiple of 16: `fits`) and returns the same bytes rearranged, [N, row bytes] uint8, a new tensor:
for group g of 16 rows and block b, the 16 rows' fp16 scales, Q4_1's 16 fp16 minimums, then four
quads of the 16 rows' 4 code bytes; `deinterleave` inverts it. `CODE` is added to the GGUF type
where the library is handed this layout (rows16_int8.h's kRows16), and `WIDE` too where its inputs
are rounded to 16 bits rather than 8.

Why: the row-by-row kernels spend most of a block's instructions on its scalar scales; with 16 rows
in the 32-bit lanes of one vector a dot product instruction takes four codes of each, and a decode
of the embedded Q4_1 model reads its weights nearer the machine's bandwidth
(bench/cpu_block_bench.py --rows16, bench/cpu_bench.py).
"""
from __future__ import annotations

import torch

Q4_0, Q4_1 = 2, 3  # GGMLQuantizationType
CODE = 128  # rows16_int8.h's kRows16
WIDE = 64  # + kWide: the products' inputs rounded to 16 bits (`cpu_int8: wide`)
ROWS = 16
LAYOUT = {Q4_0: "Q40X16", Q4_1: "Q41X16"}  # the layouts' names in the kernel plan
_HEAD = {Q4_0: 2, Q4_1: 4}  # bytes of scale (and minimum) a block, before its 16 code bytes


def fits(ggml_type: int, rows: int) -> bool:
    """Whether a matrix of this type and row count can be interleaved."""
    return ggml_type in _HEAD and rows % ROWS == 0 and rows > 0


def interleave(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The blocks [N, row bytes] in the rows16 layout (module docstring)."""
    if ggml_type not in _HEAD:
        raise ValueError(f"interleave: GGUF type {ggml_type} has no rows16 layout (Q4_0 and Q4_1 have)")
    head = _HEAD[ggml_type]
    n, rb = blocks.shape
    if not fits(ggml_type, n) or rb % (head + 16):
        raise ValueError(f"interleave: {n} rows of {rb} bytes are not whole 16-row groups of type {ggml_type} blocks")
    g, nb = n // ROWS, rb // (head + 16)
    b = blocks.reshape(g, ROWS, nb, head + 16).permute(0, 2, 1, 3)  # [G, nb, 16 rows, bytes]
    parts = [b[..., 0:2].reshape(g, nb, 2 * ROWS)]  # the 16 scales
    if ggml_type == Q4_1:
        parts.append(b[..., 2:4].reshape(g, nb, 2 * ROWS))  # the 16 minimums
    codes = b[..., head:].reshape(g, nb, ROWS, 4, 4).transpose(2, 3)  # [G, nb, quad, row, 4 bytes]
    parts.append(codes.reshape(g, nb, 16 * ROWS))
    return torch.cat(parts, dim=2).reshape(n, rb).contiguous()


def deinterleave(rows16: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The blocks again from their rows16 layout."""
    head = _HEAD[ggml_type]
    n, rb = rows16.shape
    g, nb = n // ROWS, rb // (head + 16)
    t = rows16.reshape(g, nb, ROWS * (head + 16))
    parts = [t[..., :2 * ROWS].reshape(g, nb, ROWS, 2)]
    if ggml_type == Q4_1:
        parts.append(t[..., 2 * ROWS:4 * ROWS].reshape(g, nb, ROWS, 2))
    parts.append(t[..., head * ROWS:].reshape(g, nb, 4, ROWS, 4).transpose(2, 3).reshape(g, nb, ROWS, 16))
    return torch.cat(parts, dim=3).permute(0, 2, 1, 3).reshape(n, rb).contiguous()
