"""Replay many recordings as one suite, loading each model once.

`expand(paths)` lists the recordings (a directory: its *.yaml and *.yml files, sorted). `run_suite`
replays them grouped by the engine settings each one resolves to (model, device, dtype, decode
path), so a group loads its model once (`RuntimeCache`), and returns one `Outcome` per recording in
the order given: identical, near ties (teacher-forced, within the tolerance), a divergence, or
invalid (unreadable, a script, a model that does not load or has another fingerprint). `table()`
renders them; `exit_code()` is 2 if any is invalid, else 1 if any diverged, else 0; `print_report`
prints what `chat replay` prints (one file as it always has, several the table).
"""
from __future__ import annotations

import gc
import glob
import os
import sys
import time
from dataclasses import dataclass

from . import transcript as tr
from .errors import user_errors

IDENTICAL, NEAR_TIES, DIVERGENCE, INVALID = "identical", "near ties", "divergence", "invalid"


@dataclass
class Outcome:
    path: str
    status: str  # IDENTICAL | NEAR_TIES | DIVERGENCE | INVALID
    result: str  # the table's column, e.g. "3 near ties within 1", "divergence: turn 2, generated token 3"
    turns: int = 0
    tokens: int = 0  # the recording's generated tokens
    seconds: float = 0.0  # replay time, the model load not included
    report: str = ""  # the divergence report, the error (one line), or the near ties' listing


@dataclass
class Entry:
    """A recording read and resolved to its settings, or the error that stopped that."""
    path: str
    transcript: tr.Transcript | None = None
    settings: object = None
    error: str = ""

    @property
    def key(self):
        """What one model load serves: the engine settings (model, device, dtype, decode path)."""
        return None if self.settings is None else self.settings.engine


@dataclass
class SuiteResult:
    outcomes: list[Outcome]
    loads: int = 0
    load_seconds: float = 0.0


def expand(paths: list[str]) -> list[str]:
    """Files as given; a directory becomes its *.yaml and *.yml files, sorted (itself, when it has
    none, so that it is reported rather than silently passing)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.yaml")) + glob.glob(os.path.join(p, "*.yml")))
            out.extend(found or [p])
        else:
            out.append(p)
    return out


def load_entry(path: str, settings_of) -> Entry:
    """Read a recording and resolve its settings with `settings_of(transcript)` (`chat replay`'s:
    config and flags, the recorded engine section filling the rest)."""
    if os.path.isdir(path):
        return Entry(path, error=f"{path}: no recordings (*.yaml) in this directory")
    try:
        rec = tr.load(path)
        if not rec.is_recording:
            raise tr.TranscriptError(f"{path}: not a recording (no turn has results); record it with `chat run -o`")
        return Entry(path, rec, settings_of(rec))
    except user_errors() as e:
        return Entry(path, error=str(e))


class RuntimeCache:
    """The runtime of the engine settings asked for last: recordings with the same settings share
    one model load; other settings release it first (one model in memory at a time). A failed load
    is remembered for its settings and raised again for each recording that needs it."""

    def __init__(self, opener=None):
        self._opener = opener  # chat.runtime.open_runtime unless given (tests count the loads)
        self._key = self._rt = self._error = None
        self.loads = 0
        self.load_seconds = 0.0

    def get(self, settings):
        if self._key is None or settings.engine != self._key:
            self.close()
            if self._opener is None:
                from .runtime import open_runtime
                self._opener = open_runtime
            t0 = time.perf_counter()
            try:
                self._rt = self._opener(settings)
                self.loads += 1
            except user_errors() as e:
                self._error = e
            self._key = settings.engine
            self.load_seconds += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        return self._rt

    def close(self) -> None:
        device = getattr(self._rt, "device", None)
        self._key = self._rt = self._error = None
        gc.collect()
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.empty_cache()


def _recorded_size(rec: tr.Transcript | None) -> tuple[int, int]:
    turns = [e.result for e in rec.events if e.result is not None] if rec is not None else []
    return len(turns), sum(len(t["generated_ids"]) for t in turns)


def replay_one(entry: Entry, cache: RuntimeCache, runs: int = 1, tolerance: float | None = None,
               allow_model_change: bool = False) -> Outcome:
    """Replay one recording on its group's runtime: a fresh run and `runs` on the reused session."""
    from .controller import ChatController
    from .replay import Divergence, replay

    turns, tokens = _recorded_size(entry.transcript)
    if entry.error:
        return Outcome(entry.path, INVALID, INVALID, turns, tokens, report=entry.error)
    t0, loading = time.perf_counter(), cache.load_seconds
    try:
        rt = cache.get(entry.settings)
        expected, actual = entry.transcript.model.get("fingerprint"), tr.model_info(rt)["fingerprint"]
        if expected != actual and not allow_model_change:
            raise tr.TranscriptError(f"{entry.path}: recorded with model fingerprint {expected}, this model is "
                                     f"{actual} (use --allow-model-change to compare anyway)")
        result = replay(ChatController(rt, entry.settings), entry.transcript, runs, tolerance=tolerance)
    except Divergence as d:
        outcome = Outcome(entry.path, DIVERGENCE, f"divergence: turn {d.turn}, {d.what} token {d.index}",
                          turns, tokens, report=str(d))
    except user_errors() as e:
        message = str(e)
        if not message.startswith(entry.path):
            message = f"{entry.path}: {message}"
        outcome = Outcome(entry.path, INVALID, INVALID, turns, tokens, report=message)
    else:
        ties = result.distinct_near_ties()
        if ties:
            lines = [f"  {t.describe()}" + (f" (runs {', '.join(r)})" if runs else "") for t, r in ties]
            outcome = Outcome(entry.path, NEAR_TIES, f"{len(ties)} near tie{'s' * (len(ties) != 1)} within "
                              f"{tolerance:g}", turns, tokens, report="\n".join(lines))
        else:
            outcome = Outcome(entry.path, IDENTICAL, IDENTICAL, turns, tokens)
    outcome.seconds = time.perf_counter() - t0 - (cache.load_seconds - loading)
    return outcome


def grouped(entries: list[Entry]) -> list[int]:
    """Indices of `entries` with each engine setting's recordings together, groups in order of first
    appearance (the invalid ones, which load nothing, first)."""
    first: dict = {}
    for i, e in enumerate(entries):
        first.setdefault(e.key, i if e.key is not None else -1)
    return sorted(range(len(entries)), key=lambda i: first[entries[i].key])


def run_suite(paths: list[str], settings_of, runs: int = 1, tolerance: float | None = None,
              allow_model_change: bool = False, opener=None, on_outcome=None) -> SuiteResult:
    """Replay every recording under `paths`; outcomes in the order the paths list them."""
    entries = [load_entry(p, settings_of) for p in expand(paths)]
    cache = RuntimeCache(opener)
    outcomes: list[Outcome | None] = [None] * len(entries)
    try:
        for i in grouped(entries):
            outcomes[i] = replay_one(entries[i], cache, runs, tolerance, allow_model_change)
            if on_outcome is not None:
                on_outcome(outcomes[i])
    finally:
        cache.close()
    return SuiteResult(outcomes, cache.loads, cache.load_seconds)


def exit_code(outcomes: list[Outcome]) -> int:
    if any(o.status == INVALID for o in outcomes):
        return 2
    return 1 if any(o.status == DIVERGENCE for o in outcomes) else 0


def table(outcomes: list[Outcome]) -> str:
    """Columns: file, turns, tokens, result, seconds."""
    rows = [("file", "turns", "tokens", "result", "seconds")]
    rows += [(o.path, str(o.turns), str(o.tokens), o.result, f"{o.seconds:.2f}") for o in outcomes]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    align = (str.ljust, str.rjust, str.rjust, str.ljust, str.rjust)
    return "\n".join("  ".join(a(cell, w) for a, cell, w in zip(align, r, widths)).rstrip() for r in rows)


def summary(suite: SuiteResult) -> str:
    counts = {s: sum(o.status == s for o in suite.outcomes) for s in (IDENTICAL, NEAR_TIES, DIVERGENCE, INVALID)}
    n = len(suite.outcomes)
    return (f"{n} recording{'s' * (n != 1)}: {counts[IDENTICAL]} identical, {counts[NEAR_TIES]} within tolerance, "
            f"{counts[DIVERGENCE]} diverged, {counts[INVALID]} invalid; {suite.loads} model "
            f"load{'s' * (suite.loads != 1)} ({suite.load_seconds:.1f} s)")


def print_report(suite: SuiteResult, single: bool, runs: int) -> int:
    """Print what `chat replay` prints; returns its exit status. One recording, as it always was: a
    line, or the divergence or the error (on stderr). Several: the table, the near ties of each
    file, a summary (their divergences and errors went to stderr as they happened)."""
    if single:
        o = suite.outcomes[0]
        show_problem(o)
        if o.status in (DIVERGENCE, INVALID):
            return exit_code([o])
        done = f"{o.turns} turns, {runs + 1} runs (1 fresh, {runs} on the reused session)"
        print(f"replay within tolerance: {o.result} (teacher-forced): {done}\n{o.report}" if o.status == NEAR_TIES
              else f"replay identical: {done}")
        return 0
    print(table(suite.outcomes))
    for o in suite.outcomes:
        if o.status == NEAR_TIES:
            lines = o.report.splitlines()
            more = [f"  ({len(lines) - 10} more)"] if len(lines) > 10 else []
            print("\n".join([f"{o.path}: {o.result}:", *lines[:10], *more]))
    print(summary(suite))
    return exit_code(suite.outcomes)


def show_problem(outcome: Outcome) -> None:
    """A divergence's report or an invalid recording's error, on stderr."""
    if outcome.status == DIVERGENCE:
        print(outcome.report, file=sys.stderr)
    elif outcome.status == INVALID:
        print(f"chat: error: {outcome.report}", file=sys.stderr)
