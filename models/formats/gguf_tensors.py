"""A GGUF file's quantized tensors as the loader reads them, before any module holds them: a
matrix's blocks as stored (`GgufTensor`, a view of the file's mapped pages), Q4_0 / Q4_1 / Q8_0
decoded to codes and block scales (`QuantTensor`, for the int4 kernel's layout), a layer's routed
experts (`GgufExperts`), which types stay quantized on the CPU (`keeps`), and the release of mapped
pages a load has copied (`release_pages`). Nothing here computes a forward: models/quant builds
the modules from these."""
from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from . import gguf_blocks

GROUP = 32  # weights per GGUF block, and the int4 kernel's group size
_Q4_TYPES = {2: "q4_0", 3: "q4_1"}  # GGMLQuantizationType values
_Q8_0 = 8
_PACK_ROWS = 2048  # rows packed at a time at load (a multiple of the packer's row tile)
_TILE_ROWS = 64
PACK_ROW_MULTIPLE = 16  # torch's int4 packer takes whole 16-row groups (_convert_weight_to_int4pack_for_cpu)


@dataclass
class QuantTensor:
    """A GGUF-quantized matrix decoded to codes and per-block scale/zero: w = codes * scale + zero
    (after `q - 8` re-centring for the kernel). codes uint8 [N, K]; scale, zero float32 [N, K/32]."""
    kind: str
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.codes.shape)

    def permute_rows(self, fn) -> "QuantTensor":
        return QuantTensor(self.kind, fn(self.codes), fn(self.scale), fn(self.zero))

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.reshape(n, k // GROUP, GROUP).astype(np.float32) * self.scale[..., None] + self.zero[..., None]
        return torch.from_numpy(w.reshape(n, k)).to(dtype)


# GGMLQuantizationType values BlockLinear / BlockEmbedding keep as stored
BLOCK_TYPES = frozenset(gguf_blocks.TYPES[n] for n in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))


def keeps(ggml_type: int) -> bool:
    """Whether a GGUF tensor type stays quantized on the CPU path."""
    return ggml_type in _Q4_TYPES or ggml_type == _Q8_0 or ggml_type in BLOCK_TYPES


def kept_types() -> list[int]:
    return sorted(set(_Q4_TYPES) | {_Q8_0} | BLOCK_TYPES)


@dataclass
class GgufTensor:
    """A GGUF matrix's blocks as stored: raw uint8 [N, row bytes] (a view of the file's mapped
    pages: nothing is read until used) and its GGMLQuantizationType value."""
    ggml_type: int
    raw: np.ndarray

    @property
    def shape(self) -> torch.Size:
        """[rows, row weights], or [experts, rows, row weights] for a 3D expert tensor."""
        return torch.Size((*self.raw.shape[:-1], gguf_blocks.row_weights(self.ggml_type, self.raw.shape[-1])))

    @property
    def kind(self) -> str:
        return gguf_blocks.type_name(self.ggml_type).lower()

    def permute_rows(self, fn) -> "GgufTensor":
        """Rows reordered (each row is whole blocks, so this is exact); the moved rows are copied."""
        return GgufTensor(self.ggml_type, fn(self.raw))

    def blocks(self) -> torch.Tensor:
        """The raw blocks as a uint8 tensor over the same memory (no copy)."""
        return torch.from_numpy(self.raw)

    def decoded(self) -> QuantTensor:
        """Q4_0 / Q4_1 / Q8_0 as codes and block scales (for the int4 kernel's layout)."""
        return decode(self.raw, self.ggml_type)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return gguf_blocks.dequantize(self.blocks(), self.ggml_type).to(dtype)


_MADV_PAGEOUT = 21  # (Linux 5.4+: reclaim these pages now; a private page written to goes to swap, never lost)


def release_pages(raw: np.ndarray) -> None:
    """The mapped file pages under `raw` handed back to the kernel, where the load has copied
    them into a module of its own (the int4 kernel's layout, a Q8_0 table's codes) and nothing
    reads them again: they count in the process's resident set until then, so the load's peak
    would hold the file's pages and their copies at once (bench/load_rss.py). A no-op for arrays
    that are not over a file mapping, and where the kernel or libc does not know the advice."""
    base = raw
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or not raw.flags.c_contiguous or raw.nbytes == 0:
        return
    start = -(-raw.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE  # (whole pages inside the array only)
    end = (raw.ctypes.data + raw.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and _libc() is not None:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def decode(raw: np.ndarray, ggml_type: int) -> QuantTensor:
    """Raw GGUF blocks [N, bytes per row] → QuantTensor (no fp32 copy of the matrix is made)."""
    n = raw.shape[0]
    if ggml_type == _Q8_0:  # d fp16, 32 × int8
        b = raw.reshape(n, -1, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = b[..., 2:].copy().view(np.int8).reshape(n, -1)
        return QuantTensor("q8_0", codes, d, np.zeros_like(d))
    width = 18 if ggml_type == 2 else 20  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes
    b = raw.reshape(n, -1, width)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if width == 20 else None
    qs = b[..., width - 16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # low nibbles first
    zero = -8.0 * d if m is None else m  # Q4_0 stores q - 8
    return QuantTensor(_Q4_TYPES[ggml_type], codes, d, zero)


@dataclass
class GgufExperts:
    """A layer's routed experts as a GGUF stores them: gate, up [E, I, H] and down [E, H, I] in
    blocks (each a view of the file's mapped pages), to become one BlockExperts module."""
    gate: GgufTensor
    up: GgufTensor
    down: GgufTensor

    def numel(self) -> int:
        return sum(int(np.prod(t.shape)) for t in (self.gate, self.up, self.down))
