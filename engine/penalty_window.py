"""The tokens the repetition, frequency and presence penalties see, counted: the last
`penalty_last_n` tokens of the context (all of them where it is negative, none where it is 0),
kept up to date as tokens enter the context. Both sampler versions read it (engine/sampling.py,
engine/sampling_v1.py); it draws nothing and touches no device.
"""
from __future__ import annotations

from collections import deque

import torch

from .config import SamplingConfig


class PenaltyWindow:
    def __init__(self, cfg: SamplingConfig, context: list[int]):
        self.active = (cfg.repetition_penalty != 1.0 or cfg.frequency_penalty != 0.0
                       or cfg.presence_penalty != 0.0) and cfg.penalty_last_n != 0
        size = None if cfg.penalty_last_n < 0 else cfg.penalty_last_n
        self._window: deque[int] = deque(maxlen=size)
        self.counts: dict[int, int] = {}  # token -> times in the window (only tokens present)
        if self.active:
            for t in context[-size:] if size else context:
                self.accept(t)

    def accept(self, token: int) -> None:
        """A token entered the context."""
        if not self.active:
            return
        w, counts = self._window, self.counts
        if w.maxlen is not None and len(w) == w.maxlen:
            old = w[0]
            counts[old] -= 1
            if not counts[old]:
                del counts[old]
        w.append(token)
        counts[token] = counts.get(token, 0) + 1

    def dense(self, vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The counts as a [vocab_size] tensor (0 for tokens outside the window)."""
        out = torch.zeros(vocab_size, dtype=dtype)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            out[ids] = torch.tensor(list(self.counts.values()), dtype=dtype)
        return out.to(device)
