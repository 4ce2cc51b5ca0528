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
- `MtpDrafts`: drafts from the model's multi-token-prediction layer (Qwen3.5 / Qwen3-Next
  checkpoints' `mtp.*`: models/architectures/mtp.py), chained as llama.cpp's draft-mtp chains
  them: the layer's row at position p reads token p and the model's final-normed hidden row of
  p - 1 (zeros where none is known: position 0, or rows fed before the drafts were switched on);
  its greedy token is the draft for p + 1, and its own normed row the hidden row of the next
  draft. The greedy token is chosen among the LM head's first rows, the conversation's tokens
  and the stop ids where the vocabulary is large (models/architectures/mtp.py DraftHead): the
  head's pass is most of a draft's cost on the CPU. The model's rows reach it through
  `CausalLM.hidden_sink`, which the session sets for its own forwards only. Its cache holds a
  row per position; those whose tokens still match the context are kept, the rest recomputed
  (after a verify: the kept drafts' rows, from the model's rows rather than its own).
- `Drafts`: a generation's source: prompt lookup, and with `speculative: mtp` the MTP layer
  where lookup has none (the context does not repeat itself).
- `Depth`: how many drafts to verify, from the measured acceptance (each draft's chance to be
  kept given the ones before it were) and the measured cost of a verify of each size against
  a one-token step: the depth that maximises expected tokens per second, 0 (a plain step)
  where none beats it. A depth of 0 is retried now and then (EXPLORE_EVERY), so acceptance that
  recovers is seen again.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

import torch

from models.architectures.mtp import DRAFT_ROWS, DraftHead

MIN_NGRAM, MAX_NGRAM = 2, 4
MAX_DEPTH = 7  # drafts a verify: 8 rows (the C++ step's row-exact linears take any count; beyond
# this the copy task's gain flattens while a wrong guess costs more: bench/spec_bench.py)
EXPLORE_EVERY = 32  # plain steps between tries of one draft where depth 0 is chosen, times the
# measured cost of such a try in steps (an MTP draft's costs a pass over the LM head and the
# layer's catching up: bench/spec_bench.py --acceptance 0 --mtp), so trying costs ~1/32 of a step
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


class MtpDrafts:
    """The MTP layer's drafts for one session (the module docstring). `sink` is the model's
    hidden_sink while the session feeds; `forget(n)` after the state came from elsewhere than
    this session's forwards (a state file, a reset): rows below n are unknown."""

    CATCH_UP_ROWS = 512  # rows the layer takes at a time when it catches up (a long prompt)

    def __init__(self, model, max_context: int, device, kv_dtype, stop_ids=(), draft_rows: int | None = DRAFT_ROWS):
        """kv_dtype: the layer's cache's (the session's attention caches', as llama.cpp keeps its
        draft context's like its target's). draft_rows: the LM head's first rows a draft is chosen
        among, beside the conversation's tokens and `stop_ids` (models/architectures/mtp.py
        DraftHead; None: the whole head, as llama.cpp's draft-mtp)."""
        self.model, self.head = model, model.mtp
        self.vocab = DraftHead(model.lm_head, draft_rows)
        self.vocab.add(stop_ids)
        self.slots = max_context + MAX_DEPTH + 1  # (drafts run past the context's last position)
        self.device = device
        self.cache = self.head.new_cache(self.slots, device, kv_dtype)
        self.rows = torch.zeros(0, model.config.hidden_size, dtype=torch.float32, device=device)
        self.rows_from = 0  # the model's rows below this position are not known
        self.ids: list[int] = []  # the token of each position whose MTP row the cache holds

    def sink(self, positions: torch.Tensor, normed: torch.Tensor) -> None:
        start, n = int(positions[0]), normed.shape[0]
        if start + n > self.rows.shape[0]:  # (grown as the conversation grows: a row a position)
            grown = torch.zeros(min(self.slots, max(start + n, 2 * self.rows.shape[0], 256)), self.rows.shape[1],
                                dtype=torch.float32, device=self.device)
            grown[:self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[start:start + n] = normed
        self.rows_from = min(self.rows_from, start)

    def forget(self, length: int) -> None:
        self.rows_from = length

    def _hidden(self, start: int, stop: int) -> torch.Tensor:
        """The model's rows of positions start - 1 .. stop - 2 (the inputs of positions start ..
        stop - 1), zeros where unknown."""
        out = torch.zeros(stop - start, self.rows.shape[1], dtype=torch.float32, device=self.device)
        lo = max(start - 1, self.rows_from)
        if lo < stop - 1:
            out[lo - (start - 1):] = self.rows[lo:stop - 1]
        return out

    def _run(self, tokens: list[int], hidden: torch.Tensor, start: int) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), dtype=torch.long, device=self.device)
        return self.head(self.model, ids, hidden, positions, self.cache)

    def _greedy(self, normed: torch.Tensor) -> int:
        return self.vocab.greedy(normed[-1:])

    @torch.inference_mode()
    def propose(self, context: list[int], token: int, k: int) -> list[int]:
        """Up to k drafts for the tokens after `token`, which follows `context` (the cached tokens)."""
        if k <= 0:
            return []
        n = len(context)
        ids = context + [token]
        m = min(len(self.ids), n + 1)  # the cache's rows that still hold these tokens' positions
        if self.ids[:m] != ids[:m]:  # (the longest equal prefix, by halves: list compares run in C)
            lo, hi = 0, m
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.ids[:mid] == ids[:mid] else (lo, mid)
            m = lo
        if m == n + 1:  # (the row of `token` itself is there: run it again for its output row)
            m = n
        self.vocab.add(ids[m:])  # (the conversation's tokens are draftable: a reply quotes its context)
        for start in range(m, n + 1, self.CATCH_UP_ROWS):
            stop = min(n + 1, start + self.CATCH_UP_ROWS)
            out = self._run(ids[start:stop], self._hidden(start, stop), start)
        self.ids = ids
        drafts = [self._greedy(out)]
        while len(drafts) < k and n + len(drafts) < self.slots:
            out = self._run(drafts[-1:], out[-1:], n + len(drafts))
            drafts.append(self._greedy(out))
        return drafts


class Drafts:
    """One generation's drafts: `lookup` (a PromptLookup) first (a repeat of the context, or a
    replay's expected reply, is nearly free and usually right), then `mtp` (the session's
    MtpDrafts, or None) where lookup has none. `cached()`: the session's cached tokens."""

    def __init__(self, lookup: PromptLookup | None, mtp: MtpDrafts | None, cached: Callable[[], list[int]]):
        self.lookup, self.mtp, self.cached = lookup, mtp, cached

    def extend(self, ids) -> None:
        if self.lookup is not None:
            self.lookup.extend(ids)

    def propose(self, k: int, token: int) -> list[int]:
        drafts = self.lookup.propose(k) if self.lookup is not None else []
        if not drafts and self.mtp is not None:
            drafts = self.mtp.propose(self.cached(), token, k)
        return drafts


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
        0 where a plain step is best (but one draft every EXPLORE_EVERY plain steps, scaled by
        what such a draft costs in steps)."""
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
            if self._plain_run >= EXPLORE_EVERY * max(1.0, self.cost(2) / self.cost(1)):
                self._plain_run = 0
                return 1
        else:
            self._plain_run = 0
        return best
