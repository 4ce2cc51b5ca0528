"""Versioned YAML transcripts: scripts (input) and recordings (input + token-level results).

One format for both (documented in docs/TRANSCRIPTS.md). A script lists events; a recording is a
script whose turns also carry what happened: the prompt token ids, the reused-prefix length, the
generated ids, the text, the finish reason, the seed and the sampling settings in force.

    format: chat-transcript
    version: 1
    sampler: 2                                            # the sampler's version (recordings)
    model: {source: smollm2, fingerprint: sha256:…}      # recordings only
    engine: {device: cpu, dtype: float32, cuda_graph: off, max_context: 8192}
    sampling: {temperature: 0, …}                         # starting settings (any subset)
    system_prompt: ""
    events:
      - user: "Hello"                                      # a turn
        set: {temperature: 0.5}                            # optional: applied before this turn
      - command: /undo                                     # /undo /retry /reset /system /set
        output_format: {regex: "[0-9]+"}                   # optional: the output format from here on
A recording without `sampler` predates the field and replays with version 1, the sampler that
made it. Files are read as safe_load reads them (a duplicate key refused) and written atomically.
A transcript is validated whole before anything runs (`parse`): its keys and types, the order of
its events (no /undo or /retry before a turn), every setting against its domain, seeds and token
ids in range; `check_vocabulary` adds the model's vocabulary once a model is loaded. Every problem
is a `TranscriptError` naming the file, the line and the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field

import yaml

from engine import files
from engine.config import SEED_MAX, ConfigError, SamplingConfig, build, quote
from engine.sampling import SAMPLER_VERSION, SAMPLER_VERSIONS

from . import yaml_lines
from .input_files import InputFileError, read_text
from .constraints import ConstraintError, Format, from_yaml
from .settings import YAML_ERRORS, check_settable, yaml_error_message

FORMAT, VERSION = "chat-transcript", 1
SCRIPT_COMMANDS = ("/undo", "/retry", "/reset", "/system", "/set", "/think", "/edit", "/branch")
RESULT_KEYS = ("seed", "sampling", "prompt_ids", "reused", "generated_ids", "text", "finish_reason")
FINISH_REASONS = ("stop", "length", "context", "interrupted", "forced")  # (engine/session.py's)
TOKEN_ID_MAX = 2**31 - 1  # (no vocabulary is larger; `check_vocabulary` then checks the model's own)


class TranscriptError(ValueError):
    """One line for the user, whatever the underlying parser said."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


UNSET = "unset"  # an event without `format`: the format stays as it was


@dataclass
class Event:
    line: int
    user: str | None = None
    command: str | None = None
    set: dict = field(default_factory=dict)
    result: dict | None = None  # RESULT_KEYS, in recordings
    format: Format | None | str = UNSET  # the output format from this event on (None: off)

    @property
    def makes_turn(self) -> bool:
        return self.user is not None or (self.command or "").split(" ")[0] in ("/retry", "/edit")

    @property
    def edit(self) -> tuple[int, str] | None:
        """(n, text) of an `/edit N TEXT` command event, else None."""
        name, _, arg = (self.command or "").partition(" ")
        if name != "/edit":
            return None
        n, _, text = arg.partition(" ")
        return int(n), text


@dataclass
class Transcript:
    events: list[Event]
    model: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    system_prompt: str = ""
    path: str = ""
    sampler: int | None = None  # the sampler's version; None: not given
    format: Format | None = None  # the output format at the start

    @property
    def is_recording(self) -> bool:
        return any(e.result is not None for e in self.events)

    @property
    def sampler_to_run(self) -> int:
        """The version `chat run` records with: the script's, or the current one."""
        return SAMPLER_VERSION if self.sampler is None else self.sampler

    @property
    def sampler_to_replay(self) -> int:
        """The version that made the recording: one without the field predates it (version 1)."""
        return 1 if self.sampler is None else self.sampler


def _err(path: str, line: int, message: str) -> TranscriptError:
    return TranscriptError(f"{path}:{line}: {message}")


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= TOKEN_ID_MAX
                                           for v in value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_event(path: str, raw, index: int) -> Event:
    line = getattr(raw, "line", 0)
    if not isinstance(raw, dict):
        raise _err(path, line, f"event {index + 1} must be a mapping with 'user' or 'command'")
    known = {"user", "command", "set", "output_format", *RESULT_KEYS}
    for key in raw:
        if key not in known:
            raise _err(path, line, f"event {index + 1}: unknown key {quote(key)} (known: {', '.join(sorted(known))})")
    has_user, has_cmd = "user" in raw, "command" in raw
    if has_user == has_cmd:
        raise _err(path, line, f"event {index + 1} needs exactly one of 'user' or 'command'")
    ev = Event(line)
    if has_user:
        if not isinstance(raw["user"], str) or not raw["user"].strip():
            raise _err(path, line, f"event {index + 1}: 'user' must be non-empty text")
        ev.user = raw["user"]
    else:
        cmd = raw["command"]
        if not isinstance(cmd, str) or cmd.split(" ", 1)[0] not in SCRIPT_COMMANDS:
            raise _err(path, line, f"event {index + 1}: command must be one of {', '.join(SCRIPT_COMMANDS)}")
        ev.command = cmd.strip()
        name, _, arg = ev.command.partition(" ")
        if name == "/set":
            key, _, value = arg.strip().partition(" ")
            if not key or not value.strip():
                raise _err(path, line, f"event {index + 1}: usage: /set KEY VALUE")
            _settings(path, line, {key: value.strip()}, f"event {index + 1}: /set: ")
        elif name == "/system":
            _settings(path, line, {"system_prompt": arg}, f"event {index + 1}: /system: ")
        elif name == "/think":
            _settings(path, line, {"think": arg.strip()}, f"event {index + 1}: /think: ")
        elif name == "/edit":
            n, _, text = cmd.lstrip().partition(" ")[2].partition(" ")  # (the text exactly: it is the message)
            if not _ordinal(n) or not text.strip():
                raise _err(path, line, f"event {index + 1}: usage: /edit N TEXT (N: the exchange to edit, from 1)")
            ev.command = f"/edit {int(n)} {text}"
        elif name == "/branch":
            if not _ordinal(arg.strip()):
                raise _err(path, line, f"event {index + 1}: usage: /branch K (K: a branch, from 1)")
        elif arg.strip():
            raise _err(path, line, f"event {index + 1}: {name} takes no argument")
    if "output_format" in raw:
        ev.format = _format(path, line, raw["output_format"], f"event {index + 1}: ")
    if "set" in raw:
        if not isinstance(raw["set"], dict):
            raise _err(path, line, f"event {index + 1}: 'set' must be a mapping of settings")
        _settings(path, getattr(raw["set"], "line", line), raw["set"], f"event {index + 1}: set: ")
        ev.set = dict(raw["set"])
    present = [k for k in RESULT_KEYS if k in raw]
    if present:
        if not ev.makes_turn or len(present) != len(RESULT_KEYS):
            missing = [k for k in RESULT_KEYS if k not in raw]
            raise _err(path, line, f"event {index + 1}: a recorded turn (user, /retry or /edit) needs all of "
                                   f"{', '.join(RESULT_KEYS)}"
                       + (f" (missing {', '.join(missing)})" if missing else ""))
        r = raw
        checks = [(_int_list(r["prompt_ids"]) and r["prompt_ids"],
                   f"prompt_ids must be a non-empty list of token ids in [0, {TOKEN_ID_MAX}]"),
                  (_int_list(r["generated_ids"]), f"generated_ids must be a list of token ids in [0, {TOKEN_ID_MAX}]"),
                  (_count(r["reused"]) and (not _int_list(r["prompt_ids"]) or r["reused"] <= len(r["prompt_ids"])),
                   "reused must be a count >= 0, at most the prompt's length"),
                  (_count(r["seed"]) and r["seed"] <= SEED_MAX, f"seed must be an integer in [0, {SEED_MAX}]"),
                  (isinstance(r["text"], str), "text must be a string"),
                  (r["finish_reason"] in FINISH_REASONS, f"finish_reason must be one of {', '.join(FINISH_REASONS)}"),
                  (isinstance(r["sampling"], dict), "sampling must be a mapping")]
        for ok, message in checks:
            if not ok:
                raise _err(path, line, f"event {index + 1}: {message}")
        _recorded_sampling(path, line, r["sampling"], f"event {index + 1}: sampling: ")
        ev.result = {k: raw[k] for k in RESULT_KEYS}
    return ev


def _settings(path: str, line: int, values: dict, what: str) -> None:
    try:
        check_settable(values)
    except ConfigError as e:
        key_line = getattr(values, "key_lines", {}).get(e.key, line) if e.key is not None else line
        raise _err(path, key_line, f"{what}{e}") from None


def _recorded_sampling(path: str, line: int, values: dict, what: str) -> None:
    """A recorded turn's sampling settings: the SamplingConfig it ran with, whole."""
    try:
        build(SamplingConfig, dict(values), "sampling")
    except ConfigError as e:
        raise _err(path, line, f"{what}{e}") from None


def _ordinal(text: str) -> bool:
    """Whether `text` is a number from 1 (ASCII digits, at most 9 of them)."""
    return text.isascii() and text.isdigit() and 0 < len(text) <= 9 and int(text) > 0


def _check_order(path: str, events: list[Event]) -> None:
    """The events as the REPL would run them: /undo and /retry need an exchange before them on
    the current branch, /edit N an N-th exchange, /branch K a K-th branch."""
    branches, cur = [0], 0  # exchanges per branch; the current one
    for i, ev in enumerate(events):
        name, _, arg = (ev.command or "").partition(" ")
        if name in ("/undo", "/retry") and branches[cur] == 0:
            raise _err(path, ev.line, f"event {i + 1}: {name} with no exchange before it")
        if ev.user is not None:
            branches[cur] += 1
        elif name == "/undo":
            branches[cur] -= 1
        elif name == "/reset":
            branches, cur = [0], 0
        elif name == "/edit":
            n = ev.edit[0]
            if n > branches[cur]:
                raise _err(path, ev.line, f"event {i + 1}: /edit {n}: the current branch has "
                                          f"{branches[cur]} exchange{'s' * (branches[cur] != 1)}")
            branches.append(n)
            cur = len(branches) - 1
        elif name == "/branch":
            k = int(arg)
            if k > len(branches):
                raise _err(path, ev.line, f"event {i + 1}: /branch {k}: there are {len(branches)} branches")
            cur = k - 1


def check_vocabulary(t: Transcript, vocab_size: int) -> None:
    """Every recorded token id is one of the model's `vocab_size` ids: a recording that names
    another is a bad file for this model, not a divergence."""
    for i, ev in enumerate(t.events):
        if ev.result is None:
            continue
        for key in ("prompt_ids", "generated_ids"):
            bad = next((v for v in ev.result[key] if v >= vocab_size), None)
            if bad is not None:
                raise _err(t.path or "<transcript>", ev.line,
                           f"event {i + 1}: {key}: token id {bad} is outside the model's vocabulary "
                           f"(0..{vocab_size - 1}); was it recorded with another model?")


def _format(path: str, line: int, value, what: str = "") -> Format | None:
    try:
        return from_yaml(value, "output_format")
    except ConstraintError as e:
        raise _err(path, line, f"{what}{e}") from None


def parse(text: str, path: str = "<transcript>") -> Transcript:
    try:
        data = yaml_lines.load(text)
    except YAML_ERRORS as e:
        raise TranscriptError(yaml_error_message(path, e)) from None
    if not isinstance(data, dict):
        raise TranscriptError(f"{path}: expected a mapping with 'format: {FORMAT}' and 'events'")
    line = getattr(data, "line", 1)
    if data.get("format") != FORMAT:
        raise _err(path, line, f"not a transcript: 'format' must be {FORMAT!r}")
    if type(data.get("version")) is not int or data.get("version") != VERSION:  # (YAML's true == 1 in Python)
        raise _err(path, line, f"transcript version {quote(data.get('version'))} is not supported (supported: {VERSION})")
    known = {"format", "version", "sampler", "model", "engine", "sampling", "system_prompt", "output_format",
             "events"}
    for key in data:
        if key not in known:
            raise _err(path, line, f"unknown key {quote(key)} (known: {', '.join(sorted(known))})")
    sampler = data.get("sampler")
    if sampler is not None and (isinstance(sampler, bool) or not isinstance(sampler, int)
                                or sampler not in SAMPLER_VERSIONS):
        raise _err(path, line, f"sampler version {quote(sampler)} is not supported "
                               f"(supported: {', '.join(map(str, SAMPLER_VERSIONS))})")
    for key in ("model", "engine", "sampling"):
        if not isinstance(data.get(key, {}), dict):
            raise _err(path, getattr(data.get(key), "line", line), f"'{key}' must be a mapping")
    system = data.get("system_prompt", "") or ""
    if not isinstance(system, str):
        raise _err(path, line, "'system_prompt' must be text")
    _settings(path, line, {"system_prompt": system}, "")
    events = data.get("events")
    if not isinstance(events, list) or not events:
        raise _err(path, line, "'events' must be a non-empty list")
    if "sampling" in data:
        _settings(path, getattr(data["sampling"], "line", line), data["sampling"], "sampling: ")
    start = _format(path, line, data["output_format"]) if "output_format" in data else None
    checked = [_check_event(path, e, i) for i, e in enumerate(events)]
    _check_order(path, checked)
    return Transcript(checked, dict(data.get("model", {})), dict(data.get("engine", {})),
                      dict(data.get("sampling", {})), system, path, sampler, start)


def load(path: str) -> Transcript:
    try:
        text = read_text(path)
    except InputFileError as e:
        raise TranscriptError(str(e)) from None
    return parse(text, path)


# --- writing -----------------------------------------------------------------------------------

def to_yaml(t: Transcript) -> str:
    events = []
    for e in t.events:
        d: dict = {"user": e.user} if e.user is not None else {"command": e.command}
        if e.format is not UNSET:
            d["output_format"] = "off" if e.format is None else e.format.to_yaml()
        if e.set:
            d["set"] = dict(e.set)
        if e.result is not None:
            d.update({k: e.result[k] for k in RESULT_KEYS})
        events.append(d)
    doc = {"format": FORMAT, "version": VERSION, **({"sampler": t.sampler} if t.sampler is not None else {}),
           "model": t.model, "engine": t.engine, "sampling": t.sampling, "system_prompt": t.system_prompt,
           **({"output_format": t.format.to_yaml()} if t.format is not None else {}), "events": events}
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120, default_flow_style=None)


def write_atomic(path: str, text: str) -> None:
    """Write beside the target, fsync, then rename: a reader sees the old file or the new one."""
    def fill(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    files.write_atomic(path, fill, suffix=".yaml")


def fingerprint(files: list[str], extra: str = "") -> str:
    """sha256 over the checkpoint's files (weights, tokenizer, config) and the engine's model type."""
    h = hashlib.sha256(extra.encode())
    for path in files:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()


def recording_from(controller, events: list[Event] | None = None) -> Transcript:
    """The controller's conversation as a recording (events default to its turns)."""
    rt = controller.rt
    if events is None:
        events = tree_events(controller)
    return Transcript(events, model_info(rt), engine_info(rt), dataclasses.asdict(controller.settings.sampling),
                      controller.conv.system_prompt, sampler=controller.sampler_version)


def tree_events(controller) -> list[Event]:
    """The conversation tree as the events that build it: the first branch's turns, then each
    other branch (in the order they were made) as `/branch K` to the emitted branch it shares
    the most exchanges with, `/edit N TEXT` (its first own turn) and its further turns; at the
    end `/branch K` back to the current one. A branch with no turn of its own is left out."""
    events: list[Event] = []
    state = {"format": None, "think": "auto"}
    emitted: list[list] = []  # the emitted branches' turns, in the log's order
    where: dict[int, int] = {}  # controller branch → its index in the log
    log_current = 0

    def turn_event(t, command: str | None = None) -> Event:
        # (a turn rendered with another `think` than the one before: a `set` says so, as a script would)
        changed = {"think": t.think} if t.think != state["think"] else {}
        ev = Event(0, user=None if command else t.user, command=command, result=result_dict(t),
                   format=stated_format(t.format, state["format"]), set=changed)
        state["format"], state["think"] = t.format, t.think
        return ev

    for b, branch in enumerate(controller.branches):
        if b == 0:
            events += [turn_event(t) for t in branch.turns]
            emitted.append(branch.turns)
            where[0] = 0
            continue
        shared = [next((i for i, (x, y) in enumerate(zip(e, branch.turns)) if x is not y), min(len(e), len(branch.turns)))
                  for e in emitted]
        best = max(range(len(emitted)), key=lambda i: shared[i])
        n = shared[best]
        if n >= len(branch.turns):
            continue  # (all of it is in an emitted branch already)
        if best != log_current:
            events.append(Event(0, command=f"/branch {best + 1}"))
        events.append(turn_event(branch.turns[n], f"/edit {n + 1} {branch.turns[n].user}"))
        events += [turn_event(t) for t in branch.turns[n + 1:]]
        emitted.append(branch.turns)
        log_current = where[b] = len(emitted) - 1
    target = where.get(controller.current, max(range(len(emitted)), key=lambda i: len(emitted[i])
                                                if emitted[i] == controller.turns[:len(emitted[i])] else -1))
    if target != log_current:
        events.append(Event(0, command=f"/branch {target + 1}"))
    return events


def stated_format(fmt: Format | None, before: Format | None):
    """What a recorded turn writes as its `output_format`: the format in force when there is one, `off`
    (None) where one was in force before it, else nothing (UNSET). So each turn of a recording
    states its format, whether it is read event by event or as a script's settings that persist."""
    if fmt is not None:
        return fmt
    return None if before is not None else UNSET


def result_dict(turn) -> dict:
    r = turn.result
    return {"seed": r.stats.seed, "sampling": dict(turn.settings), "prompt_ids": list(r.prompt_ids),
            "reused": r.stats.reused_tokens, "generated_ids": list(r.ids), "text": r.text,
            "finish_reason": r.finish_reason}


def model_info(rt) -> dict:
    if not hasattr(rt, "_fingerprint"):
        rt._fingerprint = fingerprint(rt.loaded.files, rt.loaded.model_type)
    return {"source": rt.settings.engine.model, "type": rt.loaded.model_type, "fingerprint": rt._fingerprint}


def cpu_isa() -> str:
    """The vector instruction set this CPU's kernels are built for (torch's own and, as -march=native,
    the C++ step's): "AVX512", "AVX2", ... Kernels for another set sum in another order."""
    import torch
    return torch.backends.cpu.get_cpu_capability()


def engine_info(rt) -> dict:
    info = {"device": rt.device.type, "dtype": str(rt.dtype).replace("torch.", ""),
            "cuda_graph": rt.settings.engine.cuda_graph, "quantized": rt.settings.engine.quantized,
            "compile": rt.settings.engine.compile, "cpu_kernel": rt.settings.engine.cpu_kernel,
            # (auto as it resolved for this model and CPU: a replay elsewhere takes the same products)
            "cpu_int8": rt.settings.engine.cpu_int8 if rt.settings.engine.cpu_int8 != "auto" else
            "wide" if getattr(rt.loaded.model, "cpu_wide", False) else
            "on" if getattr(rt.loaded.model, "cpu_int8", False) else "off",
            "max_context": rt.session.max_context}
    if rt.device.type == "cpu":  # (not a setting: a replay elsewhere names it where tokens differ)
        info["cpu_isa"] = cpu_isa()
    plan = getattr(rt.loaded, "plan", None)
    if plan is not None:  # (not a setting either: which kernel served each op, for replay's note)
        info["kernel_plan"] = plan.summary()
    return info


def save_controller(controller, path: str) -> None:
    write_atomic(path, to_yaml(recording_from(controller)))


def load_into_controller(controller, path: str) -> int:
    """Resume a conversation: its messages (and system prompt) replace the current ones."""
    t = load(path)
    check_vocabulary(t, controller.session.vocab_size)
    from engine.session import GenerationStats

    from .controller import Branch, TurnRecord
    from .turn import TurnResult

    branches, cur = [Branch()], 0
    fmt, think = t.format, "auto"
    for e in t.events:
        if e.format is not UNSET:
            fmt = e.format
        think = str(e.set.get("think", think))
        turns = branches[cur].turns
        if e.command is not None:
            name, _, arg = e.command.partition(" ")
            if name in ("/undo", "/retry") and turns:
                user = turns.pop().user
            elif name == "/reset":
                branches, cur = [Branch()], 0
            elif name == "/branch":
                cur = int(arg) - 1  # (_check_order found it)
            elif name == "/edit":
                n, user = e.edit
                branches.append(Branch(list(turns[:n - 1]), cur, n - 1))
                cur = len(branches) - 1
                turns = branches[cur].turns
            if name not in ("/retry", "/edit"):
                continue
        else:
            user = e.user
        if e.result is None:
            raise TranscriptError(f"{path}:{e.line}: this is a script (no replies recorded); run it with `chat run`")
        r = e.result
        stats = GenerationStats(prompt_tokens=len(r["prompt_ids"]), reused_tokens=r["reused"],
                                generated_tokens=len(r["generated_ids"]), finish_reason=r["finish_reason"],
                                seed=r["seed"])
        turns.append(TurnRecord(user, TurnResult(r["prompt_ids"], r["generated_ids"], r["text"],
                                                   r["finish_reason"], stats), r["sampling"], fmt, think))
    controller.set_format(fmt, f"{path}: format")  # the format in force at its end
    controller.reset_conversation(keep_cache=True)
    controller.sampler_version = t.sampler_to_replay  # its turns' sampler: a later /save stays replayable
    controller.conv.system_prompt = t.system_prompt
    turns = branches[cur].turns
    if turns:
        controller.set("think", turns[-1].think)  # (the mode its last turn was rendered in)
    controller.branches = branches
    controller.switch(cur)
    return len(turns)
