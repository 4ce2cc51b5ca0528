"""Attention ops over the engine's KV buffers: the q/k norms, RoPE and KV write of any number of
tokens (`rope_kv_write`), one token's attention over the live slots (`decode`: it reads the
live length from `positions`), and a prefill's causal attention (`prefill_causal`: its start
from `positions` or an int). Each has its `*_serves` predicate; the torch forms live in
architectures/layers.py. q [H, T, D] or as each kernel documents; caches [KVH, max_context, D]."""
from __future__ import annotations

import functools

import torch

from ..kernels.cuda import attention as _attention, base as _base, prefill_attention as _prefill
from .serving import calls

decode = calls(_attention, "decode")
rope_kv_write = calls(_base, "qk_rope_kv_write")
prefill_causal = calls(_prefill, "causal")


def decode_fits(head_dim: int) -> bool:
    """The decode kernel's head sizes."""
    return _base.attention_fits(head_dim)


def decode_serves(x: torch.Tensor, head_dim: int) -> bool:
    """The decode kernel serves this layer input's forward. The attention layers and CausalLM
    (which then builds no mask) must agree on it: this is the one rule."""
    return _base.attention_usable(x, head_dim)


def rope_serves(x: torch.Tensor, head_dim: int) -> bool:
    """rope_kv_write serves this forward (any number of tokens)."""
    return _base.rope_usable(x, head_dim)


def prefill_sizes(device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """prefill_causal serves the device and dtype, caches of that dtype, head sizes up to 256 (its
    tiles' shared memory), on sm_90 or newer (measured there; older GPUs keep flash)."""
    return _base.serves(device, dtype) and head_dim <= 256 and kv_dtype == dtype and _sm90(device.index)


def rope_fits(head_dim: int) -> bool:
    """rope_kv_write's head sizes."""
    return _base.fits(head_dim, least=16)


@functools.cache
def _sm90(index: "int | None") -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
