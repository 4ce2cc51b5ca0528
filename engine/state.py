"""StateManager: THE ONLY code that allocates, resets, rewinds, snapshots or restores state.

Every tensor is allocated once, up front, for `max_context`, and afterwards only mutated in place
(`zero_`, `copy_`, index writes) so a captured CUDA graph's raw pointers stay valid.
- Attention KV is growable and masked: `rewind(n)` moves the logical length; stale slots are inert.
- Fixed conv/recurrent state is an unmasked rolling cache: `rewind(0)` (= `reset()`) re-zeroes it
  exactly as construction did. A non-zero rewind of such state cannot be made exact without a
  snapshot, so it raises `RewindError` (callers check `can_rewind(n)` and fall back to reset).
- Pure-KV models have an empty fixed-state set: reset is a length change and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.state_spec import AttentionState, FixedState


class RewindError(RuntimeError):
    """A rewind that cannot be made exact was asked for."""


# Test-only switch for the non-vacuity check of the re-zero regression test: with it False,
# reset() leaves fixed state as it was (the original bug). Never set outside tests.
_REZERO_FIXED_STATE = True


@dataclass
class Snapshot:
    length: int
    fixed: list[dict[str, torch.Tensor]]


class StateManager:
    def __init__(self, spec: list, max_context: int, device: torch.device, dtype: torch.dtype):
        self.max_context = max_context
        self.device, self.dtype = device, dtype
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._fixed: list[dict[str, torch.Tensor] | None] = []
        for layer in spec:
            if isinstance(layer, AttentionState):
                shape = (layer.n_kv_heads, max_context, layer.head_dim)
                self._kv.append((torch.zeros(shape, device=device, dtype=dtype),
                                 torch.zeros(shape, device=device, dtype=dtype)))
                self._fixed.append(None)
            elif isinstance(layer, FixedState):
                self._kv.append(None)
                self._fixed.append({name: torch.zeros(shape, device=device, dtype=dt or dtype)
                                    for name, shape, dt in layer.tensors})
            else:
                raise TypeError(f"unknown layer state declaration {layer!r}")
        self.length = 0
        self.kv_len = 0  # slots the next forward attends over; set by begin_forward()

    # --- the view a model's forward receives -------------------------------------------------
    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]

    def fixed(self, layer: int) -> dict[str, torch.Tensor]:
        return self._fixed[layer]

    @property
    def has_fixed_state(self) -> bool:
        return any(f is not None for f in self._fixed)

    def fixed_tensors(self) -> list[torch.Tensor]:
        return [t for f in self._fixed if f is not None for t in f.values()]

    @property
    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for p in self._kv if p is not None for t in p)
        return kv + sum(t.numel() * t.element_size() for t in self.fixed_tensors())

    # --- lengths ------------------------------------------------------------------------------
    def begin_forward(self, n_new: int, kv_len: int | None = None) -> None:
        """Prepare a forward over `n_new` tokens at positions length..length+n_new-1."""
        if self.length + n_new > self.max_context:
            raise RewindError(f"context full: {self.length} + {n_new} tokens > max_context {self.max_context}")
        self.kv_len = self.length + n_new if kv_len is None else kv_len

    def advance(self, n: int) -> None:
        """Commit `n` tokens whose state a completed forward wrote."""
        self.length += n

    def can_rewind(self, n: int) -> bool:
        return n == 0 or n == self.length or (0 <= n <= self.length and not self.has_fixed_state)

    def rewind(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise RewindError(f"cannot rewind to {n}: only {self.length} tokens are cached")
        if n == 0:
            # Always re-zero, even at length 0: a broken-off forward may have written fixed state.
            if _REZERO_FIXED_STATE:
                for t in self.fixed_tensors():
                    t.zero_()
        elif n == self.length:
            return
        elif self.has_fixed_state:
            raise RewindError(f"cannot rewind recurrent state from {self.length} to {n} tokens "
                              "without a snapshot; reset and re-prefill instead")
        self.length = n

    def reset(self) -> None:
        """Back to the construction state: length 0 and zeroed fixed state."""
        self.rewind(0)

    def invalidate(self) -> None:
        """A forward broke off midway (Ctrl-C, error). KV slots past `length` are inert, so a
        pure-KV state is still exact; fixed state may be half-written and must start over."""
        if self.has_fixed_state:
            self.reset()

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.length, [None if f is None else {k: t.clone() for k, t in f.items()}
                                      for f in self._fixed])

    def restore(self, snap: Snapshot) -> None:
        if snap.length > self.length and not self.has_fixed_state:
            raise RewindError("a KV snapshot can only restore a length at or below the current one")
        for live, saved in zip(self._fixed, snap.fixed):
            if live is not None:
                for k, t in live.items():
                    t.copy_(saved[k])
        self.length = snap.length
