"""GGUF blocks for the tests of the CPU library's block products and the quantized layers: random
blocks of each type with extreme fp16 scales, tiny GGUF files of a type mix (Q4_K_M's), a CPU
session on them and its decode logits, input rows as the int8 path rounds them."""
from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

import models


QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# byte offsets of each type's fp16 fields within a block
FP16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2],
           Q.Q5_K: [0, 2], Q.Q6_K: [208]}
EXTREMES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00],
                    dtype=np.uint16)  # 0, -0, subnormals, min normal, ±max, ±1


def random_blocks(qtype, rows, blocks_per_row, seed):
    """Random bytes, with each fp16 field a finite value: mostly random, the extremes in every row."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        h = rng.integers(0, 1 << 16, (rows, blocks_per_row), dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h)  # inf/nan → finite
        k = min(len(EXTREMES), blocks_per_row)
        h[:, :k] = np.roll(EXTREMES, seed)[:k]
        raw[:, :, at:at + 2] = h.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * size)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows are whole 256-weight blocks


def tiny_gguf(tmp_path, kind, linear, types=None, embed=Q.Q8_0):
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf
    name = f"{kind}-{linear.name}-{embed.name}.gguf"
    return write_gguf(kind, str(tmp_path / name), hf_model(kind, **SIZES), linear, types, embed)


# llama.cpp's Q4_K_M mix: attn_v and ffn_down in Q6_K (half the layers; all of them here), the rest Q4_K
Q4_K_M = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K}


def cpu_session(lm, kernel):
    from engine.session import DecodeSession
    return DecodeSession(lm.model, max_context=256, device=torch.device("cpu"), dtype=torch.float32, cpu_kernel=kernel)


def step_logits(lm, kernel):
    """A 37-token prefill, then eight one-token steps' logits."""
    s = cpu_session(lm, kernel)
    s.prefill(list(range(3, 40)))
    return torch.stack([s.step(t)[-1] for t in [5, 9, 200, 7, 7, 31, 4, 100]])


def rounded(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x~ in fp64, from x [T, K] fp32 (each division a tensor's: correctly rounded, as C++'s)."""
    if qtype in K_QUANTS:
        g = x.float().reshape(x.shape[0], -1, 256)
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # (argmax: the first of equals)
        nz = m != 0
        iscale = torch.where(nz, torch.full_like(m, -127.0) / torch.where(nz, m, 1.0), 0.0)
        q = torch.round(iscale * g).clamp(max=127)
        d = torch.where(nz, torch.ones_like(m) / torch.where(nz, iscale, 1.0), 0.0)
        return (q.double() * d.double()).reshape(x.shape)
    q, d = blocks32(x)
    return (q.double() * d.half().double()).reshape(x.shape)


def inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with a block of zeros, one of large and one of tiny values, and one a single
    nonzero input."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 0:32] = 0
    x[:, 32:64] *= 1e4
    x[:, 64:96] *= 1e-30
    x[:, 96:128] = 0
    x[:, 100] = -3.0
    return x


def lfm2_in_blocks(tmp_path, qtype):
    """A tiny LFM2 (no conv bias: GGUF files have none) whose layers' linears are GGUF blocks of
    qtype, quantized by gguf-py."""
    from gguf import quants

    from models.quant import layers as quant
    from tests.support.tiny import hf_model, write_checkpoint
    d = str(tmp_path / "lfm2-nobias")
    if not os.path.exists(d):
        write_checkpoint("lfm2", d, model=hf_model("lfm2", conv_bias=False))
    lm = models.load(d)
    for parent in list(lm.model.model.layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                raw = quants.quantize(child.weight.detach().numpy(), qtype)
                setattr(parent, name, quant.BlockLinear(torch.from_numpy(raw), int(qtype), getattr(child, "sizes", None)))
    return lm


def blocks32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 / Q8_1's q [T, K / 32, 32] and fp32 d = max|x| / 127 [T, K / 32, 1]."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    return torch.round(g * inv).clamp(-127, 127), amax / torch.full_like(amax, 127.0)
