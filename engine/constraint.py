"""Constrained decoding: a token mask each step, applied to the logits before the sampler.

A `TokenConstraint` (built by the chat layer from a grammar and the tokenizer) knows token ids
only: it fills a packed bitmask of the tokens allowed next (bit i % 32 of int32 word i // 32) and
consumes each token that enters the reply. The mask for the next token depends only on the tokens
already chosen, so `ConstraintMask` computes it on the host once the forward for the previous
token is launched: on CUDA the launch returns at once (a graph replay), and the host computes the
mask while the GPU runs the step. Disallowed logits become
-inf (out of place: the logits a checkpoint saved, or a CUDA graph's output, are left as they
are). On CUDA the words cross from pinned host memory and are applied by one kernel
(models/ops/logits.py), without a host sync; where the logits are the same tensor step
after step (a CUDA graph's output), the upload and the kernel are themselves a small CUDA graph,
one replay a step: at ~2,400 tokens/s the host's launches were what a constrained token cost.
The returned logits are then a buffer the next `apply` overwrites (as a graph's output is).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch


class ConstraintDeadEnd(ValueError):
    """The constraint allows no token at a step (a grammar that cannot go on): one line for the user."""


class TokenConstraint(Protocol):
    mask_words: int  # int32 words of the bitmask: at least ceil(vocab / 32)

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed set for the next token into `out` (int32 [mask_words], host, contiguous)."""

    def consume(self, token: int) -> bool:
        """The token entered the reply; False: the grammar rejects it (the constraint is then done)."""

    def error(self) -> str:
        """Why the constraint stopped or failed, for messages ("" when it has not)."""


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """One worker for the whole process: masks of one generation are sequential by nature."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-mask")
    return _POOL


class DeviceMasks:
    """A session's CUDA resources for masks, kept between its generations (one at a time): the
    pinned host words, their device copy, the masked logits' buffers, and the graphs that upload
    and apply one host buffer's words to one logits tensor. A graph is captured the second time
    the same logits tensor comes (address, dtype, size): the first time runs eagerly, which also
    compiles the kernel. Replaying a graph reads whatever that address holds then, which is the
    logits passed, since they are at the address the key names."""

    def __init__(self, device: torch.device, words: int):
        self.device, self.words = device, words
        self.host = [torch.zeros(words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.dev = torch.empty(words, dtype=torch.int32, device=device)
        self.out: dict[tuple, torch.Tensor] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple] = set()

    def apply(self, slot: int, logits: torch.Tensor) -> torch.Tensor:
        from models.ops.logits import masked_logits
        shape = (logits.dtype, logits.numel())
        out = self.out.get(shape)
        if out is None:
            out = self.out[shape] = torch.empty(logits.numel(), dtype=logits.dtype, device=self.device)
        key = (slot, logits.data_ptr()) + shape
        graph = self.graphs.get(key) if logits.is_contiguous() else None
        if graph is not None:
            graph.replay()
        elif key in self.seen and logits.is_contiguous():
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            # thread-local: a checkpoint spill on another thread may allocate pinned memory meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # synchronizes: once a tensor
                self.dev.copy_(self.host[slot], non_blocking=True)
                masked_logits(logits, self.dev, out)
            graph.replay()
        else:
            self.seen.add(key)
            self.dev.copy_(self.host[slot], non_blocking=True)
            masked_logits(logits.contiguous(), self.dev, out)
        return out.view(logits.shape)


class ConstraintMask:
    """One generation's masks. `start()` before the prefill, `advance(token)` before each decode
    forward (consume + next mask), `apply(logits)` before each draw.

    The consume and the next mask run inline in `apply`, after the forward: on CUDA that is while
    the GPU runs the launched step, and the packed words go to the device from pinned memory
    without a sync, to be applied there (DeviceMasks); on the CPU the forward has used every core
    by then.
    `overlap: True` computes them on a worker thread instead, from `advance` on: on the CPU that
    takes a core from the forward, and on CUDA a decode step is too short to hide the thread's
    hand-offs (bench/constrained_bench.py --overlap measures both)."""
    overlap: bool | None = None  # None: inline

    def __init__(self, constraint: TokenConstraint, vocab_size: int, device: torch.device,
                 device_masks: dict | None = None):
        """`device_masks`: a dict the session keeps, where CUDA resources (DeviceMasks) live
        between its generations; without one they last this generation only."""
        self.c, self.vocab, self.device = constraint, vocab_size, device
        words = max(constraint.mask_words, (vocab_size + 31) // 32)
        cuda = device.type == "cuda"
        self._overlap = bool(self.overlap)
        self._uploaded = [None, None]  # CUDA events: that buffer's copy has run
        if cuda:
            kept = {} if device_masks is None else device_masks
            self._masks = kept.get(words)
            if self._masks is None:
                self._masks = kept[words] = DeviceMasks(device, words)
            # two host buffers: one is filled while the other's upload may still be queued
            self._host = self._masks.host
        else:
            self._host = [torch.zeros(words, dtype=torch.int32) for _ in range(2)]  # unpacked on the host, where it is filled: one bool per token, True = not allowed
            self._blocked = [torch.ones(words * 32, dtype=torch.bool) for _ in range(2)]
        self._slot = 0
        self._pending: Future | None = None
        self._token: int | None = None  # inline: the token to consume before the next mask
        self.index = 0  # the step whose mask is next
        self.rejected: int | None = None  # the first token the grammar rejected (a forced one)
        self.dead_end = ""

    def _fill(self, slot: int, token: int | None) -> None:
        if token is not None and not self.c.consume(token):
            self.rejected = token
            return
        event = self._uploaded[slot]
        if event is not None:
            event.synchronize()  # the previous upload from this buffer has been read
        buf = self._host[slot]
        buf.zero_()
        self.c.fill_mask(buf[: self.c.mask_words])
        self.dead_end = self.c.error()  # a grammar that cannot go on (its mask: end of turn at most)
        if self.device.type != "cuda":  # bit i % 32 of word i // 32, little-endian words: bit order "little"
            self._blocked[slot].numpy()[:] = np.unpackbits((~buf.numpy()).view(np.uint8), bitorder="little")

    def _submit(self, token: int | None) -> None:
        if self._overlap:
            self._pending = _pool().submit(self._fill, self._slot, token)
        else:
            self._token, self._pending = token, None

    def start(self) -> None:
        self._submit(None)

    def advance(self, token: int) -> None:
        """`token` was chosen (or forced): consume it and compute the next mask (on the worker
        where overlapping, else when `apply` asks)."""
        if self.rejected is not None:
            return
        self._slot ^= 1
        self.index += 1
        self._submit(token)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] fp32 on the device → the same with disallowed tokens at -inf. After a
        rejected (forced) token the constraint is done and the logits pass unmasked."""
        if self._pending is not None:
            self._pending.result()  # the worker's exceptions surface here
        else:
            self._fill(self._slot, self._token)
            self._token = None
        if self.rejected is not None:
            return logits
        host = self._host[self._slot]
        if self.dead_end or not host.numpy().any():
            why = self.dead_end.strip().splitlines()[0] if self.dead_end.strip() else ""
            raise ConstraintDeadEnd(f"the output format allows no token at generated token {self.index}"
                                    + (f" ({why})" if why else ""))
        if self.device.type == "cuda":
            out = self._masks.apply(self._slot, logits)
            event = self._uploaded[self._slot] = self._uploaded[self._slot] or torch.cuda.Event()
            event.record()
            return out
        # numpy, one thread: torch's masked_fill wakes its thread pool for a vocabulary row, which
        # on a loaded machine waited up to a scheduler slice (bench/constrained_bench.py's mask time)
        x = logits.detach().reshape(-1).numpy().copy()
        np.putmask(x, self._blocked[self._slot].numpy()[: self.vocab], -np.inf)
        return torch.from_numpy(x).view(logits.shape)
