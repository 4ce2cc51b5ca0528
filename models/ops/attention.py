"""Attention ops over the engine's KV buffers: the q/k norms, RoPE and KV write of any number of
tokens (`rope_kv_write`), one token's attention over the live slots (`decode`: it reads the
live length from `positions`), and a prefill's causal attention (`prefill_causal`: its start
from `positions` or an int). Each has its `*_serves` / `*_fits` predicate, the planner's rule
(models/plan/serving.py); the torch forms live in architectures/layers.py. q [H, T, D] or as each
kernel documents; caches [KVH, max_context, D]."""
from __future__ import annotations

from ..kernels.cuda import attention as _attention, base as _base, prefill_attention as _prefill
from ..plan.serving import decode_attention_fits as decode_fits, decode_attention_serves as decode_serves
from ..plan.serving import prefill_attention_fits as prefill_sizes, rope_fits, rope_serves
from .serving import calls

__all__ = ["decode", "decode_fits", "decode_serves", "prefill_causal", "prefill_sizes", "rope_fits", "rope_kv_write",
           "rope_serves"]

decode = calls(_attention, "decode")
rope_kv_write = calls(_base, "qk_rope_kv_write")
prefill_causal = calls(_prefill, "causal")
