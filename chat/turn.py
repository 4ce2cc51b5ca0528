"""One turn: prompt ids → streamed text chunks, with stop strings and clean UTF-8.

`run_turn` drives `DecodeSession.generate` and yields text as it becomes final. Stop strings are
text, so they live here: text is held back while it could still be the start of a stop string,
and on a match the generation is closed (its committed state stays valid). The result records
the token ids (end-of-turn id included), the text, the finish reason and the session's stats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.config import SamplingConfig
from engine.sampling import SAMPLER_VERSION
from engine.session import DecodeSession, GenerationStats

from .detok import IncrementalDecoder


@dataclass
class TurnResult:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "interrupted"
    stats: GenerationStats = field(default_factory=GenerationStats)
    cut_off: bool = False  # an output format was in force and the reply ended before completing it


EXIT_CUT_OFF = 3  # one-shot and piped runs: a constrained reply was cut off (chat/__main__.py, repl.py)


def cut_off_notice(result: TurnResult, sampling: SamplingConfig, max_context: int, raise_hint: str) -> str:
    """One line for a reply that ended before its output format was complete; `raise_hint` says
    how to raise max_new_tokens here (a flag, or /set)."""
    why = {"length": f"stopped at max_new_tokens ({sampling.max_new_tokens})",
           "context": f"filled the context ({max_context} tokens)",
           "stop": "was ended by a stop string"}.get(result.finish_reason, f"ended ({result.finish_reason})")
    todo = {"length": f"raise {raise_hint} or ask for less",
            "context": "raise max_context or start a new conversation",
            "stop": "remove the stop string"}.get(result.finish_reason, "try again")
    return f"the reply {why} before its output format was complete: it is cut off, not valid; {todo}"


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still begin a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _completes(constraint, ids: list[int], eos_ids) -> bool:
    """Whether a constrained reply completed its format: it ended with the end-of-turn id (allowed
    only once the grammar is complete), or its last token, which a reply stopped by max_new_tokens
    or the context never fed to the constraint, completed it."""
    if ids and ids[-1] in eos_ids:
        return True
    try:
        return bool(ids) and constraint.consume(ids[-1]) and bool(getattr(constraint, "accepting", False))
    except Exception:  # (a matcher already in error: not complete)
        return False


def run_turn(session: DecodeSession, tokenizer, prompt_ids: list[int], sampling: SamplingConfig,
             seed: int | None, result: TurnResult, *, turn: int = 0, sampler: int = SAMPLER_VERSION,
             forced: list[int] | None = None, constraint=None, expected: list[int] | None = None) -> Iterator[str]:
    """Yields text chunks; fills `result` as it goes (also when interrupted). `turn`, `sampler`,
    `forced`, `constraint` (the output format's mask) and `expected` go to `DecodeSession.generate`."""
    # raises before touching state
    tokens = session.generate(prompt_ids, sampling, seed=seed, turn=turn, sampler=sampler, forced=forced,
                              constraint=constraint, expected=expected)
    decoder = IncrementalDecoder(tokenizer)
    stops = list(sampling.stop)
    emitted = 0
    try:
        for token in tokens:
            result.ids.append(token)
            if token in session.eos_ids:
                continue  # the session ends the generation after its end-of-turn id
            decoder.push(token)
            text = decoder.text
            if stops:
                hit = min((text.find(s) for s in stops if s in text), default=-1)
                if hit >= 0:
                    result.text = text[:hit]
                    yield text[emitted:hit]
                    result.finish_reason = "stop"
                    result.cut_off = constraint is not None  # (the grammar needs its end of turn)
                    return
                safe = len(text) - _held_back(text, stops)
            else:
                safe = len(text)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        decoder.flush()
        result.text = decoder.text
        if len(result.text) > emitted:
            yield result.text[emitted:]
        result.finish_reason = session.last_stats.finish_reason
        result.cut_off = constraint is not None and not _completes(constraint, result.ids, session.eos_ids)
    finally:
        tokens.close()
        if result.finish_reason == "interrupted":
            result.text = decoder.text
        result.stats = session.last_stats
        result.stats.finish_reason = result.finish_reason
