"""GGUF block layouts (the one place they are written down) and their dequantization in torch.

Contract: `dequantize(raw, ggml_type)` takes a tensor's blocks as stored (uint8 `[..., row bytes]`,
on any device) and returns fp32 `[..., row weights]` equal bit for bit to gguf-py's
`gguf.quants.dequantize`: the same single IEEE fp32 operations in the same order (no fused
multiply-add; each product and sum rounded once, as numpy does). tests/formats/test_gguf_blocks.py checks
every type on random blocks, extreme fp16 scales included.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Layout:
    name: str
    block: int  # weights per block
    bytes: int  # bytes per block


# GGMLQuantizationType value → layout (gguf.constants.GGML_QUANT_SIZES agrees: a test checks)
LAYOUTS: dict[int, Layout] = {
    0: Layout("F32", 1, 4), 1: Layout("F16", 1, 2), 30: Layout("BF16", 1, 2),
    2: Layout("Q4_0", 32, 2 + 16),              # d fp16, 16 bytes of nibbles (low: weights 0-15)
    3: Layout("Q4_1", 32, 2 + 2 + 16),          # d, m fp16, nibbles
    6: Layout("Q5_0", 32, 2 + 4 + 16),          # d, 32 high bits, nibbles
    7: Layout("Q5_1", 32, 2 + 2 + 4 + 16),      # d, m, 32 high bits, nibbles
    8: Layout("Q8_0", 32, 2 + 32),              # d, 32 int8
    12: Layout("Q4_K", QK_K, 2 + 2 + 12 + 128),  # d, dmin, 8 x (6-bit scale, 6-bit min), nibbles
    13: Layout("Q5_K", QK_K, 2 + 2 + 12 + 32 + 128),  # as Q4_K, then 32 bytes of high bits, nibbles
    14: Layout("Q6_K", QK_K, 128 + 64 + 16 + 2),  # low nibbles, 2-bit highs, 16 int8 scales, d
}
TYPES = {layout.name: value for value, layout in LAYOUTS.items()}


def type_name(ggml_type: int) -> str:
    layout = LAYOUTS.get(ggml_type)
    if layout is not None:
        return layout.name
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


def row_weights(ggml_type: int, row_bytes: int) -> int:
    layout = LAYOUTS[ggml_type]
    return row_bytes // layout.bytes * layout.block


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes → [n, 1] fp32 (exact: every fp16 value, subnormals included, is an fp32)."""
    return b.contiguous().view(torch.float16).float()


def _shifts(values, like: torch.Tensor, shape) -> torch.Tensor:
    return _shift_tensor(tuple(values), like.device, tuple(shape))


@functools.lru_cache(maxsize=None)
def _shift_tensor(values: tuple, device: torch.device, shape: tuple) -> torch.Tensor:
    """Made once per device: a copy from the host inside a CUDA graph's capture would fail."""
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, bytes] → [n, 2 bytes] as uint8: per run of `group` bytes, their low nibbles, then high."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts([0, 4], qs, (1, 1, 2, 1))
    return (q & 0x0F).reshape(n, -1)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: [n, 4] bytes (a little-endian uint32) → [n, 32] bits, weight j's bit j."""
    n = qh.shape[0]
    bits = qh.reshape(n, 4, 1) >> _shifts(list(range(8)), qh, (1, 1, 8))
    return (bits & 1).reshape(n, 32)


def _q4_0(b):
    d = _f16(b[:, :2])
    q = nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * nibbles(b[:, 4:], 16).float() + m


def _q5_0(b):
    d = _f16(b[:, :2])
    q = (nibbles(b[:, 6:], 16) | (_high_bits32(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = nibbles(b[:, 8:], 16) | (_high_bits32(b[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes → 8 six-bit scales and 8 six-bit minima (uint8 [n, 8] each)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _k_scales(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = scale_min_k4(b[:, 4:16])
    return (d * sc.float()).reshape(-1, 8, 1), (dmin * mn.float()).reshape(-1, 8, 1)


def _q4_k(b):
    d, dm = _k_scales(b)
    q = nibbles(b[:, 16:], 32).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, QK_K)


def q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [n, 176] → codes q uint8 [n, 8, 32] (0..31, sub-block by sub-block in weight
    order): weight = d sc q - dmin m of the sub-block (scale_min_k4)."""
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(list(range(8)), b, (1, 1, 8, 1))
    return nibbles(b[:, 48:], 32).reshape(n, 8, 32) | ((qh & 1).reshape(n, 8, 32) << 4)


def _q5_k(b):
    d, dm = _k_scales(b)
    return (d * q5_k_codes(b).float() - dm).reshape(-1, QK_K)


def q6_k_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [n, 210] → (codes q uint8 [n, 256] in weight order, 0..63; int8 scales [n, 16],
    one per 16 weights; d fp16 [n]): weight i = d scales[i // 16] (q[i] - 32)."""
    n = b.shape[0]
    ql = nibbles(b[:, :128], 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], b, (1, 1, 4, 1))
    q = (ql | ((qh & 3).reshape(n, 8, 32) << 4)).reshape(n, QK_K)
    return q, b[:, 192:208].contiguous().view(torch.int8), b[:, 208:210].contiguous().view(torch.float16)[:, 0]


def _q6_k(b):
    n = b.shape[0]
    q, scales, d = q6_k_codes(b)
    d = (d.float()[:, None] * scales.float()).reshape(n, 16, 1)
    return (d * (q.to(torch.int8) - 32).reshape(n, 16, 16).float()).reshape(n, QK_K)


def _f32(b):
    return b.contiguous().view(torch.float32).clone()


def _f16_all(b):
    return b.contiguous().view(torch.float16).float()


def _bf16(b):
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_DEQUANT = {0: _f32, 1: _f16_all, 30: _bf16, 2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0,
            12: _q4_k, 13: _q5_k, 14: _q6_k}


def dequantizes(ggml_type: int) -> bool:
    """Whether `dequantize` knows this type."""
    return ggml_type in _DEQUANT


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Blocks as stored, uint8 [..., row bytes] → fp32 [..., row weights], on raw's device."""
    if ggml_type not in _DEQUANT:
        raise ValueError(f"GGUF tensor type {type_name(ggml_type)} has no torch dequantizer")
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGUF blocks must be uint8, not {raw.dtype}")
    layout = LAYOUTS[ggml_type]
    if raw.shape[-1] % layout.bytes:
        raise ValueError(f"{layout.name}: a row of {raw.shape[-1]} bytes is not whole {layout.bytes}-byte blocks")
    w = _DEQUANT[ggml_type](raw.reshape(-1, layout.bytes))
    return w.reshape(*raw.shape[:-1], row_weights(ggml_type, raw.shape[-1]))
