"""Sampler version 1: the torch.Generator sampler, kept bit for bit for the recordings it made.

Order: repetition/frequency/presence penalties over the last `penalty_last_n` tokens of the
context, then temperature, top-k, top-p, min-p, then `torch.multinomial` with an explicit
`torch.Generator` on the logits' device, seeded per generation (every turn draws the same stream).
CPU and CUDA generators give different streams, so a sampled recording replays only on the device
that made it; version 2 (`engine/sampling.py`) does not. All work stays on the logits' device.
"""
from __future__ import annotations

import torch

from .config import SamplingConfig
from .penalty_window import PenaltyWindow


class SamplerV1:
    version = 1

    def __init__(self, cfg: SamplingConfig, vocab_size: int, device: torch.device,
                 context: list[int], seed: int):
        self.cfg = cfg
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.vocab_size, self.device = vocab_size, device
        self.window = PenaltyWindow(cfg, context)

    def accept(self, token: int) -> None:
        """Record a token entering the context (for the penalties' window)."""
        self.window.accept(token)

    def _counts(self) -> torch.Tensor | None:
        """The window's counts as the dense fp32 tensor this version's penalties read (small
        integers: exact in fp32, so the same values as the running tensor this version kept before
        the shared window)."""
        return self.window.dense(self.vocab_size, self.device) if self.window.active else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [vocab] fp32. Returns a 0-d int64 tensor: the chosen token id."""
        return sample(logits, self.cfg, self._counts(), self.generator)

    def log_probs(self, logits: torch.Tensor, ids: list[int]) -> list[float]:
        """Log-probabilities of `ids` after the penalties and temperature (1 when greedy), over the
        whole vocabulary: what a teacher-forced replay compares. Draws nothing."""
        x = logits.float()
        if self.window.active:
            x = apply_penalties(x, self.cfg, self._counts())
        x = x if self.cfg.greedy else x / self.cfg.temperature
        lp = torch.log_softmax(x.double(), -1)
        return [float(lp[i]) for i in ids]


def apply_penalties(logits: torch.Tensor, cfg: SamplingConfig, counts: torch.Tensor) -> torch.Tensor:
    seen = counts > 0
    if cfg.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    return logits - counts * cfg.frequency_penalty - seen.float() * cfg.presence_penalty


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits: [vocab] fp32."""
    logits = logits / cfg.temperature
    neg_inf = torch.finfo(logits.dtype).min
    candidates = None  # where top-k ran: the ids still in play (all others have probability 0)
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, neg_inf)
        candidates = (logits >= kth).nonzero()[:, 0]  # k ids, or a few more on ties at the k-th value
    if cfg.top_p < 1.0:
        # top-p over the candidates only: the masked ids carry zero mass, so this is the same rule
        # as over the whole vocabulary without sorting all of it (the sort was most of a sample)
        pool = logits if candidates is None else logits[candidates]
        sorted_logits, order = torch.sort(pool, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= cfg.top_p
        dropped = order[drop_sorted] if candidates is None else candidates[order[drop_sorted]]
        logits = logits.index_fill(0, dropped, neg_inf)
    if cfg.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < cfg.min_p * probs.max(), neg_inf)
    return logits


def sample(logits: torch.Tensor, cfg: SamplingConfig, counts: torch.Tensor | None,
           generator: torch.Generator) -> torch.Tensor:
    logits = logits.float()
    if counts is not None:
        logits = apply_penalties(logits, cfg, counts)
    if cfg.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, cfg).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
