"""4-bit weights in 32-weight runs, row-major, for CUDA's run GEMVs (models/kernels/cuda/qruns.py):
GGUF Q4_K repacked at load as Q4KR; AWQ/GPTQ groups need no repack (their stored INT4 is already
runs). And each layout's torch oracle (the weights it encodes, in fp64). No kernel is imported
here, nor quant.py (which imports this file): a QWeight in gives the class of the QWeight out.

The runs: `data` uint8 [N, K/2], 16 bytes a run of 32 weights, byte l of run r of a row holding
the code of weight 32 r + l in its low nibble and of weight 32 r + 16 + l in its high one (the
stored INT4 of quant.QWeight; GGUF's Q4_0 block order). So the codes a 4-byte word holds in its
low nibbles (and in its high ones) meet four inputs in a row, and an int8 input in its natural
order is what the GEMV's DP4As take. The scales:
- INT4 (AWQ/GPTQ, G = the checkpoint's group, a multiple of 32): `scales` fp16 and `zeros` uint8
  [N, K/G] (weight = s (q - z)), as stored;
- Q4KR (Q4_K): `scales` fp16 [N, K/256, 2] = (d, dmin) per super-block and `zeros` uint8
  [N, K/32, 2] = (sc, m) per sub-block (weight = d sc q - dmin m, as Q4_K's): 4.625 bits a weight
  against Q4_K's 4.5 (its 6-bit scales and minima stored a byte each: none unpacked per run).
"""
from __future__ import annotations

import torch

from . import gguf_blocks
from .planar import _super_block_rows, k4_scales, one_storage, q4k_codes

__all__ = ["repack_q4k", "dequantize", "dequantize_rows", "one_storage", "codes"]


def _runs(codes: torch.Tensor) -> torch.Tensor:
    """codes [n, k] (0..15) → uint8 [n, k/2] in runs (byte 16 r + l: weight 32 r + l low, 32 r + 16 + l high)."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16).to(torch.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def codes(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The runs' codes: uint8 [n, k] in weight order."""
    return gguf_blocks.nibbles(data.reshape(n, k // 2), 16)


@_super_block_rows("Q4_K", "Q4KR")
def repack_q4k(qw):
    """GGUF Q4_K blocks ([N, K/256 * 144] uint8) → Q4KR. Any device; done once at load."""
    n, k = qw.n, qw.k
    b = qw.data.reshape(n * (k // 256), 144)
    dd, scm = k4_scales(b, n, k)
    return type(qw)("Q4KR", _runs(q4k_codes(b, n, k)), n, k, dd.contiguous(), scm, 32)


def dequantize(pw) -> torch.Tensor:
    """The fp64 [N, K] weights an INT4 or Q4KR QWeight encodes."""
    n, k = pw.n, pw.k
    q = codes(pw.data, n, k).double()
    if pw.fmt == "INT4":
        g = pw.group
        s = pw.scales.double().repeat_interleave(g, 1)
        z = pw.zeros.double().repeat_interleave(g, 1)
        return s * q - s * z
    dd = pw.scales.double().repeat_interleave(256, 1)  # [n, k, 2]
    sm = pw.zeros.double().repeat_interleave(32, 1)
    return dd[..., 0] * sm[..., 0] * q - dd[..., 1] * sm[..., 1]


def dequantize_rows(pw, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of an INT4 or Q4KR QWeight's weights (fp64)."""
    part = type(pw)(pw.fmt, pw.data[start:stop], stop - start, pw.k, pw.scales[start:stop], pw.zeros[start:stop],
                    pw.group)
    return dequantize(part)
