"""The op sites of a loaded model, as the planner sees them: each linear, LM head, embedding,
routed-experts block and sequence mixer (attention, Gated DeltaNet, Mamba2, short convolution),
with its weight format, its shape and the bytes a decode step reads of it. Reading the modules
is all this does; nothing here chooses or runs a kernel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..formats import gguf_blocks
from ..quant import layers as quant

# op kinds, in the order a plan lists them
OPS = ("embedding", "attention", "gated_delta", "mamba2", "short_conv", "linear", "experts", "lm_head")


@dataclass
class Site:
    """One op instance. `fmt`: the weight format as stored now ("Q4_K", "Q4KR" once repacked,
    "AWQ", "FP8", "bfloat16" ...); `source`: the checkpoint's format it came from (the same
    unless the layout changed); n, k: output and input features (experts: of one expert's
    gate/up rows); `nbytes`: the bytes held; `decode_share`: the part of them a decode step
    reads (1 for a linear, one row of an embedding, top_k / num_experts of routed experts, 0
    for the MTP layer's, which only drafts read);
    `dims`: a mixer's sizes (head_dim, heads, state) that its kernels' fit rules read."""
    name: str
    op: str
    fmt: str
    module: nn.Module = field(repr=False)
    n: int = 0
    k: int = 0
    nbytes: int = 0
    decode_share: float = 1.0
    source: str = ""
    dims: dict = field(default_factory=dict)

    @property
    def weights(self) -> int:
        return self.n * self.k

    @property
    def decode_bytes(self) -> float:
        return self.nbytes * self.decode_share


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and not t.is_meta)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def linear_format(m: nn.Module) -> tuple[str, str, int] | None:
    """(format now, the checkpoint's format, bytes held) of a linear-like module, or None where
    `m` is not one."""
    if isinstance(m, quant.BlockLinear):
        source = gguf_blocks.type_name(m.ggml_type)
        return (m.planar_fmt or source), source, _bytes(m.stored())
    if isinstance(m, quant.QuantLinear) and hasattr(m, "format_tensors"):  # hf_quant's FP8 / AWQ / GPTQ
        name, tensors = m.format_tensors()
        fmt = m.qweight().fmt
        return (fmt if fmt in ("INT4P",) else name), name, _bytes(tensors)
    if isinstance(m, quant.Int4Linear):
        kind = getattr(m, "gguf_kind", "int4").upper()
        return kind, kind, _bytes([m.packed, m.scale_zero])
    if isinstance(m, quant.Q8Linear):
        return "Q8_0", "Q8_0", _bytes([m.codes, m.scale])
    if isinstance(m, nn.Linear):
        name = _dtype_name(m.weight)
        return name, name, _bytes([m.weight, m.bias])
    return None


def _features(m: nn.Module) -> tuple[int, int]:
    return int(getattr(m, "out_features", 0)), int(getattr(m, "in_features", 0))


def _experts_site(name: str, m: nn.Module, top_k: int) -> Site | None:
    from ..architectures import moe
    if isinstance(m, moe.Experts):
        e, two_i, h = m.gate_up_proj.shape
        fmt = _dtype_name(m.gate_up_proj)
        return Site(name, "experts", fmt, m, two_i, h, _bytes([m.gate_up_proj, m.down_proj]), top_k / e, fmt,
                    {"experts": e, "top_k": top_k})
    if isinstance(m, quant.BlockExperts):
        e, rows = m.gate_blocks.shape[0], m.gate_blocks.shape[1]
        kinds = sorted({gguf_blocks.type_name(t) for t in m.types})
        fmt = "/".join(kinds)
        return Site(name, "experts", fmt, m, 2 * rows, 0, _bytes([m.gate_blocks, m.up_blocks, m.down_blocks]),
                    top_k / e, fmt, {"experts": e, "top_k": top_k})
    if isinstance(m, quant.PlanarExperts):
        layouts = sorted({half[0] for half in m.planar_halves.values()}) or ["dense"]
        kinds = sorted(set(m.gguf_kinds().values())) or layouts
        held = _bytes(list(m.buffers(recurse=False)) + list(m.parameters(recurse=False)))
        return Site(name, "experts", "/".join(layouts), m, 2 * m.intermediate, m.hidden, held,
                    top_k / m.num_experts, "/".join(kinds), {"experts": m.num_experts, "top_k": top_k})
    return None


def _mixer_site(name: str, m: nn.Module) -> Site | None:
    from ..architectures import layers, lfm2, mamba2, qwen3_5
    if isinstance(m, layers.QKVProjections):
        def first(*names):  # (llama.py's names, or the hybrids')
            return int(next((getattr(m, a) for a in names if hasattr(m, a)), 0))
        return Site(name, "attention", "-", m, dims={"head_dim": first("head_dim", "d"),
                                                       "heads": first("n_heads", "nh"),
                                                       "kv_heads": first("n_kv", "nkv")})
    if isinstance(m, qwen3_5.GatedDeltaNet):
        return Site(name, "gated_delta", "-", m, dims={"dk": int(m.dk), "dv": int(m.dv), "heads": int(m.nv)})
    if isinstance(m, mamba2.Mamba2Mixer):
        return Site(name, "mamba2", "-", m, dims={"head_dim": int(m.P), "state": int(m.N)})
    if isinstance(m, lfm2.ShortConv):
        return Site(name, "short_conv", "-", m, dims={})
    return None


def collect(model: nn.Module) -> list[Site]:
    """Every op site of `model`, in module order. A module tied to another (a head on its
    embedding's blocks) is listed once per name but its bytes once (the embedding keeps them)."""
    sites: list[Site] = []
    top_k = {}
    for name, m in model.named_modules():
        router = getattr(m, "gate", None) if hasattr(m, "experts") else None
        router = getattr(m, "router", router)
        if router is not None and hasattr(router, "top_k"):
            top_k[f"{name}.experts" if name else "experts"] = int(router.top_k)
    for name, m in model.named_modules():
        if name in top_k:
            site = _experts_site(name, m, top_k[name])
            if site is not None:
                sites.append(site)
            continue
        site = _mixer_site(name, m)
        if site is not None:
            sites.append(site)
            continue
        if isinstance(m, (nn.Embedding, quant.BlockEmbedding, quant.Q8Embedding)):
            sites.append(_embedding_site(name, m))
            continue
        described = linear_format(m)
        if described is None:
            continue
        fmt, source, held = described
        n, k = _features(m)
        op = "lm_head" if name == "lm_head" else "linear"
        sites.append(Site(name, op, fmt, m, n, k, held, 1.0, source))
    for s in sites:  # the MTP layer (models/architectures/mtp.py) runs for drafts, not in a step
        if s.name.startswith("mtp."):
            s.decode_share = 0.0
    return sites


def _embedding_site(name: str, m: nn.Module) -> Site:
    if isinstance(m, quant.BlockEmbedding):
        fmt = m.planar_fmt if m.planar else gguf_blocks.type_name(m.ggml_type)
        rows, _ = m.blocks_shape()
        held = _bytes(m.stored())
        return Site(name, "embedding", fmt, m, rows, 0, held, 1 / max(rows, 1), gguf_blocks.type_name(m.ggml_type))
    if isinstance(m, quant.Q8Embedding):
        rows = m.codes.shape[0]
        return Site(name, "embedding", "Q8_0", m, rows, 0, _bytes([m.codes, m.scale]), 1 / max(rows, 1), "Q8_0")
    rows, dim = m.weight.shape
    fmt = _dtype_name(m.weight)
    return Site(name, "embedding", fmt, m, rows, dim, _bytes([m.weight]), 1 / max(rows, 1), fmt)
