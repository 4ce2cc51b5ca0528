"""Slash commands as a table: name → handler(app, arg), usage, help text, completion.

A handler returns nothing, or a user message to send as a turn (/retry). Bad arguments raise
`CommandError`: the REPL prints it with a hint and nothing goes to the model.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from engine.config import ConfigError

from .conversation import think_note, think_text
from . import settings as settings_keys
from .settings import KEY_SECTION


class CommandError(ValueError):
    pass


class ExitRepl(Exception):
    pass


# Keys `/set` may change while the session lives (chat/settings.py's one list); engine keys shape
# the session and need a restart.
SETTABLE = settings_keys.SETTABLE


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    help: str
    handler: Callable
    completions: Callable[[], list[str]] | None = None


def _help(app, arg):
    width = max(len(f"/{c.name} {c.usage}") for c in COMMANDS.values())
    lines = [f"/{c.name} {c.usage}".ljust(width + 2) + c.help for c in COMMANDS.values()]
    lines.append("Enter sends; Alt+Enter inserts a newline; a block between \"\"\" lines is one message.")
    app.renderer.info("\n".join(lines))


def _reset(app, arg):
    app.controller.reset()
    if getattr(app, "store", None) is not None:
        app.store.begin_new()  # the finished conversation stays saved as it was
    app.renderer.info("new conversation")


def _system(app, arg):
    if not arg:
        current = app.controller.conv.system_prompt  # (a /load'ed conversation's own, not only the setting)
        app.renderer.info(f"system prompt: {current!r}" if current else "system prompt: (the template's default)")
        return
    try:
        app.controller.set("system_prompt", arg)
    except ConfigError as e:
        raise CommandError(str(e)) from None
    app.renderer.info("system prompt set")


def _set(app, arg):
    parts = arg.split(None, 1)
    if len(parts) != 2:
        raise CommandError("usage: /set KEY VALUE (keys: " + ", ".join(SETTABLE) + ")")
    key, value = parts
    if key not in SETTABLE:
        if key in KEY_SECTION:
            raise CommandError(f"{key} shapes the session; set it with --{key.replace('_', '-')} and restart")
        raise CommandError(f"unknown key {key!r}; keys: {', '.join(SETTABLE)}")
    try:
        app.controller.set(key, value)
    except ConfigError as e:
        raise CommandError(str(e)) from None
    app.renderer.info(f"{key} = {value}")
    if key == "think" and think_note(app.controller.rt.template, app.controller.conv.think):
        app.renderer.notice(think_note(app.controller.rt.template, app.controller.conv.think))


def _think(app, arg):
    c = app.controller
    if arg:
        try:
            c.set("think", arg.strip())
        except ConfigError as e:
            raise CommandError(str(e)) from None
    app.renderer.info(f"thinking: {think_text(c.rt.template, c.conv.think)}")
    note = think_note(c.rt.template, c.conv.think) if arg else None
    if note:
        app.renderer.notice(note)


def _origin(where: str) -> str:
    """How /show names where a setting's value came from: nothing for a built-in default."""
    return "" if where == "default" else f" ({where})"


def _cpu_int8_lines(c) -> list[str]:
    """/show's cpu_int8 line on the CPU: the setting, what it resolved to and why (auto's rule,
    models.rounding_by_default), and what the library's block products take as inputs."""
    import models
    rt = c.rt
    rounding = models.cpu_rounding(rt.loaded.model) if rt.device.type == "cpu" else ""
    if not rounding:
        return []
    setting, on = c.settings.engine.cpu_int8, bool(getattr(rt.loaded.model, "cpu_int8", False))
    wide = bool(getattr(rt.loaded.model, "cpu_wide", False))
    why = ""
    if setting == "auto":
        why = (" (the layers' blocks are all in rows16, whose products on 16-bit inputs run as fast as on int8 "
               "ones here and keep the fp32 model's replies)" if wide else
               " (the layers hold GGUF blocks, whose products on rounded inputs run faster here)" if on else
               " (no layer's blocks gain from it here: only a Q8_0 head would round, beside int4-plane layers "
               "whose replies stay nearer the fp32 model's)")
    resolved = "wide" if wide else "on" if on else "off"
    return [f"cpu_int8: {setting}{_origin(c.settings.origin('cpu_int8'))} -> {resolved}{why}: {rounding}"]


def _show(app, arg):
    c = app.controller
    rt = c.rt
    s = dataclasses.asdict(c.settings.sampling)
    lines = [f"model: {rt.loaded.source} ({rt.loaded.model_type}, {rt.loaded.n_params / 1e6:.0f}M params, "
             f"{str(rt.dtype).replace('torch.', '')} on {rt.device} ({rt.dtype_reason}), "
             f"weights: {rt.loaded.weight_format})",
             *(f"note: {n}" for n in rt.loaded.notes),
             f"context: {c.context_used}/{c.session.max_context} tokens used; "
             f"{len(c.session.cached)} cached; state {c.session.state.nbytes / 2**20:.1f} MiB",
             f"checkpoints: {c.session.state.describe()}",
             f"decode step: {c.session.decode_path}",
             *_cpu_int8_lines(c),
             f"speculative: {c.session.speculation_text}" + _origin(c.settings.origin("speculative")),
             *([f"kernel plan: {rt.loaded.plan.summary()}; {rt.loaded.plan.decode_bytes() / 1e6:,.1f} MB "
                f"of weights a step (`chat plan` lists it)"] if getattr(rt.loaded, "plan", None) else []),
             f"prefill: {c.session.prefill_path}",
             f"turns: {len(c.turns)}",
             "sampling: " + ", ".join(f"{k}={v}" + _origin(c.settings.origin(k)) for k, v in s.items()),
             f"format: {c.format.describe() if c.format is not None else 'off (free text)'}",
             f"thinking: {think_text(rt.template, c.conv.think)}",
             f"system prompt: {c.conv.system_prompt or '(template default)'}"]
    app.renderer.info("\n".join(lines))


def _stats(app, arg):
    c = app.controller
    if c.last is None:
        app.renderer.info("no turn yet")
        return
    from .render import format_stats
    app.renderer.info(format_stats(c.last.stats, c.context_used, c.session.max_context, finish=True))


def _undo(app, arg):
    dropped = app.controller.undo()
    if dropped is None:
        raise CommandError("nothing to undo")
    app.renderer.info("dropped the last exchange")


@dataclass
class EditTurn:
    """What /edit N TEXT asks the REPL to send: TEXT in place of message N, on a new branch."""
    n: int
    text: str


def _edit(app, arg):
    c = app.controller
    n, _, text = arg.partition(" ")
    if not (n.isascii() and n.isdigit() and 0 < len(n) <= 9):
        raise CommandError("usage: /edit N [TEXT] (N: the message to edit, from 1; /branches lists them)")
    try:
        old = c.edit_text(int(n))
    except ValueError as e:
        raise CommandError(f"/edit {n}: {e}") from None
    if text.strip():
        return EditTurn(int(n), text)
    if not getattr(app, "interactive", False):
        raise CommandError(f"usage: /edit {n} TEXT (piped input and scripts give the new text; on a terminal "
                           f"/edit {n} puts message {n} in the prompt)")
    app.pending_edit, app.next_default = int(n), old
    app.renderer.info(f"editing message {n}: change it and press Enter; its reply starts a new branch "
                      f"(/branches lists them; another command drops the edit)")


def _branches(app, arg):
    c = app.controller
    lines = []
    for k, b in enumerate(c.branches):
        mark = "*" if k == c.current else " "
        where = "from the start" if b.parent is None else f"from branch {b.parent + 1} after exchange {b.fork}"
        last = b.turns[-1].user if b.turns else ""
        last = (last[:57] + "...") if len(last) > 60 else last
        lines.append(f"{mark} {k + 1:2d}  {where}, {len(b.turns)} exchange{'s' * (len(b.turns) != 1)}"
                     + (f": {last!r}" if last else ""))
    app.renderer.info("\n".join(lines))


def _branch(app, arg):
    c = app.controller
    if not (arg.isascii() and arg.isdigit() and 0 < len(arg) <= 9):
        raise CommandError(f"usage: /branch K (K from 1 to {len(c.branches)}; /branches lists them)")
    try:
        c.switch(int(arg) - 1)
    except ValueError as e:
        raise CommandError(f"/branch {arg}: {e}") from None
    app.renderer.info(f"on branch {arg}: {len(c.turns)} exchange{'s' * (len(c.turns) != 1)}")


def _retry(app, arg):
    user = app.controller.pop_for_retry()
    if user is None:
        raise CommandError("nothing to retry")
    return user


def write_problem(path: str) -> str | None:
    """Why a file cannot be written at `path`, or None; asked before writing. The atomic write
    renames a temporary file over the target: it would replace a device or a fifo, and its own
    error names the temporary file, not the target."""
    if not path.strip():
        return "needs a file name"
    target = os.path.realpath(path)
    if os.path.isdir(target):
        return "is a directory; name a file in it"
    if os.path.lexists(target) and not os.path.isfile(target):
        return "is not a regular file; name a file to write"
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        shown = os.path.dirname(os.path.abspath(path))
        if os.path.exists(parent):
            return f"{shown} is not a directory; name another path"
        return f"no such directory {shown}; create it first or name another path"
    return None


def _save(app, arg):
    if not arg:
        raise CommandError("usage: /save FILE")
    if not app.controller.turns:  # (a recording without a turn would not load again)
        raise CommandError(f"/save {arg}: nothing to save yet; send a message first")
    problem = write_problem(arg)
    if problem:
        raise CommandError(f"/save {arg}: {problem}")
    from .transcript import TranscriptError, save_controller
    try:
        save_controller(app.controller, os.path.realpath(arg))  # (through a link, not over it)
    except OSError as e:
        raise CommandError(f"/save {arg}: cannot write: {e.strerror or e}; name another path") from None
    except TranscriptError as e:
        raise CommandError(f"/save {arg}: {e}") from None
    app.renderer.info(f"saved {len(app.controller.turns)} turns to {arg}")


def _load(app, arg):
    if not arg:
        raise CommandError("usage: /load FILE")
    from .constraints import ConstraintError
    from .transcript import TranscriptError, load_into_controller
    try:
        n = load_into_controller(app.controller, arg)
    except (TranscriptError, ConstraintError, OSError) as e:
        raise CommandError(str(e)) from None
    app.renderer.info(f"loaded {n} turns from {arg}")


def _history(app, arg):
    store = getattr(app, "store", None)
    if store is None:
        raise CommandError("conversations are saved only in the interactive REPL")
    entries = store.entries()
    if not entries:
        app.renderer.info(f"no saved conversations in {store.directory}")
        return
    import time
    lines = []
    for e in entries[:20]:
        first = " ".join(e.first.split())
        mark = "*" if store.path and os.path.samefile(e.path, store.path) else " "
        lines.append(f"{mark} {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.mtime))}  {e.turns:3d} turns  "
                     f"{e.model}  {first[:48] + ('…' if len(first) > 48 else '')}\n    {e.path}")
    more = f"\n({len(entries) - 20} older)" if len(entries) > 20 else ""
    app.renderer.info("\n".join(lines) + more + "\n`chat --resume FILE` continues one (`chat --resume`: the latest)")


FORMAT_KINDS = {"json": "json", "schema": "json_schema", "regex": "regex", "grammar": "grammar"}


def _format(app, arg):
    c = app.controller
    if not arg:
        app.renderer.info(f"format: {c.format.describe() if c.format is not None else 'off (free text)'}")
        return
    word, _, rest = arg.partition(" ")
    rest = rest.strip()
    from .constraints import ConstraintError, parse_arg
    if word == "off" and not rest:
        c.set_format(None)
        app.renderer.info("format: off (free text)")
        return
    if word not in FORMAT_KINDS or (word == "json") == bool(rest):
        raise CommandError("usage: /format json | schema FILE|JSON | regex RE | grammar FILE | off")
    try:
        fmt = parse_arg(FORMAT_KINDS[word], rest, f"/format {word}")
        c.set_format(fmt, f"/format {word}" + (f" {rest}" if word != "regex" and not rest.startswith("{") else ""))
    except ConstraintError as e:
        raise CommandError(str(e)) from None
    app.renderer.info(f"format: {fmt.describe()}")


def _model(app, arg):
    if not arg:
        rt = app.controller.rt
        app.renderer.info(f"model: {rt.settings.engine.model} ({rt.loaded.source}); /model PATH|ALIAS switches")
        return
    if app.controller.settings.engine.tensor_parallel > 1:  # (its workers hold the model's shards)
        raise CommandError("/model does not switch a tensor-parallel model; restart chat with --model "
                           f"{arg} --tensor-parallel {app.controller.settings.engine.tensor_parallel}")
    app.switch_model(arg)


def _exit(app, arg):
    raise ExitRepl


COMMANDS: dict[str, Command] = {c.name: c for c in [
    Command("help", "", "list commands", _help),
    Command("reset", "", "start a new conversation", _reset),
    Command("system", "[TEXT]", "show or set the system prompt", _system),
    Command("set", "KEY VALUE", "change a sampling setting (e.g. /set temperature 0)", _set, lambda: SETTABLE),
    Command("edit", "N [TEXT]", "edit message N: its reply starts a new branch (piped: the new TEXT)", _edit),
    Command("branches", "", "list the conversation's branches (* the current one)", _branches),
    Command("branch", "K", "go on from branch K", _branch),
    Command("think", "[on|off|auto]", "a reasoning model's thinking (enable_thinking), or show it", _think,
            lambda: ["on", "off", "auto"]),
    Command("show", "", "settings, model facts, context used and cached tokens", _show),
    Command("stats", "", "the last turn's timing and token counts", _stats),
    Command("undo", "", "drop the last exchange", _undo),
    Command("retry", "", "regenerate the last reply", _retry),
    Command("save", "FILE", "save the conversation as a transcript (YAML)", _save),
    Command("load", "FILE", "resume a conversation from a transcript", _load),
    Command("history", "", "list saved conversations (newest first)", _history),
    Command("format", "[json|schema FILE|regex RE|grammar FILE|off]",
            "constrain replies: JSON, a JSON Schema, a regex or a Lark grammar", _format,
            lambda: ["json", "schema", "regex", "grammar", "off"]),
    Command("model", "[PATH|ALIAS]", "show the model, or continue the conversation on another", _model),
    Command("exit", "", "leave (also Ctrl-D)", _exit),
]}
ALIASES = {"quit": "exit", "q": "exit", "clear": "reset", "?": "help"}


def run_command(app, line: str):
    """Run a slash command line; returns a message to send as a turn, or None."""
    name, _, arg = line[1:].partition(" ")
    name = ALIASES.get(name, name)
    cmd = COMMANDS.get(name)
    if cmd is None:
        raise CommandError(f"unknown command /{name}; /help lists the commands")
    return cmd.handler(app, arg.strip())
