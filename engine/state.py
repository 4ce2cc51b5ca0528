"""StateManager: THE ONLY code that allocates, resets, rewinds, snapshots or restores state.

Every tensor is allocated once, up front, for `max_context`, and afterwards only mutated in place
(`zero_`, `copy_`, index writes) so a captured CUDA graph's raw pointers stay valid.
- Attention KV is growable and masked: `length` is the live length; stale slots are inert. KV
  slots stay written past a rewind: `written` (>= length) counts the slots that still hold the
  tokens they were computed for, until the next forward overwrites them from `length` on.
- Fixed conv/recurrent state is an unmasked rolling cache: `rewind(0)` (= `reset()`) re-zeroes it
  exactly as construction did. Any other length is reached exactly only from a checkpoint:
  `best_at_most(n)` names the longest reachable length <= n (any written length on pure-KV
  state; on fixed state the live length, 0, or a checkpoint's) and `goto(m)` makes it live; the
  caller prefills the gap. `rewind(n)` raises `RewindError` where it cannot be exact.
- Checkpoints: copies of the fixed state (and the next-token logits, if given) taken at turn
  boundaries, in preallocated device slots, spilled to host memory when those are full. One stays
  valid while the KV below its length is untouched: a forward writes from `length` on, so every
  forward drops the checkpoints above `length` (a rewind alone drops none: after an interrupted
  or retried turn the checkpoint at the end of its prompt still serves the same prompt).
- Pure-KV models have an empty fixed-state set: reset is a length change, and a checkpoint holds
  only the logits of a prompt's end (a /retry draws from them without a forward).

Retention by need, then recency. Each checkpoint has a role: "prompt" (at the end of a turn's
prompt, with its logits: what /retry and the recovery from Ctrl-C restore) or "base" (where a
turn's new tokens began, i.e. the end of the previous turn: what /undo followed by a new message
restores). When a slot must be freed, the newest "prompt" checkpoint is evicted last, the newest
"base" one next to last, and among the others the oldest goes first. A checkpoint that would
itself be the first to go is not taken. With a one-slot budget the ring therefore always holds
the newest prompt's checkpoint (/retry never re-prefills) and /undo re-prefills from the newest
checkpoint below it (or from zero).

Spilling: with a host budget (`host_budget`; on CUDA pinned memory), a checkpoint evicted from
the device moves to a host slot instead of being dropped, if it is more needed than the least
needed host checkpoint (or a host slot is free). Device-to-host copies run on a side stream
ordered after the work that wrote the checkpoint; a device slot being spilled is reused only
after its copy's event (the wait is on the GPU, never the host), and one slot is spilled ahead
whenever the device ring is full and holds a checkpoint of neither newest role, so the next
checkpoint finds a free slot. Restoring a host checkpoint copies it back on the current stream.

Budgets ("auto"): on CUDA the device ring takes up to 4% of the GPU's memory, from what is free
after the weights and the state, keeping a reserve for workspace (activations, graphs); the host
ring up to 10% of the available RAM (16 GiB at most). On the CPU the ring is host memory already:
up to 5% of the RAM (a quarter of what is available at most), and no spilling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from models.architectures.state_spec import AttentionState, FixedState


class RewindError(RuntimeError):
    """A rewind that cannot be made exact was asked for."""


# Test-only switch for the non-vacuity check of the re-zero regression test: with it False,
# reset() leaves fixed state as it was (the original bug). Never set outside tests.
_REZERO_FIXED_STATE = True

MAX_SLOTS = 32  # on the device: 16 turns of /undo
MAX_HOST_SLOTS = 32  # as many more in host memory
PROMPT, BASE = "prompt", "base"


@dataclass
class Snapshot:
    length: int
    fixed: list[dict[str, torch.Tensor]]


@dataclass
class Checkpoint:
    length: int
    slot: int
    has_logits: bool
    role: str = BASE
    seq: int = 0
    on_host: bool = False
    ready: Any = None  # on a host slot: the event after which its copy is complete (CUDA)


@dataclass
class _Slot:
    fixed: list
    logits: torch.Tensor
    spilling: Any = None  # a device slot whose copy to the host is in flight: reusable after this event


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_ram() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_budgets(device: torch.device) -> tuple[int, int]:
    """(device bytes, host bytes) for checkpoints when the settings say auto (see the docstring)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = max(4 << 30, int(0.08 * total))
        return max(0, min(int(0.04 * total), free - reserve)), min(16 << 30, int(0.10 * available_ram()))
    return min(int(0.05 * total_ram()), available_ram() // 4), 0


class StateManager:
    def __init__(self, spec: list, max_context: int, device: torch.device, dtype: torch.dtype,
                 vocab_size: int = 0, checkpoint_budget: int | str = 256 << 20, kv_dtype: torch.dtype | None = None,
                 masked_reads: bool | None = None, host_budget: int | str = 0, agree=None):
        """agree: a function (device bytes, host bytes) → the same, the smallest over the ranks of a
        tensor-parallel group (engine/link.py): "auto" budgets are then equal on every rank."""
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
        self.written = 0  # KV slots [0, written) hold the tokens they were computed for
        self.kv_len = 0  # slots the next forward attends over; set by begin_forward()
        self.vocab_size = vocab_size
        auto_dev, auto_host = auto_budgets(device) if "auto" in (checkpoint_budget, host_budget) else (0, 0)
        if agree is not None:
            auto_dev, auto_host = agree(auto_dev, auto_host)
        self.budget_auto = checkpoint_budget == "auto"
        self.host_budget_auto = host_budget == "auto"
        self.budget = auto_dev if self.budget_auto else int(checkpoint_budget)
        self.host_budget = auto_host if self.host_budget_auto else int(host_budget)
        self._slots = self._allocate_slots(self.budget)
        n_host = 0 if not self._slots else min(MAX_HOST_SLOTS, self.host_budget // self.host_slot_nbytes)
        if self.has_fixed_state and self._slots and n_host < 1 and self.host_budget > 0:
            n_host = 1
        self._host: list[_Slot | None] = [None] * n_host  # allocated on first use
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and n_host else None
        self.checkpoints: list[Checkpoint] = []  # oldest first
        self._seq = 0

    @property
    def slot_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fixed_tensors()) + 4 * self.vocab_size

    def _allocate_slots(self, budget: int) -> list[_Slot]:
        per_slot = self.slot_nbytes
        n = 0 if per_slot == 0 else min(MAX_SLOTS, budget // per_slot)
        if self.has_fixed_state and n < 1 and budget > 0:
            n = 1  # one slot at least: a budget too small for it is still better spent than refused
        return [self._new_slot(self.device) for _ in range(n)]

    def _new_slot(self, device: torch.device) -> _Slot:
        return _Slot([None if f is None else {k: torch.empty(t.shape, dtype=t.dtype, device=device)
                                              for k, t in f.items()} for f in self._fixed],
                     torch.empty(self.vocab_size, dtype=torch.float32, device=device))

    def _pinned_layout(self) -> list[int]:
        """Byte sizes of a pinned slot's parts: each fixed tensor rounded up to 64 bytes (so every
        view is aligned for its dtype), then the fp32 logits."""
        return [-(-t.numel() * t.element_size() // 64) * 64 for t in self.fixed_tensors()] + [4 * self.vocab_size]

    def _new_pinned_slot(self) -> _Slot:
        """A host slot in one pinned buffer (one page-locking call; the views keep it alive)."""
        sizes = self._pinned_layout()
        buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        views, at = [], 0
        for n in sizes:
            views.append(buf[at:at + n])
            at += n
        it = iter(views)
        fixed = [None if f is None else {k: next(it)[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                                         for k, t in f.items()} for f in self._fixed]
        return _Slot(fixed, next(it).view(torch.float32))

    def _host_slot_storage(self) -> _Slot:
        """A host slot's tensors: on CUDA pinned. Pinned on first use: the turn that first spills
        into a slot pays for page-locking it (pinning a slot ahead on a background thread did not
        hide it: bench/turns_bench.py --budgets 256)."""
        if self.device.type != "cuda":
            return self._new_slot(torch.device("cpu"))
        return self._new_pinned_slot()

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
        """Device memory reserved for checkpoints."""
        return len(self._slots) * self.slot_nbytes

    @property
    def host_slot_nbytes(self) -> int:
        """Host bytes a slot takes: on CUDA one pinned buffer, which torch's pinned-memory
        allocator rounds up to a power of two."""
        if self.device.type != "cuda":
            return self.slot_nbytes
        return 1 << max(sum(self._pinned_layout()) - 1, 1).bit_length()

    @property
    def host_slots(self) -> int:
        return len(self._host)

    @property
    def host_nbytes(self) -> int:
        """Host memory the spilled checkpoints hold now (their slots are allocated on first use)."""
        return sum(s is not None for s in self._host) * self.host_slot_nbytes

    def describe(self) -> str:
        """The checkpoint ring in words (the REPL's /show)."""
        on_host = sum(c.on_host for c in self.checkpoints)
        dev = f"{len(self._slots)} slots, {self.checkpoint_nbytes / 2**20:.1f} MiB" + (" (auto)" if self.budget_auto else "")
        out = f"{len(self.checkpoints)} held ({len(self.checkpoints) - on_host} on the device, {on_host} spilled); " \
              f"device ring {dev}"
        if self._host:
            out += f"; host ring {len(self._host)} slots, {self.host_nbytes / 2**20:.1f} of " \
                   f"{len(self._host) * self.host_slot_nbytes / 2**20:.1f} MiB in use" + (" (auto)" if self.host_budget_auto else "")
        return out

    # --- lengths ------------------------------------------------------------------------------
    def begin_forward(self, n_new: int, kv_len: int | None = None) -> None:
        """Prepare a forward over `n_new` tokens at positions length..length+n_new-1. It writes KV
        from `length` on: what the slots there held, and the checkpoints above, are gone."""
        if self.length + n_new > self.max_context:
            raise RewindError(f"context full: {self.length} + {n_new} tokens > max_context {self.max_context}")
        self.written = self.length
        self._drop(lambda c: c.length > self.length)
        self.kv_len = self.length + n_new if kv_len is None else kv_len

    def advance(self, n: int) -> None:
        """Commit `n` tokens whose state a completed forward wrote."""
        self.length += n
        self.written = self.length

    def can_rewind(self, n: int) -> bool:
        return n == 0 or n == self.length or (0 <= n <= self.length and not self.has_fixed_state)

    def scrub_kv(self, n: int) -> None:
        """Zero the first n slots of every KV cache, at length 0. For slots that forwards over
        scratch values wrote (the session's kernel precompile), which need not be finite: on CUDA
        the slots past the live length are read, masked, and a masked NaN still poisons a softmax."""
        for kv in self._kv:
            if kv is not None:
                for t in kv:
                    t[:, :n].zero_()
        self.written = self.length
        self._drop(lambda c: True)

    def rewind(self, n: int) -> None:
        """Make n the live length, n <= length; exact for n == 0 and n == length, and for any n on
        pure-KV state (RewindError otherwise). The KV slots above stay written."""
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
                              "without a checkpoint; reset and re-prefill instead")
        self.length = n

    def unfeed(self, n: int, fixed: list | None = None) -> None:
        """Forget the last n tokens as if no forward had fed them: length and written both fall
        by n (their KV slots count as unwritten, so no later prefix match reuses them). Fixed
        state cannot be unfed by a length: `fixed` is that state at the new length (per layer as
        `fixed(i)` holds it, None for an attention layer), copied in. The pipelined decode's step
        ahead, fed a token that turned out to end the reply; a speculative verify's rejected
        drafts, with the per-row conv windows its step kept (engine/session.py)."""
        if not 0 <= n <= self.length or (self.has_fixed_state and n and fixed is None):
            raise RewindError(f"cannot unfeed {n} of {self.length} tokens" +
                              (" of recurrent state without that state" if self.has_fixed_state else ""))
        if n and self.has_fixed_state:
            _copy_fixed(self._fixed, fixed)
        self.length -= n
        self.written = self.length
        self._drop(lambda c: c.length > self.length)

    def reset(self) -> None:
        """Back to the construction state: length 0, zeroed fixed state, no checkpoints."""
        self.rewind(0)
        self.written = 0
        self._drop(lambda c: True)

    def best_at_most(self, n: int) -> int:
        """The longest length <= n that `goto` reaches exactly (see the module docstring)."""
        n = min(n, self.written)
        if not self.has_fixed_state:
            return max(n, 0)
        best = self.length if self.length <= n else 0
        return max([best] + [c.length for c in self.checkpoints if c.length <= n])

    def goto(self, m: int) -> None:
        """Make m the live length: a length `best_at_most` named (RewindError for any other)."""
        if m == self.length:
            return
        if not 0 <= m <= self.written:
            raise RewindError(f"cannot go to {m} tokens: {self.written} are written")
        if m == 0:
            self.rewind(0)
            return
        if not self.has_fixed_state:
            self.length = m
            return
        c = next((c for c in self.checkpoints if c.length == m), None)
        if c is None:
            raise RewindError(f"no checkpoint at {m} tokens to restore recurrent state from")
        self._copy_from(c)
        self.length = m

    def restore_nearest(self, n: int) -> int:
        """Bring the state to the longest exactly reachable length at or before n; returns it."""
        m = self.best_at_most(n)
        self.goto(m)
        return m

    def invalidate(self) -> None:
        """A forward broke off midway (Ctrl-C, error). KV slots past `length` are inert, so a
        pure-KV state is still exact; fixed state may be half-written: back to the newest
        checkpoint at or below the length (whose KV prefix is untouched), or to zero."""
        if self.has_fixed_state:
            m = max([0] + [c.length for c in self.checkpoints if c.length <= self.length])
            if m == 0:
                self.rewind(0)
            else:
                self._copy_from(next(c for c in self.checkpoints if c.length == m))
                self.length = m

    # --- checkpoints at turn boundaries --------------------------------------------------------
    def checkpoint(self, logits: torch.Tensor | None = None, role: str = BASE) -> None:
        """Save the fixed state (and the next-token logits, if given) at the current length."""
        if not self._slots or (logits is None and not self.has_fixed_state):
            return  # a KV-only checkpoint without logits holds nothing a rewind cannot redo
        self._seq += 1
        same = next((c for c in self.checkpoints if c.length == self.length), None)
        if same is not None and (same.has_logits or logits is None):
            same.seq, same.role = self._seq, role  # it holds this very state: it takes the newer role
            return
        if same is not None:
            self._drop(lambda c: c is same)
        cand = Checkpoint(self.length, -1, logits is not None, role, self._seq)
        self.checkpoints.append(cand)
        slot = self._free_device_slot(cand)
        if slot is None:
            if not self._to_host(cand, self._fixed, logits, from_live=True):
                self.checkpoints.remove(cand)
            return
        cand.slot = slot
        dst = self._slots[slot]
        _copy_fixed(dst.fixed, self._fixed)
        if logits is not None:
            dst.logits.copy_(logits.reshape(-1))
        self._spill_ahead()

    def checkpoint_logits(self, n: int) -> torch.Tensor | None:
        """The saved next-token logits of a checkpoint at exactly length n, if any (on the device)."""
        c = next((c for c in self.checkpoints if c.length == n and c.has_logits), None)
        if c is None or n > self.written:
            return None
        if c.on_host:
            self._wait_host(c)
            return self._host[c.slot].logits.to(self.device)
        return self._slots[c.slot].logits

    def _need(self) -> dict[int, int]:
        """id(checkpoint) -> 0 for the newest "prompt" one, 1 for the newest "base" one."""
        newest: dict[str, Checkpoint] = {}
        for c in self.checkpoints:
            if c.role not in newest or c.seq > newest[c.role].seq:
                newest[c.role] = c
        return {id(newest[r]): rank for r, rank in ((PROMPT, 0), (BASE, 1)) if r in newest}

    def _eviction_order(self, cands: list[Checkpoint]) -> list[Checkpoint]:
        """`cands` sorted first-to-go first: by need (see the module docstring), then age."""
        need = self._need()
        return sorted(cands, key=lambda c: (-need.get(id(c), 2), c.seq))

    def _free_device_slot(self, cand: Checkpoint) -> int | None:
        """A device slot for `cand`: a free one, or the least needed checkpoint's (spilled or
        dropped); None where `cand` itself is the least needed."""
        used = {c.slot for c in self.checkpoints if not c.on_host and c is not cand}
        free = [i for i in range(len(self._slots)) if i not in used]
        if not free:
            on_dev = [c for c in self.checkpoints if not c.on_host]
            victim = self._eviction_order(on_dev)[0]
            if victim is cand:
                return None
            free = [victim.slot]  # (the victim's slot becomes a host slot's number below)
            self._evict_to_host(victim)
        # prefer a slot whose spill has completed; a pending one makes the stream wait, not the host
        free.sort(key=lambda i: self._slots[i].spilling is not None and not self._slots[i].spilling.query())
        slot = free[0]
        if self._slots[slot].spilling is not None:
            torch.cuda.current_stream(self.device).wait_event(self._slots[slot].spilling)
            self._slots[slot].spilling = None
        return slot

    def _spill_ahead(self) -> None:
        """With the device ring full, move one checkpoint of neither newest role to the host now,
        so that the next checkpoint finds its slot free."""
        on_dev = [c for c in self.checkpoints if not c.on_host]
        if not self._host or len(self._slots) < 2 or len(on_dev) < len(self._slots):
            return
        victim = self._eviction_order(on_dev)[0]
        if id(victim) not in self._need():
            self._evict_to_host(victim)

    def _evict_to_host(self, victim: Checkpoint) -> None:
        """Move a device checkpoint to a host slot (its device slot is free once the copy is done),
        or drop it where the host ring has no room for it."""
        src = self._slots[victim.slot]
        if self._to_host(victim, src.fixed, src.logits if victim.has_logits else None, from_live=False):
            if self._side is not None:
                src.spilling = victim.ready
        else:
            self.checkpoints.remove(victim)

    def _to_host(self, c: Checkpoint, fixed: list, logits: torch.Tensor | None, from_live: bool) -> bool:
        """Copy a checkpoint's tensors into a host slot; False where no host slot may take it."""
        slot = self._host_slot_for(c)
        if slot is None:
            return False
        if self._host[slot] is None:
            self._host[slot] = self._host_slot_storage()
        dst = self._host[slot]
        if self._side is not None and not from_live:
            # after the work that wrote the source; the device slot is reused after `ready`
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                _copy_fixed(dst.fixed, fixed, non_blocking=True)
                if logits is not None:
                    dst.logits.copy_(logits.reshape(-1), non_blocking=True)
                c.ready = torch.cuda.Event()
                c.ready.record(self._side)
        else:
            # from the live state (which the next forward overwrites) on the current stream:
            # ordered before that forward without the host waiting
            _copy_fixed(dst.fixed, fixed, non_blocking=self.device.type == "cuda")
            if logits is not None:
                dst.logits.copy_(logits.reshape(-1), non_blocking=self.device.type == "cuda")
            if self.device.type == "cuda":
                c.ready = torch.cuda.Event()
                c.ready.record(torch.cuda.current_stream(self.device))
        c.slot, c.on_host = slot, True
        return True

    def _host_slot_for(self, c: Checkpoint) -> int | None:
        if not self._host:
            return None
        used = {x.slot for x in self.checkpoints if x.on_host and x is not c}
        free = [i for i in range(len(self._host)) if i not in used]
        if free:
            return free[0]
        on_host = [x for x in self.checkpoints if x.on_host and x is not c]
        victim = self._eviction_order(on_host + [c])[0]
        if victim is c:
            return None
        self.checkpoints.remove(victim)
        if victim.ready is not None:  # its copy may still be landing: later writes queue behind it
            torch.cuda.current_stream(self.device).wait_event(victim.ready)
        return victim.slot

    def _wait_host(self, c: Checkpoint) -> None:
        if c.ready is not None:
            c.ready.synchronize()  # long done in practice: it was copied a turn or more ago
            c.ready = None

    def _copy_from(self, c: Checkpoint) -> None:
        if c.on_host:
            self._wait_host(c)
            _copy_fixed(self._fixed, self._host[c.slot].fixed, non_blocking=self.device.type == "cuda")
        else:
            _copy_fixed(self._fixed, self._slots[c.slot].fixed)

    def _drop(self, which) -> None:
        self.checkpoints = [c for c in self.checkpoints if not which(c)]

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.length, [None if f is None else {k: t.clone() for k, t in f.items()}
                                      for f in self._fixed])

    def restore(self, snap: Snapshot) -> None:
        if snap.length > self.length and not self.has_fixed_state:
            raise RewindError("a KV snapshot can only restore a length at or below the current one")
        _copy_fixed(self._fixed, snap.fixed)
        self.length = snap.length


    # --- the state at a length, as named tensors (engine/state_file.py writes and reads them) -------
    def export(self) -> dict[str, torch.Tensor]:
        """The live state as host tensors, copies: each attention layer's K and V up to `length`
        ("kv.L.k", "kv.L.v"), each fixed-state tensor ("fixed.L.NAME")."""
        n, out = self.length, {}
        for i, (kv, fixed) in enumerate(zip(self._kv, self._fixed)):
            if kv is not None:
                out[f"kv.{i}.k"] = kv[0][:, :n].to("cpu", copy=True).contiguous()
                out[f"kv.{i}.v"] = kv[1][:, :n].to("cpu", copy=True).contiguous()
            else:
                out.update({f"fixed.{i}.{k}": t.to("cpu", copy=True) for k, t in fixed.items()})
        return out

    def layout(self, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The names, shapes and dtypes `export` gives at length n: what `load` checks a file against."""
        out = {}
        for i, (kv, fixed) in enumerate(zip(self._kv, self._fixed)):
            if kv is not None:
                heads, _, dim = kv[0].shape
                out[f"kv.{i}.k"] = out[f"kv.{i}.v"] = ((heads, n, dim), kv[0].dtype)
            else:
                out.update({f"fixed.{i}.{k}": (tuple(t.shape), t.dtype) for k, t in fixed.items()})
        return out

    def load(self, tensors: dict[str, torch.Tensor], n: int) -> None:
        """Make the state what `export` gave at length n: every name, shape and dtype checked
        first (ValueError, the state untouched); then the state is reset, filled and live at n,
        with no checkpoints."""
        if not 0 < n < self.max_context:
            raise ValueError(f"a length of {n} tokens does not fit a context of {self.max_context}")
        want = self.layout(n)
        if set(tensors) != set(want):
            missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
            raise ValueError(f"its tensors are not this model's state (missing {missing[:2]}, unexpected {extra[:2]})")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, this state's is {shape} {dtype}")
        self.reset()
        for i, (kv, fixed) in enumerate(zip(self._kv, self._fixed)):
            if kv is not None:
                kv[0][:, :n].copy_(tensors[f"kv.{i}.k"])
                kv[1][:, :n].copy_(tensors[f"kv.{i}.v"])
            else:
                for k, t in fixed.items():
                    t.copy_(tensors[f"fixed.{i}.{k}"])
        self.length = self.written = n


def _copy_fixed(dst: list, src: list, non_blocking: bool = False) -> None:
    """In-place copy of per-layer fixed state (dicts of tensors; None for attention layers)."""
    for d, s in zip(dst, src):
        if d is not None:
            for k, t in d.items():
                t.copy_(s[k], non_blocking=non_blocking)
