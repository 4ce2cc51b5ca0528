"""GGUF 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) interleaved 16 rows at a time (the "rows16"
layout): what the C++ library's products on rounded inputs of those types read on the CPU
(models/kernels/cpu/rows16_int8.h states the layout and the kernels' contract). No kernel is
imported here.

Contract: `interleave(blocks, ggml_type)` takes a matrix's GGUF blocks [N, row bytes] uint8 (N a
multiple of 16: `fits`) and returns [N, row bytes] uint8, a new tensor of the same size: for group g
of 16 rows and block b, the 16 rows' fp16 scales, then (Q4_1, Q5_1) their 16 fp16 minimums, then
(Q5_0, Q5_1) their 16 words of fifth bits in the order the kernels take them (`_FIFTH`), then the
16 rows' code bytes four at a time: quad k holds, row after row, bytes 4k .. 4k + 3 of each row's
codes (Q8_0's with their sign bit flipped: unsigned, offset 128). `deinterleave` inverts it. `CODE`
is added to the GGUF type where the library is handed this layout (rows16_int8.h's kRows16), and
`WIDE` too where its inputs are rounded to 16 bits rather than 8.

Why not Q4_K: its fp16 scales come once a 256 weights (the 6-bit ones a 32, unpacked once a 256), so
its row-by-row products already read near the bandwidth; interleaved, its decode ran slower on both
instruction sets (bench/RESULTS.md, "The CPU step and its kernels").

Why: the row-by-row kernels spend most of a block's instructions on its scalar scales; with 16 rows
in the 32-bit lanes of one vector a dot product instruction takes four codes of each, and a decode
reads its weights nearer the machine's bandwidth (bench/cpu_block_bench.py --rows16,
bench/cpu_bench.py).
"""
from __future__ import annotations

import torch

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8  # GGMLQuantizationType
CODE = 128  # rows16_int8.h's kRows16
WIDE = 64  # + kWide: the products' inputs rounded to 16 bits (`cpu_int8: wide`)
ROWS = 16
# Per type, a block's fields before its codes (name, bytes) and its code bytes
_FIELDS = {Q4_0: (("d", 2),), Q4_1: (("d", 2), ("m", 2)), Q5_0: (("d", 2), ("qh", 4)),
           Q5_1: (("d", 2), ("m", 2), ("qh", 4)), Q8_0: (("d", 2),)}
_CODES = {Q4_0: 16, Q4_1: 16, Q5_0: 16, Q5_1: 16, Q8_0: 32}
TYPES = tuple(_FIELDS)
# the types every kernel set's plan interleaves (models/kernels/cpu/step.py rows16_types: Q8_0 only
# with VNNI's forms), so that what `cpu_int8: auto` chooses for a file does not depend on the CPU
EVERYWHERE = (Q4_0, Q4_1, Q5_0, Q5_1)

# The fifth bits' word: bit 8 i + k is code 4 k + i's (a low nibble's), bit 8 i + 4 + k code 16 + 4 k
# + i's (a high nibble's), so that for quad k one shift and mask of 16 rows' words put each of its
# bytes' fifth bits at bit 4 (rows16_int8.h)
_FIFTH = [0] * 32
for _i in range(4):
    for _k in range(4):
        _FIFTH[8 * _i + _k], _FIFTH[8 * _i + 4 + _k] = 4 * _k + _i, 16 + 4 * _k + _i
_UNFIFTH = [_FIFTH.index(j) for j in range(32)]


def fits(ggml_type: int, rows: int) -> bool:
    """Whether a matrix of this type and row count can be interleaved."""
    return ggml_type in TYPES and rows % ROWS == 0 and rows > 0


def block_bytes(ggml_type: int) -> int:
    return sum(n for _, n in _FIELDS[ggml_type]) + _CODES[ggml_type]


def _bits(words: torch.Tensor, order: list[int]) -> torch.Tensor:
    """4-byte little-endian words [..., 4] uint8 with their 32 bits taken in `order`."""
    bits = (words.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., 4, 8]
    bits = bits.reshape(*words.shape[:-1], 32)[..., order].reshape(*words.shape[:-1], 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def interleave(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The blocks [N, row bytes] in the rows16 layout (module docstring)."""
    if ggml_type not in TYPES:
        raise ValueError(f"interleave: GGUF type {ggml_type} has no rows16 layout (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 have)")
    size = block_bytes(ggml_type)
    n, rb = blocks.shape
    if not fits(ggml_type, n) or rb % size:
        raise ValueError(f"interleave: {n} rows of {rb} bytes are not whole 16-row groups of type {ggml_type} blocks")
    g, nb = n // ROWS, rb // size
    b = blocks.reshape(g, ROWS, nb, size).permute(0, 2, 1, 3)  # [G, nb, 16 rows, bytes]
    nc = _CODES[ggml_type]
    parts, at = [], 0
    for name, width in _FIELDS[ggml_type]:
        field = b[..., at:at + width]
        parts.append((_bits(field, _FIFTH) if name == "qh" else field).reshape(g, nb, width * ROWS))
        at += width
    codes = b[..., at:]
    if ggml_type == Q8_0:
        codes = codes ^ 0x80
    codes = codes.reshape(g, nb, ROWS, nc // 4, 4).transpose(2, 3)  # [G, nb, quad, row, 4 bytes]
    parts.append(codes.reshape(g, nb, nc * ROWS))
    return torch.cat(parts, dim=2).reshape(n, rb).contiguous()


def deinterleave(rows16: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The blocks again from their rows16 layout."""
    size = block_bytes(ggml_type)
    n, rb = rows16.shape
    g, nb = n // ROWS, rb // size
    t = rows16.reshape(g, nb, ROWS * size)
    nc = _CODES[ggml_type]
    parts, at = [], 0
    for name, width in _FIELDS[ggml_type]:
        field = t[..., at * ROWS:(at + width) * ROWS].reshape(g, nb, ROWS, width)
        parts.append(_bits(field, _UNFIFTH) if name == "qh" else field)
        at += width
    codes = t[..., at * ROWS:].reshape(g, nb, nc // 4, ROWS, 4).transpose(2, 3).reshape(g, nb, ROWS, nc)
    parts.append(codes ^ 0x80 if ggml_type == Q8_0 else codes)
    return torch.cat(parts, dim=3).permute(0, 2, 1, 3).reshape(n, rb).contiguous()
