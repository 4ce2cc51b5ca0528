"""Tiny HF checkpoints quantized the way their tools write them, for the quantized-checkpoint tests.

`write_quantized(kind, path, method)` quantizes a tiny transformers model's linears (those whose
sizes the format takes: K a multiple of 128, N of 8; the rest stay as they are, as tools leave
small projections) and writes two directories: `path/q` (the quantized checkpoint, with
config.json's quantization_config) and `path/ref` (the same model with every quantized weight
replaced by the values the format encodes, in fp32: the dequantized reference). The encoders here
are written from the formats' descriptions, independently of models/formats/hf_quant.py:
- fp8: e4m3 codes of w / s with s = amax / 448 per 128 x 128 block, `weight_scale_inv` = s;
- awq: AutoAWQ GEMM packing (`qweight` [K, N/8] int32, eight columns a word in the order
  0 2 4 6 1 3 5 7; `qzeros` likewise; `scales` fp16 [K/G, N]), asymmetric groups of 128;
- gptq / gptq_asym / gptq_v2: GPTQModel's packing (`qweight` [K/8, N], eight rows of K a word;
  `qzeros` [K/G, N/8] with eight columns a word, each zero stored minus one in the v1 format;
  `scales` fp16 [K/G, N]; `g_idx` = k // G), symmetric (zero 8) or asymmetric.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny import hf_model, write_checkpoint

GROUP = 128
SIZES = {"llama": dict(hidden_size=128, intermediate_size=256),
         "qwen2": dict(hidden_size=128, intermediate_size=256),
         "qwen3_5": dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32,
                         linear_value_head_dim=32)}
CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "gptq_asym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                  "checkpoint_format": "gptq"},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
}
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column ORDER[i] of its eight


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0-15 → int32 [...] words, nibble i at bits 4i."""
    v = np.zeros(nibbles.shape[:-1], dtype=np.int64)
    for i in range(8):
        v |= nibbles[..., i].astype(np.int64) << (4 * i)
    return v.astype(np.uint32).view(np.int32)


def fp8(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    bn, bk = -(-n // 128), k // 128
    pad = torch.zeros(bn * 128, k)
    pad[:n] = w
    amax = pad.reshape(bn, 128, bk, 128).abs().amax((1, 3)).clamp(min=1e-8)
    s = amax / 448.0
    sx = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    q = (w / sx).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": s.float()}, q.float() * sx


def _int4(w: torch.Tensor, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] → codes [K, N], zeros [K/G, N] (0-15), fp16 scales [K/G, N], per group of K."""
    wt = w.t().double().numpy()  # [K, N]
    k, n = wt.shape
    g = wt.reshape(k // GROUP, GROUP, n)
    if sym:
        s = np.abs(g).max(1) / 7.5
        z = np.full(s.shape, 8)
    else:
        lo, hi = g.min(1), g.max(1)
        s = (hi - lo) / 15.0
        z = np.clip(np.round(-lo / np.maximum(s, 1e-12)), 0, 15)
    s = np.maximum(s, 1e-6).astype(np.float16)
    q = np.clip(np.round(g / s.astype(np.float64)[:, None]) + z[:, None], 0, 15)
    return q.reshape(k, n).astype(np.uint8), z.astype(np.uint8), s


def awq(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    q, z, s = _int4(w, sym=False)
    k, n = q.shape
    order = np.array(_AWQ_ORDER)
    qweight = _words(q.reshape(k, n // 8, 8)[:, :, order])
    qzeros = _words(z.reshape(k // GROUP, n // 8, 8)[:, :, order])
    deq = (q.astype(np.float32) - np.repeat(z, GROUP, 0)) * np.repeat(s.astype(np.float32), GROUP, 0)
    return ({"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
             "scales": torch.from_numpy(s)}, torch.from_numpy(deq).t())


def gptq(w: torch.Tensor, sym: bool, v1: bool) -> tuple[dict, torch.Tensor]:
    q, z, s = _int4(w, sym)
    k, n = q.shape
    qweight = _words(q.reshape(k // 8, 8, n).transpose(0, 2, 1))
    stored = (z.astype(np.int64) - 1) & 15 if v1 else z
    qzeros = _words(stored.reshape(k // GROUP, n // 8, 8))
    deq = (q.astype(np.float32) - np.repeat(z, GROUP, 0)) * np.repeat(s.astype(np.float32), GROUP, 0)
    return ({"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros), "scales": torch.from_numpy(s),
             "g_idx": torch.arange(k, dtype=torch.int32) // GROUP}, torch.from_numpy(deq).t())


def quantizable(name: str, t: torch.Tensor) -> bool:
    return (name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "lm_head" not in name
            and "norm" not in name and t.shape[1] % 128 == 0 and t.shape[0] % 8 == 0)


def write_quantized(kind: str, path: str, method: str, seed: int = 0) -> tuple[str, str]:
    src = write_checkpoint(kind, os.path.join(path, "src"), model=hf_model(kind, seed, **SIZES[kind]))
    qdir, rdir = os.path.join(path, "q"), os.path.join(path, "ref")
    shutil.copytree(src, qdir)
    shutil.copytree(src, rdir)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qt, rt = {}, {}
    for name, t in tensors.items():
        if not quantizable(name, t):
            qt[name], rt[name] = t, t
            continue
        w = t.float()
        if method == "fp8":
            pieces, deq = fp8(w)
        elif method == "awq":
            pieces, deq = awq(w)
        else:
            pieces, deq = gptq(w, sym=method == "gptq", v1=method != "gptq_v2")
        prefix = name[: -len(".weight")]
        for piece, v in pieces.items():
            qt[f"{prefix}.{piece}"] = v.contiguous()
        rt[name] = deq.float().contiguous()
    for d, ts in ((qdir, qt), (rdir, rt)):
        os.remove(os.path.join(d, "model.safetensors"))
        save_file(ts, os.path.join(d, "model.safetensors"))
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = CONFIGS[method]
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    return qdir, rdir
