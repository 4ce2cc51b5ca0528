"""Speculative decoding's two host-side parts: where drafts come from, and how many to verify.

Contract. A draft is a guess at the next tokens; the session feeds the last chosen token and the
drafts in one forward (a verify: each row's logits bit for bit what a one-token step gives, the
step's `verify`), draws each row's token with the generation's own sampler, keeps the drafts up
to the first that differs from its row's draw, and unfeeds the rest (engine/session.py). So the
tokens are those of plain decoding whatever the drafts are: a draft only decides how many
tokens one forward yields.

- `PromptLookup`: the n-gram drafter (prompt lookup decoding, Saxena 2023): the longest suffix of
  the context (up to MAX_NGRAM tokens, at least MIN_NGRAM) that occurred before, and the tokens
  that followed its latest occurrence. No weights; it pays where a reply quotes, edits or
  repeats its input. An index of each n-gram's latest position, kept as tokens arrive. In a
  replay (`chat replay`), the recorded reply is drafted first: a replay that reproduces its
  recording verifies it several tokens a forward.
- `Depth`: how many drafts to verify, from the measured acceptance (each draft's chance to be
  kept given the ones before it were) and the measured cost of a verify of each size against
  a one-token step: the depth that maximises expected tokens per second, 0 (a plain step)
  where none beats it. A depth of 0 is retried now and then (EXPLORE_EVERY), so acceptance that
  recovers is seen again.
"""
from __future__ import annotations

import statistics
from collections import deque

MIN_NGRAM, MAX_NGRAM = 2, 4
MAX_DEPTH = 7  # drafts a verify: 8 rows (the C++ step's row-exact linears take any count; beyond
# this the copy task's gain flattens while a wrong guess costs more: bench/spec_bench.py)
EXPLORE_EVERY = 32  # plain steps between tries of one draft where depth 0 is chosen
DECAY = 0.9  # the acceptance's memory, per verify
COST_SAMPLES = 5  # timings a size's cost is the median of (the machine's noise is one-sided and bursty)
MARGIN = 0.05  # a verify must promise this much over a plain step (timings are noisy: bench/spec_bench.py
# --acceptance 0 measures what a wrong choice costs)


class PromptLookup:
    """Drafts from the context's own n-grams. `extend` every token that enters the context (the
    prompt at the start, then each token of the reply), `propose(k)` up to k draft ids.
    `expected`: the reply a recording holds (a replay): drafted first, while the reply follows it."""

    def __init__(self, context: list[int], expected: list[int] | None = None):
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram → where its latest occurrence ends
        self.extend(context)
        self.expected = list(expected or [])
        self.reply = 0  # the reply's tokens so far, while they equal the expected ones (else -1)

    def extend(self, ids) -> None:
        for t in ids:
            self.tokens.append(int(t))
            if getattr(self, "expected", None) is not None and self.reply >= 0:
                on_track = self.reply < len(self.expected) and self.expected[self.reply] == int(t)
                self.reply = self.reply + 1 if on_track else -1
            end = len(self.tokens)
            # each n-gram ending here, indexed after the lookups that precede it: propose() looks
            # for an earlier occurrence of the current suffix, never the suffix itself
            if end > 1:
                for n in range(MIN_NGRAM, min(MAX_NGRAM, end - 1) + 1):
                    self.latest[tuple(self.tokens[end - n - 1:end - 1])] = end - 1

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix (the context's last token's own n-grams are not yet indexed: see extend)."""
        toks = self.tokens
        if k > 0 and self.reply >= 0 and self.reply < len(self.expected):
            return self.expected[self.reply:self.reply + k]
        if k <= 0 or len(toks) < MIN_NGRAM:
            return []
        for n in range(min(MAX_NGRAM, len(toks)), MIN_NGRAM - 1, -1):
            end = self.latest.get(tuple(toks[-n:]))
            if end is not None:
                return toks[end:end + k]
        return []


class Depth:
    """The number of drafts to verify (the module docstring). `costs[r]`: the running seconds of
    a forward of r rows (r = 1: a plain step); `observe_*` feed it, `choose(room)` asks."""

    def __init__(self, max_depth: int = MAX_DEPTH):
        self.max_depth = max_depth
        self.costs: dict[int, float] = {}  # rows → the median of its last COST_SAMPLES timings
        self._samples: dict[int, deque] = {}
        self._warm: set[int] = set()  # sizes timed once: that first call pays its allocations
        self.kept, self.tried = 0.5, 1.0  # acceptance prior 1/2, the weight of one trial
        self._plain_run = 0

    @property
    def acceptance(self) -> float:
        return self.kept / self.tried

    def observe_cost(self, rows: int, seconds: float) -> None:
        if rows not in self._warm:
            self._warm.add(rows)
            return
        samples = self._samples.setdefault(rows, deque(maxlen=COST_SAMPLES))
        samples.append(seconds)
        self.costs[rows] = statistics.median(samples)

    def observe(self, accepted: int, drafted: int) -> None:
        """A verify of `drafted` drafts kept the first `accepted`: that many trials passed, and
        one failed unless all were kept."""
        self.kept = DECAY * self.kept + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)

    def cost(self, rows: int) -> float:
        """The measured cost of `rows` rows, or where unmeasured a line through the measured sizes
        (a plain step's cost and the nearest measured verify), at least a step's."""
        one = self.costs.get(1)
        if rows in self.costs:  # (no cheaper than fewer rows: a lower timing is noise)
            return max([self.costs[rows]] + [c for r, c in self.costs.items() if r < rows])
        if one is None:
            return float(rows)
        known = sorted(r for r in self.costs if r > 1)
        if not known:
            return one * (1 + 0.25 * (rows - 1))  # a first guess: each row a quarter of a step
        r = min(known, key=lambda r: abs(r - rows))
        per_row = max(0.0, (self.costs[r] - one) / (r - 1))
        return one + per_row * (rows - 1)

    def choose(self, room: int) -> int:
        """Drafts to verify now, at most `room`: the depth of the most expected tokens per second,
        0 where a plain step is best (but one draft every EXPLORE_EVERY plain steps)."""
        room = min(room, self.max_depth)
        if room <= 0:
            return 0
        a = self.acceptance
        best, best_rate, expected = 0, 1.0 / self.cost(1), 1.0
        for k in range(1, room + 1):
            expected += a ** k  # tokens a verify of k drafts yields: 1 + a + ... + a^k
            rate = expected / self.cost(k + 1)
            if rate > best_rate * (1 + MARGIN if best == 0 else 1):
                best, best_rate = k, rate
        if best == 0:
            self._plain_run += 1
            if self._plain_run >= EXPLORE_EVERY:
                self._plain_run = 0
                return 1
        else:
            self._plain_run = 0
        return best
