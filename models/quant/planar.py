"""Weights repacked at load for CUDA's planar dequant-GEMVs (models/kernels/cuda/qplanar.py, which
describes the layouts): AWQ/GPTQ 4-bit groups as INT4P, GGUF Q4_K as Q4KP, Q6_K as Q6KP and Q5_K
as Q5KP, and each layout's torch oracle (the weights it encodes, in fp64). No kernel is imported
here, nor layers.py (which imports this file): a QWeight in gives the class
of the QWeight out.

The layouts hold the codes (Q6KP and Q5KP: their low four bits) the same way: per group of G
weights (G = the checkpoint's group for INT4P, the 32-weight sub-block for Q4KP and Q5KP, the
16-weight one for Q6KP), int32 word m holds in nibble j the code of weight
G/8 j + m, and rows are interleaved by ROWS: `data` [ceil(N/ROWS), K/8, ROWS], row n's word at
[n // ROWS, m, n % ROWS]. They differ in the scales:
- INT4P: `scales` fp16 [ceil(N/ROWS), K/G, 1, ROWS] = s and `zeros` uint8 [ceil(N/ROWS), K/G, 1,
  ROWS] = z per group (weight = s (q - z)), the checkpoint's own: 4.19 bits a weight at G = 128;
- Q4KP: `scales` fp16 [ceil(N/ROWS), K/256, 2, ROWS] = (d, dmin) per super-block and `zeros`
  uint8 [ceil(N/ROWS), K/32, 2, ROWS] = (sc, m) per sub-block (weight = d sc q - dmin m, as
  Q4_K's), 4.625 bits a weight against Q4_K's 4.5;
- Q6KP (G = 16, Q6_K's sub-block): the words hold the low four bits of each 6-bit code q, and
  `data` goes on with K/16 more word positions, one a group, holding its high two bits: for word
  m (0, 1) and nibble j, bits 4 m + 8 (j // 2) + 2 (j % 2) .. + 1 (so a word's even and odd
  nibbles' high bits are bytes of (h >> 4 m) & 0x03030303 and (h >> 4 m + 2) & 0x03030303);
  `scales` fp16 [ceil(N/ROWS), K/256, 1, ROWS] = d per super-block and `zeros` [ceil(N/ROWS),
  K/16, 1, ROWS] = the int8 sc per group, its bits as uint8 (weight = d sc (q - 32), as Q6_K's):
  6.5625 bits a weight, as Q6_K;
- Q5KP (G = 32, Q5_K's sub-block): as Q6KP with one high bit a code, at bit 2 m + 8 (j // 2) +
  j % 2 of the group's high word, and Q4KP's scales (Q5_K's are Q4_K's): 5.625 bits a weight
  against Q5_K's 5.5.
"""
from __future__ import annotations

import functools

import torch

from ..formats import gguf_blocks

ROWS = 4  # rows interleaved
# Rows repacked at a time (a multiple of ROWS): the repack's int32 and int64 temporaries are several
# times a matrix's codes, ~15 GB at once for a 27B-like model's Q6_K LM head [248320, 5120]
CHUNK_ROWS = 8192
ALIGN = 16  # bytes: where one_storage starts each tensor (the kernels' loads assume 16-byte aligned bases)


def _words(codes: torch.Tensor, n: int, k: int, g: int) -> torch.Tensor:
    """codes [n, k] (0..15) → the interleaved words [ceil(n/ROWS), k/8, ROWS] int32."""
    c = codes.reshape(n, k // g, 8, g // 8).to(torch.int32)  # [n, group, j, m]: weight g/8 j + m
    shifts = (4 * torch.arange(8, device=c.device, dtype=torch.int32)).reshape(1, 1, 8, 1)
    words = (c << shifts).sum(2, dtype=torch.int64)  # the nibbles are disjoint: the sum is their OR
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).reshape(n, k // 8)
    words = torch.nn.functional.pad(words, (0, 0, 0, -n % ROWS))
    return words.reshape(-1, ROWS, k // 8).transpose(1, 2).contiguous()


def _interleave(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, groups, c] → [ceil(n/ROWS), groups, c, ROWS]."""
    t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, -n % ROWS))
    return t.reshape(-1, ROWS, *t.shape[1:]).permute(0, 2, 3, 1).contiguous()


def _uninterleave(t: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(n/ROWS), groups, c, ROWS] → [n, groups, c]."""
    return t.permute(0, 3, 1, 2).reshape(-1, *t.shape[1:3])[:n]


def _codes(data: torch.Tensor, n: int, k: int, g: int) -> torch.Tensor:
    """The interleaved words → codes [n, k/g, 8, g/8] (j, m: weight g/8 j + m of each group)."""
    w = data.transpose(1, 2).reshape(-1, k // 8)[:n].reshape(n, k // g, 1, g // 8)
    shifts = (4 * torch.arange(8, device=w.device, dtype=torch.int32)).reshape(1, 1, 8, 1)
    return (w >> shifts) & 15


def _high_shifts(g: int, hb: int, device) -> torch.Tensor:
    """[1, 1, 8, g/8] int32 (j, m): where weight g/8 j + m's hb high bits sit in its group's high
    word, bit 2 hb m + 8 (j // 2) + hb (j % 2)."""
    j = torch.arange(8, device=device, dtype=torch.int32).reshape(1, 1, 8, 1)
    m = torch.arange(g // 8, device=device, dtype=torch.int32).reshape(1, 1, 1, g // 8)
    return 2 * hb * m + 8 * (j // 2) + hb * (j % 2)


def _high_words(h: torch.Tensor, n: int, k: int, g: int, hb: int) -> torch.Tensor:
    """The codes' high bits h [n, k] (hb a code) → one word a group of g weights, interleaved
    [ceil(n/ROWS), k/g, ROWS], each weight's bits where _high_shifts puts them."""
    h = h.reshape(n, k // g, 8, g // 8)
    hw = (h << _high_shifts(g, hb, h.device)).sum((2, 3), dtype=torch.int64)  # disjoint bits: the sum is their OR
    hw = torch.where(hw >= 2 ** 31, hw - 2 ** 32, hw).to(torch.int32)
    return torch.nn.functional.pad(hw, (0, 0, 0, -n % ROWS)).reshape(-1, ROWS, k // g).transpose(1, 2)


def _high_bits(pw, g: int, hb: int) -> torch.Tensor:
    """The high bits of a Q6KP / Q5KP QWeight's codes: [N, K/g, 8, g/8] (j, m: weight g/8 j + m)."""
    n, k = pw.n, pw.k
    hw = pw.data[:, k // 8:].transpose(1, 2).reshape(-1, k // g)[:n].reshape(n, k // g, 1, 1)
    return (hw >> _high_shifts(g, hb, hw.device)) & ((1 << hb) - 1)


def one_storage(pw):
    """pw with its data, scales and zeros as views of one uint8 buffer (each part starting at a
    multiple of ALIGN bytes): one allocation a linear, not three. A caching allocator rounds each
    allocation up, and thousands of small scale tensors held more than their bytes (the 27B-like
    shape in AWQ: bench/quant_bench.py's held GB)."""
    parts = [t.contiguous() for t in (pw.data, pw.scales, pw.zeros) if t is not None]
    starts, size = [], 0
    for t in parts:
        starts.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(size, dtype=torch.uint8, device=pw.data.device)
    views = []
    for t, at in zip(parts, starts):
        v = buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        views.append(v.copy_(t))
    data, scales, zeros = views + [None] * (3 - len(views))
    return type(pw)(pw.fmt, data, pw.n, pw.k, scales, zeros, pw.group)


def repack_int4p(qw):
    """INT4 as stored (byte 16r + l: weight 32r + l low, 32r + 16 + l high) → INT4P. Any device;
    done once at load."""
    if qw.fmt != "INT4" or qw.group % 8 or qw.k % qw.group:
        raise ValueError(f"INT4P takes INT4 weights in whole groups of a multiple of 8 ({qw.fmt}, group {qw.group})")
    n, k, g = qw.n, qw.k, qw.group
    codes = gguf_blocks.nibbles(qw.data.reshape(n, k // 2), 16)  # (the runs: Q4_0's order)
    return type(qw)("INT4P", _words(codes, n, k, g), n, k, _interleave(qw.scales.half()[..., None], n),
                    _interleave(qw.zeros.to(torch.uint8)[..., None], n), g)


def dequantize_int4p(pw) -> torch.Tensor:
    """The fp64 [N, K] weights an INT4P QWeight encodes."""
    n, k, g = pw.n, pw.k, pw.group
    codes = _codes(pw.data, n, k, g).double()
    s = _uninterleave(pw.scales, n)[..., 0].double()[:, :, None, None]
    z = _uninterleave(pw.zeros, n)[..., 0].double()[:, :, None, None]
    return (s * codes - s * z).reshape(n, k)


def _by_rows(repack, qw):
    """repack(qw) CHUNK_ROWS rows at a time (each row block is repacked on its own): the same
    tensors, with the temporaries of one chunk at a time."""
    parts = [repack(type(qw)(qw.fmt, qw.data[i:i + CHUNK_ROWS], min(CHUNK_ROWS, qw.n - i), qw.k))
             for i in range(0, qw.n, CHUNK_ROWS)]
    first = parts[0]
    return type(qw)(first.fmt, torch.cat([p.data for p in parts]), qw.n, qw.k,
                    torch.cat([p.scales for p in parts]), torch.cat([p.zeros for p in parts]), first.group)


def _super_block_rows(fmt: str, layout: str):
    """A GGUF K-quant repack, checked (`fmt` rows of whole super-blocks, else ValueError) and run
    CHUNK_ROWS rows at a time (_by_rows) where the matrix has more."""
    def wrap(repack):
        @functools.wraps(repack)
        def checked(qw):
            if qw.fmt != fmt or qw.k % 256:
                raise ValueError(f"{layout} takes {fmt} rows of whole super-blocks ({qw.fmt}, {qw.k} weights)")
            return _by_rows(repack, qw) if qw.n > CHUNK_ROWS else repack(qw)
        return checked
    return wrap


def k4_scales(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's scales from their blocks b (a row per super-block), row by row: (d, dmin)
    fp16 [n, K/256, 2] per super-block and (sc, m) uint8 [n, K/32, 2] per 32-weight sub-block."""
    dd = b[:, :4].contiguous().view(torch.float16).reshape(n, k // 256, 2)
    sc, mn = gguf_blocks.scale_min_k4(b[:, 4:16])  # [n * supers, 8] each
    return dd, torch.stack([sc, mn], -1).reshape(n, k // 32, 2)


def _k4_scales(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k4_scales, rows interleaved."""
    dd, scm = k4_scales(b, n, k)
    return _interleave(dd, n), _interleave(scm, n)


def q4k_codes(b: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q4_K's codes uint8 [n, k] in weight order, from its blocks b (a row per super-block)."""
    return gguf_blocks.nibbles(b[:, 16:], 32).reshape(n, k)  # per pair of sub-blocks: low nibbles the first, high the second


@_super_block_rows("Q4_K", "Q4KP")
def repack_q4k(qw):
    """GGUF Q4_K blocks ([N, K/256 * 144] uint8) → Q4KP. Any device; done once at load."""
    n, k = qw.n, qw.k
    b = qw.data.reshape(n * (k // 256), 144)
    return type(qw)("Q4KP", _words(q4k_codes(b, n, k), n, k, 32), n, k, *_k4_scales(b, n, k), 32)


def _k4_weights(pw, codes: torch.Tensor) -> torch.Tensor:
    """The fp64 [N, K] weights d sc q - dmin m of a Q4KP or Q5KP QWeight (both hold Q4KP's
    scales), its codes q given: `codes` [N, K/32, 8, 4] (j, m: weight 4 j + m of each sub-block)."""
    n, k = pw.n, pw.k
    dd = _uninterleave(pw.scales, n).double().repeat_interleave(8, 1)  # [n, sub-blocks, 2]
    sm = _uninterleave(pw.zeros, n).double()
    s, off = dd[..., 0] * sm[..., 0], dd[..., 1] * sm[..., 1]
    return (s[:, :, None, None] * codes.double() - off[:, :, None, None]).reshape(n, k)


def dequantize_q4kp(pw) -> torch.Tensor:
    """The fp64 [N, K] weights a Q4KP QWeight encodes (d sc q - dmin m, as gguf_blocks' Q4_K)."""
    return _k4_weights(pw, _codes(pw.data, pw.n, pw.k, 32))


@_super_block_rows("Q6_K", "Q6KP")
def repack_q6k(qw):
    """GGUF Q6_K blocks ([N, K/256 * 210] uint8) → Q6KP. Any device; done once at load."""
    n, k = qw.n, qw.k
    q, sc, d = gguf_blocks.q6_k_codes(qw.data.reshape(n * (k // 256), 210))
    q = q.reshape(n, k).to(torch.int32)
    data = torch.cat([_words(q & 15, n, k, 16), _high_words(q >> 4, n, k, 16, 2)], 1).contiguous()
    return type(qw)("Q6KP", data, n, k, _interleave(d.reshape(n, k // 256, 1), n),
                    _interleave(sc.view(torch.uint8).reshape(n, k // 16, 1), n), 16)


def q6kp_codes(pw) -> torch.Tensor:
    """The 6-bit codes a Q6KP QWeight holds: [N, K/16, 8, 2] (j, m: weight 2 j + m of each group)."""
    n, k = pw.n, pw.k
    return _codes(pw.data[:, :k // 8], n, k, 16) | (_high_bits(pw, 16, 2) << 4)


def dequantize_q6kp(pw) -> torch.Tensor:
    """The fp64 [N, K] weights a Q6KP QWeight encodes (d sc (q - 32), as gguf_blocks' Q6_K)."""
    n, k = pw.n, pw.k
    d = _uninterleave(pw.scales, n).double().repeat_interleave(16, 1)  # [n, groups, 1]
    sc = _uninterleave(pw.zeros, n).view(torch.int8).double()
    s = (d * sc)[..., None]  # [n, groups, 1, 1]
    return (s * (q6kp_codes(pw).double() - 32)).reshape(n, k)


@_super_block_rows("Q5_K", "Q5KP")
def repack_q5k(qw):
    """GGUF Q5_K blocks ([N, K/256 * 176] uint8) → Q5KP. Any device; done once at load."""
    n, k = qw.n, qw.k
    b = qw.data.reshape(n * (k // 256), 176)
    q = gguf_blocks.q5_k_codes(b).reshape(n, k).to(torch.int32)
    return type(qw)("Q5KP", torch.cat([_words(q & 15, n, k, 32), _high_words(q >> 4, n, k, 32, 1)], 1).contiguous(),
                    n, k, *_k4_scales(b, n, k), 32)


def dequantize_q5kp(pw) -> torch.Tensor:
    """The fp64 [N, K] weights a Q5KP QWeight encodes (d sc q - dmin m, as gguf_blocks' Q5_K)."""
    n, k = pw.n, pw.k
    return _k4_weights(pw, _codes(pw.data[:, :k // 8], n, k, 32) | (_high_bits(pw, 32, 1) << 4))


def dequantize_planar_rows(pw, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of a Q4KP, Q6KP or Q5KP QWeight's weights (fp64), decoding only the row
    blocks that hold them (another layout: KeyError)."""
    b0, b1 = start // ROWS, -(-stop // ROWS)
    part = type(pw)(pw.fmt, pw.data[b0:b1], (b1 - b0) * ROWS, pw.k, pw.scales[b0:b1], pw.zeros[b0:b1], pw.group)
    full = {"Q4KP": dequantize_q4kp, "Q6KP": dequantize_q6kp, "Q5KP": dequantize_q5kp}[pw.fmt](part)
    return full[start - b0 * ROWS:stop - b0 * ROWS]
