"""Scripted runs and token-exact replay of recordings.

`play(controller, transcript, ...)` executes a transcript's events on the controller's one
session, exactly as the REPL would (turns, /undo, /retry, /reset, /system, /set, per-event `set`),
and returns the events with their results attached: a recording. With `expect` (a recording),
each turn uses the recorded seed, sampling and sampler version and is compared token by token; the
first difference stops the run with a `Divergence` naming the turn, the token index, the expected
and actual ids and text, and the top-5 candidates at that step (from the no-cache oracle).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine import reference
from engine.config import ConfigError, SamplingConfig, build

from .commands import SETTABLE
from .transcript import Event, Transcript, TranscriptError, result_dict
from .turn import TurnResult


@dataclass
class Divergence(Exception):
    run: str
    turn: int
    line: int
    index: int
    what: str  # "generated" or "prompt"
    expected: int | None
    actual: int | None
    report: str

    def __str__(self) -> str:
        return self.report


def _apply_settings(controller, values: dict, where: str) -> None:
    for key, value in values.items():
        if key not in SETTABLE:
            raise TranscriptError(f"{where}: '{key}' cannot be set in a transcript (settable: {', '.join(SETTABLE)})")
        try:
            controller.set(key, value)
        except ConfigError as e:
            raise TranscriptError(f"{where}: {e}") from None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tok(tokenizer, token: int | None) -> str:
    return "(end)" if token is None else f"{token} {tokenizer.decode([token], skip_special_tokens=False)!r}"


def _divergence(controller, run: str, turn: int, ev: Event, what: str, index: int,
                expected: list[int], actual: list[int], context: list[int]) -> Divergence:
    tok = controller.tokenizer
    exp = expected[index] if index < len(expected) else None
    act = actual[index] if index < len(actual) else None
    lines = [f"divergence in {run}: turn {turn} (line {ev.line}), {what} token {index}:",
             f"  expected {_tok(tok, exp)}", f"  actual   {_tok(tok, act)}"]
    if what == "generated":
        s = controller.session
        logits = reference.full_logits(s.model, context + actual[:index], s.device, s.dtype)[-1]
        top = torch.log_softmax(logits.float(), -1).topk(5)
        cands = ", ".join(f"{_tok(tok, int(i))} {float(v):.3f}" for v, i in zip(top.values, top.indices))
        lines.append(f"  top-5 at that step (log-prob): {cands}")
        lines.append(f"  expected text: {tok.decode(expected, skip_special_tokens=True)!r}")
        lines.append(f"  actual text:   {tok.decode(actual, skip_special_tokens=True)!r}")
    return Divergence(run, turn, ev.line, index, what, exp, act, "\n".join(lines))


def play(controller, transcript: Transcript, on_chunk=None, expect: bool = False, run: str = "run") -> list[Event]:
    """Execute the events; returns them with results. `expect`: compare with the recorded results."""
    path = transcript.path or "<transcript>"
    controller.sampler_version = transcript.sampler_to_replay if expect else transcript.sampler_to_run
    controller.conv.system_prompt = transcript.system_prompt or controller.settings.ui.system_prompt
    _apply_settings(controller, transcript.sampling, f"{path}: sampling")
    out: list[Event] = []
    turn = 0
    for ev in transcript.events:
        where = f"{path}:{ev.line}"
        _apply_settings(controller, ev.set, where)
        user = ev.user
        if ev.command is not None:
            name, _, arg = ev.command.partition(" ")
            if name == "/undo":
                if controller.undo() is None:
                    raise TranscriptError(f"{where}: /undo with no exchange to undo")
            elif name == "/reset":
                controller.reset_conversation(keep_cache=True)
            elif name == "/system":
                controller.set("system_prompt", arg)
            elif name == "/set":
                key, _, value = arg.partition(" ")
                _apply_settings(controller, {key: value}, where)
            elif name == "/retry":
                user = controller.pop_for_retry()
                if user is None:
                    raise TranscriptError(f"{where}: /retry with no exchange to retry")
            if user is None:
                out.append(dataclasses.replace(ev, result=None))
                continue
        turn += 1
        seed = None
        if expect:
            if ev.result is None:
                raise TranscriptError(f"{where}: not a recording (this turn has no recorded result)")
            try:
                controller.settings = dataclasses.replace(
                    controller.settings, sampling=build(SamplingConfig, dict(ev.result["sampling"]), "sampling"))
            except ConfigError as e:
                raise TranscriptError(f"{where}: {e}") from None
            seed = ev.result["seed"]
        result = TurnResult([])
        for chunk in controller.send(user, result, seed=seed):
            if on_chunk:
                on_chunk(chunk)
        if on_chunk:
            on_chunk("\n")
        if expect:
            rec = ev.result
            i = _first_difference(rec["prompt_ids"], result.prompt_ids)
            if i is not None:
                raise _divergence(controller, run, turn, ev, "prompt", i, rec["prompt_ids"], result.prompt_ids, [])
            i = _first_difference(rec["generated_ids"], result.ids)
            if i is not None:
                raise _divergence(controller, run, turn, ev, "generated", i, rec["generated_ids"], result.ids,
                                  result.prompt_ids)
        out.append(dataclasses.replace(ev, result=result_dict(controller.turns[-1])))
    return out


def replay(controller, recording: Transcript, runs: int, on_chunk=None) -> int:
    """A cold run on a fresh session, then `runs` more on the same reused session. Returns turns."""
    controller.reset()
    initial = controller.settings
    events = play(controller, recording, on_chunk, expect=True, run="run 1 (fresh session)")
    for r in range(runs):
        controller.reset_conversation(keep_cache=True)
        controller.settings = initial
        play(controller, recording, None, expect=True, run=f"run {r + 2} (reused session)")
    return sum(1 for e in events if e.result is not None)
