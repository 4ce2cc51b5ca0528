"""Pure, seeded token selection that gives the same token for the same logits on every device.

Version 2 (the default; `SAMPLER_VERSIONS` lists what `make_sampler` builds). Each draw's uniform
comes from a counter-based hash of (seed, turn, token index), `uniform()`: splitmix64 in Python
integers, so no device's random stream is involved. `turn` is the caller's index of the generation
in its conversation: the chat layer passes the number of exchanges before it, so a /retry, or a
turn after /undo, draws with the index of the turn it replaces, and a replay of the recorded events
reproduces it. `index` counts the generation's tokens from 0.

The distribution is computed on the host in float64 from the fp32 logits, in this order: penalties
(repetition, then frequency, then presence, on the tokens of the last `penalty_last_n` of the
context), temperature, top-k (ties at the k-th value kept), then over the candidates in the draw's
order (probability descending, token id ascending) top-p (a token stays while the mass before it is
below top_p of the pool's mass, summed in id order) and min-p (relative to the most likely), then
the inverse CDF at the uniform over the candidates' running sums in that order (their mass: the
last running sum where a filter dropped tokens, else the pool's mass in id order; `draw`).
Temperature 0 is argmax after the penalties, the lowest id on ties.
Every step is one fixed sequence of float64 operations on the host: only a last-bit difference in
`exp` between host CPUs could move a draw, at a uniform within ~1e-16 of a boundary.
Version 1 (`engine/sampling_v1.py`) is the torch.Generator sampler, for the recordings it made.
"""
from __future__ import annotations

import secrets

import torch

from .config import SamplingConfig
from .penalty_window import PenaltyWindow
from .sampling_v1 import SamplerV1

SAMPLER_VERSION = 2
SAMPLER_VERSIONS = (1, 2)

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio


def resolve_seed(seed: int) -> int:
    """-1 means "pick one": the chosen seed is returned so a recording can replay it."""
    return secrets.randbits(63) if seed < 0 else seed


def splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele, Lea and Flood 2014; Vigna's mixing constants) from state x."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, turn: int, index: int) -> float:
    """The draw's uniform in [0, 1): splitmix64 of the seed, the turn xored in and mixed, the index
    xored in and mixed; the top 53 bits as a double. Changing this changes every sampled recording:
    it is pinned by tests/engine/test_sampling.py and belongs to sampler version 2."""
    h = splitmix64(seed & _M64)
    h = splitmix64(h ^ (turn & _M64))
    h = splitmix64(h ^ (index & _M64))
    return (h >> 11) * 2.0 ** -53


def make_sampler(version: int, cfg: SamplingConfig, vocab_size: int, device: torch.device,
                 context: list[int], seed: int, turn: int = 0):
    """The sampler of `version` (1 or 2) for one generation."""
    if version == 1:
        return SamplerV1(cfg, vocab_size, device, context, seed)
    if version == 2:
        return Sampler(cfg, context, seed, turn)
    raise ValueError(f"sampler version {version!r} is not supported (supported: {SAMPLER_VERSIONS})")


class Sampler:
    """Version 2. Calls: `accept` each token that enters the context, `__call__` once per generated
    token (it advances the token index), `log_probs` for the step just drawn (draws nothing)."""
    version = 2

    def __init__(self, cfg: SamplingConfig, context: list[int], seed: int, turn: int = 0):
        self.cfg, self.seed, self.turn = cfg, seed, turn
        self.index = 0
        self.window = PenaltyWindow(cfg, context)

    def accept(self, token: int) -> None:
        """Record a token entering the context (for the penalties' window)."""
        self.window.accept(token)

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] → float64 on the logits' device, after the penalties and the temperature
        (1 when greedy). Widening, the penalties and the divisions are single IEEE operations, one
        kernel each: the same bits on every device (no fused multiply-add can form across them).
        Divisors are tensors on the logits' device: a Python-scalar divisor lets CUDA multiply by
        its reciprocal, one rounding more (log-probs off in the last bit, seen on an H200)."""
        x = logits.detach().to(torch.float64, copy=True).reshape(-1)
        counts = self.window.counts
        if self.window.active and counts:
            cfg = self.cfg
            ids = torch.tensor(sorted(counts), dtype=torch.long, device=x.device)
            n = torch.tensor([counts[i] for i in ids.tolist()], dtype=torch.float64, device=x.device)
            v = x[ids]
            if cfg.repetition_penalty != 1.0:
                v = torch.where(v > 0, v / _divisor(cfg.repetition_penalty, v), v * cfg.repetition_penalty)
            x[ids] = v - n * cfg.frequency_penalty - cfg.presence_penalty
        return x if self.cfg.greedy else x / _divisor(self.cfg.temperature, x)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] fp32 on any device. Returns the chosen token id."""
        index = self.index
        self.index += 1
        if self.cfg.greedy and not self.window.active:
            return int(logits.argmax(-1))  # exact on every device: the first maximum, no transfer
        x = self.processed(logits)
        if self.cfg.greedy:
            return int(x.argmax())
        return draw(x, self.cfg, uniform(self.seed, self.turn, index))

    @property
    def argmax_only(self) -> bool:
        """Whether every draw is the plain argmax of the logits (greedy, no penalties)."""
        return self.cfg.greedy and not self.window.active

    def device_choice(self, logits: torch.Tensor) -> torch.Tensor:
        """Where argmax_only: the draw, left on the logits' device (a 0-d int64 tensor holding the
        id `__call__` returns; the index advances as a call does). The session feeds it to the
        next step before the host knows it (engine/session.py, the pipelined greedy decode)."""
        assert self.argmax_only
        self.index += 1
        return logits.argmax(-1)

    def log_probs(self, logits: torch.Tensor, ids: list[int]) -> list[float]:
        """Log-probabilities of `ids` after the penalties and temperature (1 when greedy), over the
        whole vocabulary, before the truncation filters (so a token that top-p or min-p dropped
        keeps a finite value): what a teacher-forced replay compares."""
        x = self.processed(logits).cpu()
        top = x.max()
        lse = top + torch.log(torch.cumsum(torch.exp(x - top), 0)[-1])
        return [float(x[i] - lse) for i in ids]


def _divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d float64 tensor on `like`'s device: elementwise true division everywhere."""
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def _top_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the k largest of x, ties at the k-th value included (0 < k < len)."""
    top = torch.topk(x, k + 1)
    if top.values[k] < top.values[k - 1]:  # no tie across the boundary: topk's set is the answer
        return torch.sort(top.indices[:k]).values
    return (x >= top.values[k - 1]).nonzero()[:, 0]


def _sorted_top(x: torch.Tensor, m: int) -> torch.Tensor:
    """Positions of the m largest of x (ties at the m-th value included), by value descending and
    position ascending: exactly the first entries of a full stable descending sort."""
    if m >= x.numel():
        return torch.sort(x, descending=True, stable=True).indices
    sel = _top_positions(x, m)  # ascending, so the stable sort keeps ties in id order
    return sel[torch.sort(x[sel], descending=True, stable=True).indices]


def _prefixes(x: torch.Tensor):
    """Growing prefixes of the draw's order (64, 512, ... entries, then all): sorting only what a
    draw needs (a whole vocabulary's float64 sort is slow: bench/sampling_bench.py); a prefix's
    running sums are the full sort's."""
    m = min(64, x.numel())
    while True:
        order = _sorted_top(x, m)
        yield order, order.numel() == x.numel()
        m *= 8


def _cut(e: torch.Tensor, running: torch.Tensor, cfg: SamplingConfig, mass: float) -> int:
    """How many of a prefix of the draw's order top-p and min-p keep (a prefix: the mass before a
    token only grows, its probability only falls); the first always stays."""
    keep = e >= cfg.min_p  # e is relative to the most likely (e = 1): min-p's own rule
    if cfg.top_p < 1.0:
        before = torch.cat([running.new_zeros(1), running[:-1]])
        keep &= before < cfg.top_p * mass
    return max(1, int(keep.logical_not().nonzero()[0, 0]) if not bool(keep.all()) else e.numel())


def _pool(x: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]:
    """After top-k: (the ids in play, ascending, or None for all; their x; exp(x - max); the
    pool's mass, summed in id order), on the host. Top-k selects on x's device (comparisons are
    exact, so the set is the same everywhere): only the pool crosses to the host, not the
    vocabulary (far less work per draw than the whole row in float64: bench/sampling_bench.py)."""
    pool = _top_positions(x, cfg.top_k).cpu() if 0 < cfg.top_k < x.numel() else None
    x = x.cpu() if pool is None else x[pool.to(x.device)].cpu()
    e = torch.exp(x - x.max())
    return pool, x, e, float(torch.cumsum(e, 0)[-1])


def candidates(x: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [vocab] float64 after penalties and temperature. Returns the tokens still in play after
    top-k, top-p and min-p, in the draw's order (probability descending, id ascending), with their
    unnormalized probabilities exp(x - max) and the running sums of those (summed in that order)."""
    pool, x, e_pool, mass = _pool(x, cfg)
    for order, full in _prefixes(x):
        e = e_pool[order]
        running = torch.cumsum(e, 0)
        cut = _cut(e, running, cfg, mass)
        if cut < order.numel() or full:
            order = order[:cut]
            return (order if pool is None else pool[order]), e[:cut], running[:cut]


def draw(x: torch.Tensor, cfg: SamplingConfig, u: float) -> int:
    """x: [vocab] float64 after penalties and temperature; u in [0, 1). The candidate at u times
    their mass in the inverse CDF: that mass is their running sum in the draw's order where top-p
    or min-p dropped tokens, the pool's mass summed in id order where none were dropped (so that
    a draw without those filters sorts only as far as u reaches)."""
    pool, x, e_pool, mass = _pool(x, cfg)
    filtered = cfg.top_p < 1.0 or cfg.min_p > 0.0
    for order, full in _prefixes(x):
        e = e_pool[order]
        running = torch.cumsum(e, 0)
        cut = _cut(e, running, cfg, mass) if filtered else order.numel()
        if cut < order.numel():  # the filters cut inside this prefix: the candidates are known
            j = pick(running[:cut], u * float(running[cut - 1]))
        elif full or (not filtered and float(running[-1]) > u * mass):
            j = pick(running, u * mass)
        else:
            continue
        return int(order[j] if pool is None else pool[order[j]])


def pick(running: torch.Tensor, target: float) -> int:
    """The first position whose running sum exceeds the target; past the end (a target rounded up
    to the total), the last token with mass (a token of zero mass is never chosen)."""
    j = int(torch.searchsorted(running, torch.tensor([target], dtype=running.dtype), right=True)[0])
    if j >= running.numel():
        j = int(torch.searchsorted(running, running[-1:], right=False)[0])
    return j
