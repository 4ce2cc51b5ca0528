"""Quantized weights for the kernel tests: AWQ-like int4 linears and GGUF matrices and experts as
the loader holds them, their repacks, and the tolerance of a product against the dequantized one."""
from __future__ import annotations

import os

import torch

from models.quant import hf_layers
from tests.support.paths import ROOT


# the layout PlanarExperts repacks each GGUF type of an experts' half into (others stay dense)
PLANAR_LAYOUTS = {"Q4_K": "Q4KP", "Q5_K": "Q5KP", "Q6_K": "Q6KP"}


def product_and_tolerance(xd, w, b, swiglu, dtype):
    """(x @ W^T + b in fp64, SwiGLU'd over the row halves where `swiglu`; the module's tolerance
    for an output of `dtype`: 1e-5 of |x| @ |W|^T (+ |b|), carried through the SwiGLU, and 2^-8 of
    |ref| more for bf16)."""
    ref = xd @ w.t() + (b.double() if b is not None else 0)
    scale = xd.abs() @ w.abs().t() + (b.double().abs() if b is not None else 0)
    if swiglu:
        half = w.shape[0] // 2
        g, u = ref[:, :half], ref[:, half:]
        ref = g / (1 + torch.exp(-g)) * u
        scale = scale[:, :half] * (1 + u.abs()) + scale[:, half:] * (1 + g.abs())
    return ref, 1e-5 * scale + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)


def int4_linear(n, k, group, seed, device):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g)
    return hf_layers.GroupInt4Linear("AWQ", packed, scales, zeros, group).to(device)


def gguf_weight(fmt, n, k, seed, device):
    """(QWeight of random `fmt` (Q4_K, Q5_K or Q6_K) blocks with the benchmarks' scales, its fp64 oracle
    weights)."""
    import sys
    from models.formats import gguf_blocks
    from models.quant.layers import QWeight
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from shapes import _random_blocks
    raw = _random_blocks(fmt, n, k, "cpu", torch.Generator().manual_seed(seed))
    return QWeight(fmt, raw.to(device), n, k), gguf_blocks.dequantize(raw, gguf_blocks.TYPES[fmt]).double()


def gguf_repack(fmt):
    from models.quant import planar
    return {"Q4_K": planar.repack_q4k, "Q5_K": planar.repack_q5k, "Q6_K": planar.repack_q6k}[fmt]


def gguf_experts(E, I, H, down_type="Q4_K", seed=0, gate_type="Q4_K", up_type=None):
    """A layer's routed experts as a GGUF stores them (gguf_tensors.GgufExperts): gate and up [E, I, H]
    in `gate_type` (up in `up_type` where given), down [E, H, I] in `down_type` (K-quants: Q6_K as a Q4_K_M file's down experts;
    or Q8_0, gguf-py's quantization of random weights)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, quants

    from models.formats import gguf_tensors
    from tests.support.tiny_gguf import random_k_blocks

    def t(qtype, rows, cols, s):
        if qtype == Q.Q8_0:
            w = np.random.default_rng(seed + s).normal(0, 0.05, (E * rows, cols)).astype(np.float32)
            raw = quants.quantize(w, qtype)
        else:
            raw = random_k_blocks(qtype, E * rows, cols, 0.05, seed=seed + s)
        return gguf_tensors.GgufTensor(int(qtype), raw.reshape(E, rows, -1))
    return gguf_tensors.GgufExperts(t(Q[gate_type], I, H, 0), t(Q[up_type or gate_type], I, H, 1),
                                    t(Q[down_type], H, I, 2))


def weight(kind, n, k, seed, device, group=128):
    """(an INT4, Q4KR, Q50R or Q51R QWeight, its fp64 weights): AWQ's stored INT4 in groups of
    `group`, or random Q4_K, Q5_0 or Q5_1 blocks repacked."""
    from models.quant import runs
    if kind == "INT4":
        lin = int4_linear(n, k, group, seed, device)
        return lin.qweight(), lin.dequantize(torch.float64)
    if kind in ("Q50R", "Q51R"):
        qw, ref = gguf_weight("Q5_0" if kind == "Q50R" else "Q5_1", n, k, seed, device)
        return runs.repack_q5(qw), ref.to(device)
    qw, ref = gguf_weight("Q4_K", n, k, seed, device)
    return runs.repack_q4k(qw), ref.to(device)
