"""What a model declares about its per-layer state; the engine's StateManager allocates it.

A model never allocates state and never advances a position. `forward(tokens, positions, state)`
reads and writes the tensors handed to it through this view:
  state.kv(i)     -> (k, v), each [n_kv_heads, max_context, head_dim]: write at `positions`
  state.fixed(i)  -> {name: tensor} of the shapes the model declared (conv, recurrent state)
  state.kv_len    -> how many key slots this forward may attend over (slots past the newest
                     position are masked; a CUDA decode step passes a bucket: engine/graphs.py)
  state.length    -> tokens cached before this forward (its first position)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionState:
    """Growable, masked attention KV: rewinding the logical length makes stale slots inert."""
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class FixedState:
    """Fixed-size, unmasked rolling state (conv window, recurrent matrix): zeroed on reset.

    `tensors` maps a name to (shape, dtype); dtype None means the model's compute dtype.
    """
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype | None], ...]


LayerState = AttentionState | FixedState


class StateView(Protocol):
    kv_len: int
    length: int

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fixed(self, layer: int) -> dict[str, torch.Tensor]: ...
