"""4- and 5-bit weights in 32-weight runs, row-major, for CUDA's run GEMVs (models/kernels/cuda/qruns.py):
GGUF Q4_K repacked at load as Q4KR, Q5_0 and Q5_1 as Q50R and Q51R; AWQ/GPTQ groups need no repack
(their stored INT4 is already runs). And each layout's torch oracle (the weights it encodes, in
fp64). No kernel is imported here, nor layers.py (which imports this file): a QWeight in gives the
class of the QWeight out.

The runs: `data` uint8 [N, K/2], 16 bytes a run of 32 weights, byte l of run r of a row holding
the code of weight 32 r + l in its low nibble and of weight 32 r + 16 + l in its high one (the
stored INT4 of quant.QWeight; GGUF's Q4_0 block order). So the codes a 4-byte word holds in its
low nibbles (and in its high ones) meet four inputs in a row, and an int8 input in its natural
order is what the GEMV's DP4As take. The scales:
- INT4 (AWQ/GPTQ, G = the checkpoint's group, a multiple of 32): `scales` fp16 and `zeros` uint8
  [N, K/G] (weight = s (q - z)), as stored;
- Q4KR (Q4_K): `scales` fp16 [N, K/256, 2] = (d, dmin) per super-block and `zeros` uint8
  [N, K/32, 2] = (sc, m) per sub-block (weight = d sc q - dmin m, as Q4_K's): 4.625 bits a weight
  against Q4_K's 4.5 (its 6-bit scales and minima stored a byte each: none unpacked per run);
- Q50R / Q51R (Q5_0 / Q5_1, whose blocks are runs already: a block's 16 code bytes are a run's
  low four bits as above): `scales` fp16 [N, K/32] = d (Q50R: weight = d (q - 16)) or [N, K/32, 2]
  = (d, m) (Q51R: weight = d q + m), and `zeros` int32 [N, K/32] = the block's fifth bits (bit j:
  weight 32 r + j's): 5.5 and 6 bits a weight, as the blocks (22 and 24 bytes apart, unaligned,
  here each part in its own aligned array).
"""
from __future__ import annotations

import torch

from ..formats import gguf_blocks
from .planar import _super_block_rows, k4_scales, one_storage, q4k_codes

__all__ = ["repack_q4k", "repack_q5", "FIVE_BIT", "REPACKED", "dequantize", "dequantize_rows", "one_storage", "codes"]


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


# GGUF 5-bit block types → their runs layout
FIVE_BIT = {"Q5_0": "Q50R", "Q5_1": "Q51R"}
# Every layout GGUF blocks are repacked into here (Q4_K's, then the 5-bit types'), in the order of
# the kernels' FMT constants after INT4's (models/kernels/cuda/qruns.py: FMTS)
REPACKED = ("Q4KR", *FIVE_BIT.values())


def repack_q5(qw):
    """GGUF Q5_0 or Q5_1 blocks ([N, K/32 * 22 or 24] uint8) → Q50R or Q51R. Any device; once at load."""
    if qw.fmt not in FIVE_BIT or qw.k % 32:
        raise ValueError(f"Q50R / Q51R take Q5_0 or Q5_1 rows of whole blocks ({qw.fmt}, {qw.k} weights)")
    n, runs = qw.n, qw.k // 32
    one = qw.fmt == "Q5_1"  # (its minimum m after d)
    b = qw.data.reshape(n, runs, 24 if one else 22)
    head = 4 if one else 2
    scales = b[:, :, :head].contiguous().view(torch.float16).reshape(n, runs, 2) if one else \
        b[:, :, :2].contiguous().view(torch.float16).reshape(n, runs)
    high = b[:, :, head:head + 4].contiguous().view(torch.int32).reshape(n, runs)
    data = b[:, :, head + 4:].contiguous().reshape(n, runs * 16)
    return type(qw)(FIVE_BIT[qw.fmt], data, n, qw.k, scales, high, 32)


def _fifth_bits(high: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [n, K/32] → [n, K] of 0 or 16: bit j of a run's word, weight 32 r + j's fifth bit."""
    shifts = torch.arange(32, device=high.device, dtype=torch.int64)
    return ((high.long()[:, :, None] >> shifts) & 1).reshape(high.shape[0], k) * 16


def dequantize(pw) -> torch.Tensor:
    """The fp64 [N, K] weights an INT4, Q4KR, Q50R or Q51R QWeight encodes."""
    n, k = pw.n, pw.k
    q = codes(pw.data, n, k).double()
    if pw.fmt in ("Q50R", "Q51R"):
        q = q + _fifth_bits(pw.zeros, k).double()
        if pw.fmt == "Q50R":
            return pw.scales.double().repeat_interleave(32, 1) * (q - 16)
        dm = pw.scales.double().repeat_interleave(32, 1)  # [n, k, 2]
        return dm[..., 0] * q + dm[..., 1]
    if pw.fmt == "INT4":
        g = pw.group
        s = pw.scales.double().repeat_interleave(g, 1)
        z = pw.zeros.double().repeat_interleave(g, 1)
        return s * q - s * z
    dd = pw.scales.double().repeat_interleave(256, 1)  # [n, k, 2]
    sm = pw.zeros.double().repeat_interleave(32, 1)
    return dd[..., 0] * sm[..., 0] * q - dd[..., 1] * sm[..., 1]


def dequantize_rows(pw, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of an INT4, Q4KR, Q50R or Q51R QWeight's weights (fp64)."""
    part = type(pw)(pw.fmt, pw.data[start:stop], stop - start, pw.k, pw.scales[start:stop], pw.zeros[start:stop],
                    pw.group)
    return dequantize(part)
