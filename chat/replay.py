"""Scripted runs, token-exact replay of recordings, and teacher-forced replay with a tolerance.

`play(controller, transcript, ...)` executes a transcript's events on the controller's one
session, exactly as the REPL would (turns, /undo, /retry, /reset, /system, /set, per-event `set`),
and returns the events with their results attached: a recording. With `expect` (a recording),
each turn uses the recorded seed, sampling and sampler version and is compared token by token; the
first difference stops the run with a `Divergence` naming the turn, the token index, the expected
and actual ids and text, and the top-5 candidates at that step (from the no-cache oracle).
With a `tolerance` (a log-probability margin) the replay is teacher-forced: the recorded tokens are
fed whatever the sampler chose, and a step where it chose otherwise is a `NearTie` when the two
tokens' log-probabilities differ by at most the margin, a `Divergence` beyond it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from engine import reference
from engine.config import ConfigError, SamplingConfig, build, quote

from .commands import SETTABLE
from .transcript import (UNSET, Event, Transcript, TranscriptError, check_vocabulary, cpu_isa, result_dict,
                         stated_format)
from .turn import TurnResult, cut_off_notice


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


@dataclass
class NearTie:
    """A teacher-forced step where the replay chose another token within the tolerance. `recorded`
    and `chosen` are "ID 'TEXT'"; log-probabilities after penalties and temperature."""
    run: str
    turn: int
    index: int
    recorded: str
    chosen: str
    logp_recorded: float
    logp_chosen: float

    def describe(self) -> str:
        return (f"turn {self.turn}, token {self.index}: recorded {self.recorded} {self.logp_recorded:.3f}, "
                f"replayed {self.chosen} {self.logp_chosen:.3f}")


@dataclass
class ReplayResult:
    turns: int
    tokens: int  # the recording's generated tokens (each run compares them all)
    near_ties: list[NearTie] = field(default_factory=list)

    def distinct_near_ties(self) -> list[tuple[NearTie, list[str]]]:
        """Each near tie once (the same step often ties in every run), with the runs it came up in."""
        seen: dict[tuple, tuple[NearTie, list[str]]] = {}
        for t in self.near_ties:
            key = (t.turn, t.index, t.recorded, t.chosen)
            seen.setdefault(key, (t, []))[1].append(t.run.split(" ")[1])
        return list(seen.values())


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
                expected: list[int], actual: list[int], context: list[int], notes: tuple[str, ...] = ()) -> Divergence:
    tok = controller.tokenizer
    exp = expected[index] if index < len(expected) else None
    act = actual[index] if index < len(actual) else None
    lines = [f"divergence in {run}: turn {turn} (line {ev.line}), {what} token {index}:",
             f"  expected {_tok(tok, exp)}", f"  actual   {_tok(tok, act)}", *notes]
    if what == "generated":
        s = controller.session
        logits = reference.full_logits(s.model, context + actual[:index], s.device, s.dtype)[-1]
        top = torch.log_softmax(logits.float(), -1).topk(5)
        cands = ", ".join(f"{_tok(tok, int(i))} {float(v):.3f}" for v, i in zip(top.values, top.indices))
        lines.append(f"  top-5 at that step (log-prob): {cands}")
        lines.append(f"  expected text: {tok.decode(expected, skip_special_tokens=True)!r}")
        lines.append(f"  actual text:   {tok.decode(actual, skip_special_tokens=True)!r}")
    return Divergence(run, turn, ev.line, index, what, exp, act, "\n".join(lines))


def _forced_departures(controller, run: str, turn: int, ev: Event, result: TurnResult, tolerance: float,
                       near_ties: list[NearTie]) -> None:
    """Classify a teacher-forced turn's departures: near ties are appended, the first one beyond
    the tolerance raises."""
    tok = controller.tokenizer
    recorded = ev.result["generated_ids"]
    for d in sorted(result.stats.departures, key=lambda d: d.index):
        gap = math.inf if d.logp_forced is None else abs(d.logp_forced - d.logp_chosen)
        if math.isfinite(gap) and gap <= tolerance:
            near_ties.append(NearTie(run, turn, d.index, _tok(tok, d.forced), _tok(tok, d.chosen),
                                     d.logp_forced, d.logp_chosen))
            continue
        if d.logp_forced is None:
            notes = ("  the recording ends here; the replay goes on (teacher-forced: the recorded tokens were fed)",)
        else:
            notes = (f"  log-probs: expected {d.logp_forced:.3f}, actual {d.logp_chosen:.3f}; difference {gap:.3f} > "
                     f"tolerance {tolerance:g} (teacher-forced: the recorded tokens were fed)",)
        raise _divergence(controller, run, turn, ev, "generated", d.index, recorded,
                          recorded[:d.index] + [d.chosen], result.prompt_ids, notes)


def play(controller, transcript: Transcript, on_chunk=None, expect: bool = False, run: str = "run",
         tolerance: float | None = None, near_ties: list[NearTie] | None = None,
         cut_off: list[str] | None = None) -> list[Event]:
    """Execute the events; returns them with results. `expect`: compare with the recorded results;
    with `tolerance` too, teacher-forced, the near ties appended to `near_ties`. `cut_off`: a line
    appended for each reply that ended before its output format was complete."""
    path = transcript.path or "<transcript>"
    controller.sampler_version = transcript.sampler_to_replay if expect else transcript.sampler_to_run
    forcing = expect and tolerance is not None
    near_ties = [] if near_ties is None else near_ties
    controller.conv.system_prompt = transcript.system_prompt or controller.settings.ui.system_prompt
    controller.conv.think = controller.settings.ui.think  # (a run before this one may have switched it)
    _apply_settings(controller, transcript.sampling, f"{path}: sampling")
    controller.set_format(transcript.format, f"{path}: output_format")
    stated = transcript.format  # the format the recording's events have stated so far
    out: list[Event] = []
    turn = 0
    for ev in transcript.events:
        where = f"{path}:{ev.line}"
        _apply_settings(controller, ev.set, where)
        before = stated
        if ev.format is not UNSET:
            controller.set_format(ev.format, f"{where}: output_format")
            stated = ev.format
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
            elif name == "/think":
                controller.set("think", arg.strip())
            elif name == "/set":
                key, _, value = arg.partition(" ")
                _apply_settings(controller, {key: value}, where)
            elif name == "/retry":
                user = controller.pop_for_retry()
                if user is None:
                    raise TranscriptError(f"{where}: /retry with no exchange to retry")
            elif name == "/edit":
                n, user = ev.edit
                try:
                    controller.fork(n)
                except ValueError as e:
                    raise TranscriptError(f"{where}: /edit {n}: {e}") from None
            elif name == "/branch":
                try:
                    controller.switch(int(arg) - 1)
                except ValueError as e:
                    raise TranscriptError(f"{where}: /branch {arg.strip()}: {e}") from None
            if user is None:
                out.append(dataclasses.replace(ev, result=None))
                continue
        fmt = stated_format(controller.format, before)  # each recorded turn states its format
        stated = controller.format
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
        forced = ev.result["generated_ids"] if forcing else None
        expected = ev.result["generated_ids"] if expect and not forcing else None  # (drafts: engine/speculative.py)
        for chunk in controller.send(user, result, seed=seed, forced=forced, expected=expected):
            if on_chunk:
                on_chunk(chunk)
        if on_chunk:
            on_chunk("\n")
        if cut_off is not None and result.cut_off:
            cut_off.append(f"{where}: turn {turn}: " + cut_off_notice(
                result, controller.settings.sampling, controller.session.max_context, "max_new_tokens"))
        if expect:
            rec = ev.result
            i = _first_difference(rec["prompt_ids"], result.prompt_ids)
            if i is not None:
                raise _divergence(controller, run, turn, ev, "prompt", i, rec["prompt_ids"], result.prompt_ids, [])
            if forcing:
                _forced_departures(controller, run, turn, ev, result, tolerance, near_ties)
            i = _first_difference(rec["generated_ids"], result.ids)  # forced: where a stop rule cut it short
            if i is not None:
                raise _divergence(controller, run, turn, ev, "generated", i, rec["generated_ids"], result.ids,
                                  result.prompt_ids)
        out.append(dataclasses.replace(ev, result=result_dict(controller.turns[-1]), format=fmt))
    return out


# The margin the note on another CPU's recordings suggests (a seeded draw that went the other way
# of a near tie moved its log-probability by ~0.01: tests/chat/test_transcripts.py)
OTHER_CPU_TOLERANCE = 0.05


def _other_cpu_note(controller, recording: Transcript) -> str | None:
    """Where a CPU recording was made on kernels for another instruction set than this CPU's: a
    line saying so, as the likely cause of a divergence, and what compares anyway."""
    made, here = recording.engine.get("cpu_isa"), cpu_isa()
    if controller.session.device.type != "cpu" or not made or made == here:
        return None
    return (f"  note: recorded on a CPU with {made} kernels, replayed on {here}'s: they sum in another order "
            f"(not bit for bit), so a near tie may go the other way; --tolerance {OTHER_CPU_TOLERANCE:g} "
            f"replays teacher-forced")


def _other_plan_note(controller, recording: Transcript) -> str | None:
    """Where the recording names the kernel plan it ran on and this one differs: a line saying
    so (other kernels may sum in another order), both plans' summaries bounded."""
    made = recording.engine.get("kernel_plan")
    plan = getattr(controller.rt.loaded, "plan", None)
    if not isinstance(made, str) or plan is None or made == plan.summary():
        return None
    return (f"  note: recorded on another kernel plan ({quote(made)}; here: {quote(plan.summary())}): other "
            f"kernels may sum in another order, so a near tie may go the other way; `chat plan` lists each")


def replay(controller, recording: Transcript, runs: int, on_chunk=None, tolerance: float | None = None) -> ReplayResult:
    """A cold run on a fresh session, then `runs` more on the same reused session; teacher-forced
    with a tolerance. Raises the first Divergence."""
    check_vocabulary(recording, controller.session.vocab_size)  # (a bad file, before any run)
    controller.reset()
    initial = controller.settings
    near: list[NearTie] = []
    try:
        events = play(controller, recording, on_chunk, expect=True, run="run 1 (fresh session)",
                      tolerance=tolerance, near_ties=near)
        for r in range(runs):
            controller.reset_conversation(keep_cache=True)
            controller.settings = initial
            play(controller, recording, None, expect=True, run=f"run {r + 2} (reused session)",
                 tolerance=tolerance, near_ties=near)
    except Divergence as d:
        notes = [n for n in (_other_cpu_note(controller, recording), _other_plan_note(controller, recording)) if n]
        raise (dataclasses.replace(d, report="\n".join([d.report] + notes)) if notes else d) from None
    turns = [e.result for e in events if e.result is not None]
    return ReplayResult(len(turns), sum(len(t["generated_ids"]) for t in turns), near)
