"""StateManager: THE ONLY code that allocates, resets, rewinds, snapshots or restores state.

Every tensor is allocated once, up front, for `max_context`, and afterwards only mutated in place
(`zero_`, `copy_`, index writes) so a captured CUDA graph's raw pointers stay valid.
- Attention KV is growable and masked: `rewind(n)` moves the logical length; stale slots are inert.
- Fixed conv/recurrent state is an unmasked rolling cache: `rewind(0)` (= `reset()`) re-zeroes it
  exactly as construction did. A non-zero rewind of such state is exact only from a checkpoint:
  `rewind(n)` raises `RewindError`; `restore_nearest(n)` restores the newest checkpoint at or
  before n (or resets) and the caller re-prefills the gap.
- Checkpoints: a bounded ring of preallocated slots (fixed-state copies + the next-token logits)
  taken at turn boundaries. A checkpoint stays valid while the KV below its length is untouched,
  so every rewind below a checkpoint's length drops it.
- Pure-KV models have an empty fixed-state set: reset is a length change and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.architectures.state_spec import AttentionState, FixedState


class RewindError(RuntimeError):
    """A rewind that cannot be made exact was asked for."""


# Test-only switch for the non-vacuity check of the re-zero regression test: with it False,
# reset() leaves fixed state as it was (the original bug). Never set outside tests.
_REZERO_FIXED_STATE = True


@dataclass
class Snapshot:
    length: int
    fixed: list[dict[str, torch.Tensor]]


@dataclass
class Checkpoint:
    length: int
    slot: int
    has_logits: bool


MAX_SLOTS = 32


class StateManager:
    def __init__(self, spec: list, max_context: int, device: torch.device, dtype: torch.dtype,
                 vocab_size: int = 0, checkpoint_budget: int = 256 << 20, kv_dtype: torch.dtype | None = None,
                 masked_reads: bool | None = None):
        self.max_context = max_context
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_dtype or dtype  # the attention caches' (a decode step may keep them narrower)
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._fixed: list[dict[str, torch.Tensor] | None] = []
        # KV slots past the live length are read where the decode step attends over a bucket of
        # slots, masked past the position (`masked_reads`; by default on CUDA): there they must
        # hold finite values. Elsewhere attention reads only written slots, so untouched pages
        # cost no memory until the context grows into them.
        if masked_reads is None:
            masked_reads = device.type == "cuda"
        kv_alloc = torch.zeros if masked_reads else torch.empty
        for layer in spec:
            if isinstance(layer, AttentionState):
                shape = (layer.n_kv_heads, max_context, layer.head_dim)
                self._kv.append((kv_alloc(shape, device=device, dtype=self.kv_dtype),
                                 kv_alloc(shape, device=device, dtype=self.kv_dtype)))
                self._fixed.append(None)
            elif isinstance(layer, FixedState):
                self._kv.append(None)
                self._fixed.append({name: torch.zeros(shape, device=device, dtype=dt or dtype)
                                    for name, shape, dt in layer.tensors})
            else:
                raise TypeError(f"unknown layer state declaration {layer!r}")
        self.length = 0
        self.kv_len = 0  # slots the next forward attends over; set by begin_forward()
        self._slots = self._allocate_slots(vocab_size, checkpoint_budget)
        self.checkpoints: list[Checkpoint] = []  # oldest first

    def _allocate_slots(self, vocab_size: int, budget: int) -> list:
        per_slot = sum(t.numel() * t.element_size() for t in self.fixed_tensors()) + 4 * vocab_size
        n = 0 if per_slot == 0 else min(MAX_SLOTS, budget // per_slot)
        if self.has_fixed_state and n < 1 and budget > 0:
            n = 1  # one slot at least: a budget too small for it is still better spent than refused
        return [([None if f is None else {k: torch.empty_like(t) for k, t in f.items()} for f in self._fixed],
                 torch.empty(vocab_size, dtype=torch.float32, device=self.device)) for _ in range(n)]
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

    @property
    def checkpoint_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for fixed, logits in self._slots
                   for f in fixed if f is not None for t in f.values()) + \
            sum(logits.numel() * 4 for _, logits in self._slots)

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

    def scrub_kv(self, n: int) -> None:
        """Zero the first n slots of every KV cache (not the length). For slots that forwards over
        scratch values wrote (the session's kernel precompile), which need not be finite: on CUDA
        the slots past the live length are read, masked, and a masked NaN still poisons a softmax."""
        for kv in self._kv:
            if kv is not None:
                for t in kv:
                    t[:, :n].zero_()

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
        self._drop_checkpoints_above(n)

    def reset(self) -> None:
        """Back to the construction state: length 0, zeroed fixed state, no checkpoints."""
        self.rewind(0)
        self.checkpoints = []

    # --- checkpoints at turn boundaries --------------------------------------------------------
    def checkpoint(self, logits: torch.Tensor | None = None) -> None:
        """Save the fixed state (and the next-token logits, if given) at the current length."""
        if not self._slots or (logits is None and not self.has_fixed_state):
            return  # a KV-only checkpoint without logits holds nothing a rewind cannot redo
        self.checkpoints = [c for c in self.checkpoints if c.length != self.length]
        used = {c.slot for c in self.checkpoints}
        if len(used) == len(self._slots):
            used.discard(self.checkpoints.pop(0).slot)  # the ring is full: forget the oldest
        slot = next(i for i in range(len(self._slots)) if i not in used)
        fixed, buf = self._slots[slot]
        _copy_fixed(fixed, self._fixed)
        if logits is not None:
            buf.copy_(logits.reshape(-1))
        self.checkpoints.append(Checkpoint(self.length, slot, logits is not None))

    def checkpoint_logits(self, n: int) -> torch.Tensor | None:
        """The saved next-token logits of a checkpoint at exactly length n, if any."""
        c = next((c for c in self.checkpoints if c.length == n and c.has_logits), None)
        return None if c is None else self._slots[c.slot][1]

    def restore_nearest(self, n: int) -> int:
        """Bring the state to the newest checkpoint at or before n (or reset); returns its length."""
        if self.can_rewind(n):
            self.rewind(n)
            return n
        return self._restore_checkpoint(min(n, self.length))

    def _restore_checkpoint(self, limit: int) -> int:
        """The newest checkpoint at or below `limit` becomes the live state (or reset)."""
        best = max((c for c in self.checkpoints if c.length <= limit), key=lambda c: c.length, default=None)
        if best is None:
            self.reset()
            return 0
        _copy_fixed(self._fixed, self._slots[best.slot][0])
        self.length = best.length
        self._drop_checkpoints_above(best.length)
        return best.length

    def _drop_checkpoints_above(self, n: int) -> None:
        self.checkpoints = [c for c in self.checkpoints if c.length <= n]

    def invalidate(self) -> None:
        """A forward broke off midway (Ctrl-C, error). KV slots past `length` are inert, so a
        pure-KV state is still exact; fixed state may be half-written: back to the newest
        checkpoint (whose KV prefix is untouched), or to zero."""
        if self.has_fixed_state:
            self._restore_checkpoint(self.length)

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.length, [None if f is None else {k: t.clone() for k, t in f.items()}
                                      for f in self._fixed])

    def restore(self, snap: Snapshot) -> None:
        if snap.length > self.length and not self.has_fixed_state:
            raise RewindError("a KV snapshot can only restore a length at or below the current one")
        _copy_fixed(self._fixed, snap.fixed)
        self.length = snap.length


def _copy_fixed(dst: list, src: list) -> None:
    """In-place copy of per-layer fixed state (dicts of tensors; None for attention layers)."""
    for d, s in zip(dst, src):
        if d is not None:
            for k, t in d.items():
                t.copy_(s[k])
