"""Building blocks shared by the architectures: RMSNorm, RoPE, SwiGLU MLP, cached attention.

All ops take one sequence (batch 1): activations are [T, hidden]. Attention writes the new
keys/values into the engine's preallocated buffers at `positions` and attends over the first
`kv_len` slots with a causal mask built from `positions`, so the same code runs a prefill, an
eager decode step and a CUDA-graph decode step (which passes a fixed bucket of slots: see
engine/graphs.py). On CUDA, one-token forwards run the Triton kernels through models/ops where
Triton is installed (the attention then reads only the live slots and needs no mask); everywhere
else the torch forms here run.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..quant.layers import BlockLinear, Int4Linear, QuantLinear
from ..ops import attention as attention_ops, linear as linear_ops, norm as norm_ops, serving


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w); computed in fp32. offset=1 for zero-centred weights."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    cpu_kernel = None  # the C++ library's rms_norm_rows for a decode step's few rows (kernels.cpu_block_kernels)
    cpu_kernel_name = "rms_norm_rows"
    KERNEL_ROWS = 4

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: the output's dtype (x's by default; the final norm hands the LM head fp32)."""
        if self.cpu_kernel is not None and x.dtype == torch.float32 and out_dtype in (None, torch.float32) \
                and x.shape[0] <= self.KERNEL_ROWS and not x.is_cuda:
            w = self.weight if self.offset == 0.0 else \
                self.offset_weight if hasattr(self, "offset_weight") else self.offset + self.weight.float()
            return self.cpu_kernel(x, w, self.eps)
        # One fused kernel where input, weight and output share a dtype (it accumulates in fp32):
        # the decode step is op-count bound on the CPU and launch bound on CUDA. A zero-centred
        # weight (offset 1) is applied in fp32 as HF does, which costs two casts.
        out_dtype = out_dtype or x.dtype
        if self.offset == 0.0 and x.dtype == self.weight.dtype == out_dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        w = self.offset_weight if hasattr(self, "offset_weight") else self.offset + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(out_dtype)

    def fused_weight(self) -> torch.Tensor:
        """The weight the fused kernels apply in fp32: offset + weight (set by reset_buffers)."""
        return self.offset_weight if self.offset != 0.0 else self.weight

    def reset_buffers(self, device) -> None:
        """After loading: offset + weight in fp32, once (not two kernels per call)."""
        if self.offset != 0.0:
            self.register_buffer("offset_weight", self.offset + self.weight.detach().float(), persistent=False)


class Residual(NamedTuple):
    """The residual stream with its newest branch not added yet. A layer hands this on instead of
    `x + branch`, so the next norm can add and normalise in one step (one kernel on CUDA). The
    branch is a tensor, or where moe.branch made it an MoE prefill's combine not run yet
    (moe.PendingCombine), which add_norm runs in its own launch."""
    x: torch.Tensor
    branch: "torch.Tensor | moe.PendingCombine"

    def last_row(self) -> "Residual":
        b = self.branch
        return Residual(self.x[-1:], b[-1:] if isinstance(b, torch.Tensor) else b.last_row())


def add_norm(x: "torch.Tensor | Residual", norm: RMSNorm, defer: bool = False,
             out_dtype: torch.dtype | None = None) -> "tuple[torch.Tensor, torch.Tensor | linear_ops.NormedRow]":
    """(the residual stream, norm(stream)), adding a pending branch first. `defer` (for callers
    whose normed row goes only into Linear layers): on the fused CUDA path the norm is returned
    as a NormedRow, computed in the prologue of the GEMV that reads it (one launch fewer), and
    the stream tensor is written by that GEMV. `out_dtype`: the normed rows' dtype (the
    stream's by default); the stream itself always keeps its dtype."""
    s, b = x if isinstance(x, Residual) else (x, None)
    if b is not None and not isinstance(b, torch.Tensor):  # moe.PendingCombine: its combine joins this launch
        # (one row under defer: the combine alone, then the GEMV's prologue norms it as before)
        if not (defer and s.shape[0] == 1) and (norm.offset != 0.0 or norm.weight.dtype == s.dtype):
            done = b.add_norm(s, norm.fused_weight(), norm.eps, out_dtype)
            if done is not None:
                return done
        b = b.materialize()
    if norm.offset != 0.0 or norm.weight.dtype == s.dtype:
        done = norm_ops.add_rms_norm(s, b, norm.fused_weight(), norm.eps, defer, out_dtype)
        if done is not None:
            return done
    x = s if b is None else s + b
    return x, norm(x, out_dtype)


class Rope(nn.Module):
    """Rotate-half RoPE (the HF convention) over the first `rotary_dim` dims of each head."""

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.theta, self.scaling = theta, scaling
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        r = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float64, device="cpu") / r))
        if self.scaling:
            inv_freq = _scale_inv_freq(inv_freq, self.scaling)
        return inv_freq.float()

    def reset_buffers(self, device) -> None:
        """Recompute after loading (the model is built on the meta device); always fp32."""
        self.inv_freq = self._inv_freq().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin, [T, rotary_dim]: the sin's first half is negated so that
        rotate_half(x) * sin == roll(x, half) * signed_sin (one roll instead of neg + cat)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return emb.cos().to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x: [heads, T, head_dim]; cos/signed_sin from cos_sin(): [T, rotary_dim]."""
        r = self.rotary_dim
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        out = torch.addcmul(rot * cos, rot.roll(r // 2, dims=-1), signed_sin)
        return out if rest is None else torch.cat((out, rest), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = Linear(hidden, ffn, bias=False)
        self.up_proj = Linear(hidden, ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def fuse(self) -> None:
        """After loading: one [2*ffn, hidden] matmul instead of two (fewer, larger kernels)."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self, "gate_up_proj", None)
        if isinstance(fused, QuantLinear) and fused.cuda_serves(x) and x.shape[0] == 1:
            # the dequant-GEMV computes silu(gate) * up, and the down's int8 input where it reads one
            int8_out = linear_ops.reads_int8(self.down_proj, linear_ops.row_dtype(x), "pair")
            return self.down_proj(fused.forms.swiglu(fused, x, int8_out=int8_out))
        if isinstance(fused, FusedLinear) and serving.one_row(x):
            # one GEMV computes silu(gate) * up (the fused weight is [gate; up])
            x = x if linear_ops.is_row(x) else x.contiguous()
            return self.down_proj(linear_ops.gemv(x, self.gate_up_proj.weight, swiglu=True))
        x = linear_ops.as_tensor(x)
        if hasattr(self, "gate_up_proj"):
            return self.down_proj(linear_ops.silu_mul(self.gate_up_proj(x)))  # CUDA: one kernel, not silu's and mul's
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QKVProjections(nn.Module):
    """q_proj/k_proj/v_proj (checkpoint names) that `fuse()` turns into one matmul after loading."""

    def fuse(self) -> None:
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj.split(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_joint(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side in one row, as the fused decode kernels read them."""
        return self.qkv_proj(x) if hasattr(self, "qkv_proj") else torch.cat(self.project_qkv(x), dim=-1)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose one-token CUDA forward is the
    Triton GEMV (linear_ops.dense): cuBLAS's one-row kernels leave much of the bandwidth unused."""

    def forward(self, x: "torch.Tensor | linear_ops.NormedRow") -> torch.Tensor:
        return linear_ops.dense(x, self.weight, self.bias)


# False: a branch's residual multiplier (Granite's) as torch's product after the GEMV or expert
# launch, not in its epilogue (the A/B of bench/ab_decode.py's variant apartscale)
FUSED_SCALE = True


def scaled_linear(linear: nn.Module, x: "torch.Tensor | linear_ops.NormedRow", scale: float) -> torch.Tensor:
    """linear(x) * scale, rounded as that product is (the output in its dtype, then scaled and
    rounded again). A plain Linear's one-row CUDA GEMV scales in its epilogue: one launch, not
    two (Granite's residual multiplier on each branch). Modules with forward hooks (tensor
    parallelism's) and other linears (quantized ones) take the product."""
    if scale == 1.0:
        return linear(x)
    if (FUSED_SCALE and type(linear) is Linear and not linear._forward_hooks and not linear._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks and x.dtype == linear.weight.dtype
            and linear_ops.gemv_serves(x, linear.weight.dtype)):
        return linear_ops.gemv(x, linear.weight, linear.bias, scale=scale)
    return linear(x) * scale


class FusedLinear(Linear):
    """Linears that read the same input, concatenated; `sizes` splits the output back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = sizes

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


# Rows of a half-precision LM head widened to fp32 at a time where no fp32-output kernel serves
# (the CPU in bf16/fp16, CUDA without Triton): bounds the transient copy (~64 MiB in fp32).
HEAD_CHUNK_ELEMENTS = 16 << 20


def head_logits(head: nn.Module, h: "torch.Tensor | linear_ops.NormedRow") -> torch.Tensor:
    """The LM head's logits in fp32: h (the final norm's rows, fp32, or a NormedRow of one that
    yields fp32) times the head's weight, accumulated in fp32 and never rounded to a half dtype,
    so that greedy decoding compares fp32 values. Half weights are read as they are stored: the
    Triton GEMV writes fp32 (one row on CUDA); elsewhere row chunks of the weight are widened.
    The CPU's 4-bit heads (quant.Q8Linear) return their kernel's sums (see models/quant/layers.py)."""
    w = getattr(head, "weight", None)
    if isinstance(head, QuantLinear) and head.cuda_serves(h):  # fp32 sums from the quantized weights
        return head(h, out_dtype=torch.float32)
    if not isinstance(head, Linear) or w is None:
        return head(linear_ops.as_tensor(h)).float()
    if linear_ops.head_gemv_serves(h, w.dtype):
        return linear_ops.gemv(h if linear_ops.is_row(h) else h.contiguous(), w, head.bias, out_dtype=torch.float32)
    h = h.float()
    if w.dtype == torch.float32:
        return F.linear(h, w, head.bias)
    rows = max(1, HEAD_CHUNK_ELEMENTS // w.shape[1])
    out = torch.empty(h.shape[0], w.shape[0], dtype=torch.float32, device=h.device)
    for i in range(0, w.shape[0], rows):
        torch.mm(h, w[i:i + rows].float().t(), out=out[:, i:i + rows])
    return out if head.bias is None else out + head.bias.float()


def fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One module for linears that read the same input, or None where their storage differs
    (a GGUF may quantize q, k and v differently: those stay separate)."""
    if all(isinstance(m, Int4Linear) for m in linears):
        return Int4Linear.concat(linears)
    if all(isinstance(m, BlockLinear) for m in linears):
        return BlockLinear.concat(linears)
    if all(isinstance(m, QuantLinear) and type(m) is type(linears[0]) for m in linears):
        return type(linears[0]).concat(linears)
    if not all(type(m) is Linear for m in linears):
        return None
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    return FusedLinear(torch.cat([m.weight for m in linears]), bias, [m.weight.shape[0] for m in linears])


def causal_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, kv_len] additive mask (0 or -inf): query at position p sees key slots 0..p. Built once
    per forward for all layers. (Not needed, and not built, for one query over exactly the live
    slots: an eager decode step on the CPU.)"""
    slots = torch.arange(kv_len, device=positions.device)
    hidden = slots[None, :] > positions[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, float("-inf"))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                     mask: torch.Tensor) -> torch.Tensor:
    """q: [H, T, D]; k, v: [KVH, T, D]; caches: [KVH, max_context, D]. Returns [T, H*D].

    Writes k/v at `positions` in place (index_copy_ keeps the buffers' identity for graphs).
    """
    k_cache.index_copy_(1, positions, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
    v_cache.index_copy_(1, positions, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
    return attend_cached(q, k_cache, v_cache, kv_len, mask)


def rope_and_attend(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    rope: "Rope | None", cos, sin, kv, kv_len: int, mask) -> torch.Tensor:
    """The GQA attention of the plain layers (nemotron_h, olmo_hybrid): q [H, T, D], k and v
    [KVH, T, D], RoPE applied to q and k where `rope` is given; k and v written into the cache
    kv at `positions`. One token on CUDA (attention_usable: CausalLM then built no mask): the
    Triton decode kernel, which reads the live length from `positions`; else cached_attention.
    Returns [T, H*D]."""
    if rope is not None:
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    if attention_ops.decode_serves(x, q.shape[-1]):
        kv[0].index_copy_(1, positions, k.to(kv[0].dtype))
        kv[1].index_copy_(1, positions, v.to(kv[1].dtype))
        return attention_ops.decode(q.contiguous(), kv[0], kv[1], positions)
    return cached_attention(q, k, v, positions, kv[0], kv[1], kv_len, mask)


def attend_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                  mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [H, T, D] over the first kv_len cached slots (already written). [T, H*D].
    Several queries are the prompt's last kv_len - T.. kv_len - 1 positions (the engine's prefills).
    `positions` (the queries', on the device; given by the layers whose prefills may run padded:
    see padded_prefill_serves): the Triton kernel reads its start there, not from kv_len."""
    T = q.shape[1]
    if T > 1 and _triton_prefill_takes(q, k_cache, v_cache):
        # from position 0 or over a cached prefix alike: one kernel, no mask
        # (bench/prefill_attention_sweep.py)
        return attention_ops.prefill_causal(q, k_cache, v_cache, kv_len - T if positions is None else positions)
    keys, values = k_cache[:, :kv_len], v_cache[:, :kv_len]
    if keys.dtype != q.dtype:  # caches kept narrower than the activations (fp16 on the CPU)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if T == 1:
        return decode_attention(q, keys, values, mask)
    if kv_len == T and _flash_takes(q) and keys.stride(-1) == 1 and values.stride(-1) == 1:
        # a prefill from position 0: plain causal attention by flash, the KV heads read grouped
        # (faster than expanding them: bench/profile_step.py --prefill 2048). Its kernel called as
        # SDPA calls it, without SDPA's backend selection and the sdpa_kernel context (host time a
        # layer: bench/profile_step.py --prefill 2048 --host)
        return _flash_lse(q[None], keys[None], values[None], causal=True)[0][0].transpose(0, 1).reshape(T, -1)
    gqa = keys.shape[0] != q.shape[0]
    with sdpa_kernel(_PREFILL_BACKENDS):
        if kv_len == T:
            # a prefill from position 0: plain causal attention, the KV heads read grouped by
            # flash (faster than expanding them: bench/profile_step.py --prefill 2048)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, enable_gqa=gqa)[0]
        elif _split_prefix_serves(q, kv_len - T):
            out = prefix_and_causal_attention(q, keys, values, kv_len - T)
        else:
            if gqa:  # masked: expand the KV heads, which keeps the memory-efficient kernel eligible
                rep = q.shape[0] // keys.shape[0]
                keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)[0]
    # a q in [T, H, D] memory (qk_rope_kv_write's) comes back the same way: the reshape is a view
    return out.transpose(0, 1).reshape(T, -1)


def _split_prefix_serves(q: torch.Tensor, start: int) -> bool:
    """Where a continued prefill attends in two flash parts (prefix_and_causal_attention): with
    SPLIT_PREFIX on, on CUDA, in half dtypes and head sizes flash takes. Not by default: the
    two partial outputs are rounded to the half dtype before their merge (twice the masked form's
    error against fp32), and on an H200 that flipped a greedy token of a reused prefix against
    the cold prefill (tests/engine/test_graphs.py::test_graphs_on_off_identical), which the masked form
    keeps equal there. It shortens a 27B-like later turn at 16k tokens (bench/turns_bench.py
    --profile)."""
    return start > 0 and SPLIT_PREFIX and _flash_takes(q)


SPLIT_PREFIX = False

# False: prefills attend by torch's kernels (flash from position 0, the masked memory-efficient
# kernel over a cached prefix), as before the Triton kernel (bench/ab_prefill.py)
TRITON_PREFILL_ATTENTION = True


def _triton_prefill_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Where prefills attend by attention_ops.prefill_causal: `_triton_prefill_sizes` for q's
    device, dtype and head size and the caches' dtype, outside torch.compile, rows of D
    contiguous, and whole groups of query heads per key head."""
    return (_triton_prefill_sizes(q.device, q.dtype, q.shape[-1], k_cache.dtype) and v_cache.dtype == q.dtype
            and not torch.compiler.is_compiling() and q.stride(-1) == 1 and k_cache.stride(-1) == 1
            and v_cache.stride(-1) == 1 and q.shape[0] % k_cache.shape[0] == 0)


def _triton_prefill_sizes(device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """TRITON_PREFILL_ATTENTION on and attention_ops.prefill_sizes: the device and dtype served,
    caches of that dtype, head sizes up to 256, sm_90 or newer."""
    return TRITON_PREFILL_ATTENTION and attention_ops.prefill_sizes(device, dtype, head_dim, kv_dtype)


def padded_prefill_serves(device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether every prefill of an attention layer on `device` in `dtype` attends by
    attention_ops.prefill_causal with its start read from the positions (attend_cached given
    them) and writes its keys and values by qk_rope_kv_write: then it builds no mask and reads no
    host length, and pad tokens after the prompt change none of the prompt's rows (a causal
    query never sees a later key). _triton_prefill_takes' conditions on the model's sizes (the
    strides and head groups hold for the model's own tensors), and qk_rope_kv_write's head size."""
    return _triton_prefill_sizes(device, dtype, head_dim, kv_dtype) and attention_ops.rope_fits(head_dim)


def _flash_takes(q: torch.Tensor) -> bool:
    """Whether torch's flash attention kernel takes these queries: NVIDIA GPUs of sm_80 or newer
    with flash built and enabled (torch.backends.cuda.enable_flash_sdp), half dtypes, head sizes
    of a multiple of 8 up to 256 (the conditions under which SDPA picks it)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and q.stride(-1) == 1 and torch.backends.cuda.flash_sdp_enabled()
            and _flash_built(q.device.index))


@functools.cache
def _flash_built(index: "int | None") -> bool:
    return (torch.version.hip is None and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(index)[0] >= 8)


def prefix_and_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                start: int) -> torch.Tensor:
    """Attention of T new queries (positions start..start+T-1) over start cached keys and their
    own T keys, without a mask: the queries over the prefix (every key visible) and over their
    own block (square causal) are two flash calls over the KV heads as stored (grouped queries
    read them in the kernel), merged by their log-sum-exps in fp32. The masked form expands the
    KV heads and runs the memory-efficient kernel over a [T, start+T] mask: at a 16k-token
    conversation most of a 27B-like turn's growth over a fresh one (bench/turns_bench.py --profile).
    q: [H, T, D]; keys, values: [KVH, start+T, D]. Returns [1, H, T, D] as SDPA would."""
    T = q.shape[1]
    qb = q[None]
    o1, l1 = _flash_lse(qb, keys[None, :, :start], values[None, :, :start], causal=False)
    o2, l2 = _flash_lse(qb, keys[None, :, start:start + T], values[None, :, start:start + T], causal=True)
    l1, l2 = l1[..., :T, None], l2[..., :T, None]
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_(), (l2 - m).exp_()
    return ((o1.float() * w1).add_(o2.float() * w2)).div_(w1 + w2).to(q.dtype)[0]


def _flash_lse(q, k, v, causal: bool):
    """Flash attention's output and log-sum-exp ([B, H, L] fp32) over [B, H(KV), L, D] inputs."""
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    else:  # (the CPU form: the equivalence test runs it)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out[0], out[1]


# Not cuDNN attention: it plans per new shape (tens of ms each time a turn's key length is new).
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per head, written out as two batched GEMVs and an fp32 softmax.

    Deterministic on every device (fused SDPA kernels for masked single-query attention were
    not bitwise reproducible run to run on an H200), and cheap: the scores are [H, kv_len].
    q: [H, 1, D]; keys/values: [KVH, S, D]; mask: [1, S] additive (causal_mask), or None where
    every slot is live. Returns [1, H*D], as attend_cached does.
    """
    H, _, D = q.shape
    kvh = keys.shape[0]
    qg = q.reshape(kvh, H // kvh, D)  # query heads grouped by the KV head they read
    if mask is None:
        scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(D ** -0.5)
    else:  # scale and mask inside the GEMM's epilogue: one kernel
        scores = torch.baddbmm(mask.expand(kvh, H // kvh, -1), qg, keys.transpose(1, 2), alpha=D ** -0.5)
    probs = scores.softmax(-1)  # accumulates in fp32 for bf16 input, rounds once on the way out
    return torch.bmm(probs, values).view(1, H * D)  # [KVH, G, D] is already head-major
