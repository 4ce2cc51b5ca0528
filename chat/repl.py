"""The REPL: a prompt-toolkit loop over one ChatController (one DecodeSession) for the process.

On a terminal: line editing, persistent history ($XDG_STATE_HOME/chat/history), multi-line input
(Alt+Enter inserts a newline; a block between \"\"\" lines is one message), bracketed paste,
completion of slash commands and /set keys. Piped stdin: plain lines, byte-stable output.
Ctrl-C during a reply stops that turn only (the conversation and state are as before it);
Ctrl-C on an empty prompt, or Ctrl-D, exits.
"""
from __future__ import annotations

import os
import signal
import sys

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from engine.session import ContextOverflow, ReuseMismatch

from .commands import COMMANDS, CommandError, ExitRepl, run_command
from .controller import ChatController
from .input_text import stdin_lines
from .render import Renderer
from .runtime import open_runtime
from .settings import Settings
from .template import TemplateError
from .turn import TurnResult

BLOCK = '"""'


class SlashCompleter(Completer):
    def get_completions(self, document, complete_event):
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        if " " not in text:
            for name in COMMANDS:
                if name.startswith(text[1:]):
                    yield Completion("/" + name, start_position=-len(text))
            return
        name, _, rest = text[1:].partition(" ")
        cmd = COMMANDS.get(name)
        if cmd and cmd.completions and " " not in rest:
            for key in cmd.completions():
                if key.startswith(rest):
                    yield Completion(key, start_position=-len(rest))


def history_path(configured: str) -> str:
    if configured:
        return os.path.expanduser(configured)
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "chat", "history")


def key_bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("escape", "enter")
    def _(event):
        event.current_buffer.insert_text("\n")

    @kb.add("enter")
    def _(event):
        buf = event.current_buffer
        text = buf.text
        # inside an open """ block Enter adds a line; the closing """ sends it
        if text.lstrip().startswith(BLOCK) and not (text.rstrip().endswith(BLOCK) and len(text.strip()) >= 6):
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("c-c")
    def _(event):
        # Ctrl-C clears a line being typed; on an empty line it exits
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt)

    return kb


def unwrap_block(text: str) -> str:
    s = text.strip()
    if s.startswith(BLOCK) and s.endswith(BLOCK) and len(s) >= 6:
        return s[3:-3].strip("\n")
    return text


class ReplApp:
    def __init__(self, controller: ChatController, renderer: Renderer):
        self.controller = controller
        self.renderer = renderer

    def handle(self, line: str) -> None:
        """One input line: a command, or a message to the model. Errors are reported, not raised."""
        text = unwrap_block(line)
        if not text.strip():
            return
        try:
            if text.startswith("/"):
                message = run_command(self, text.strip())
                if message is None:
                    return
                text = message
            self.turn(text)
        except CommandError as e:
            self.renderer.error(f"{e}")
        except (ContextOverflow, TemplateError) as e:
            self.renderer.error(f"{e}; nothing was sent")
        except ReuseMismatch as e:  # verify_reuse found the cache wrong: report it, start clean
            self.controller.session.reset()
            self.renderer.error(f"{e}; the cache was cleared")

    def turn(self, text: str) -> None:
        c = self.controller
        result = TurnResult([])
        try:
            self.renderer.stream(c.send(text, result))
        except KeyboardInterrupt:
            self.renderer.notice("(interrupted: the reply was discarded)")
            return
        self.renderer.stats(result.stats, c.context_used, c.session.max_context)


def _read_piped(stream, notice=lambda text: None):
    """Plain lines from a pipe (bytes that are not UTF-8 replaced, with a notice), with \"\"\"
    blocks joined into one message."""
    block: list[str] | None = None
    for raw in stdin_lines(stream, notice):
        line = raw.rstrip("\n")
        if block is not None:
            if line.strip() == BLOCK:
                yield "\n".join(block)
                block = None
            else:
                block.append(line)
        elif line.strip() == BLOCK:
            block = []
        else:
            yield line
    if block:
        yield "\n".join(block)


def run_loop(app: ReplApp, session: PromptSession | None, stdin=None) -> int:
    if session is None:
        try:
            for line in _read_piped(stdin or sys.stdin, app.renderer.notice):
                app.handle(line)
        except ExitRepl:
            pass
        return 0
    while True:
        try:
            line = session.prompt()
        except KeyboardInterrupt:  # only raised on an empty line (see key_bindings)
            return 0
        except EOFError:
            return 0
        try:
            app.handle(line)
        except ExitRepl:
            return 0


def make_prompt_session(settings: Settings, input=None, output=None) -> PromptSession:
    path = history_path(settings.ui.history_file)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        history = FileHistory(path)
    except OSError:
        history = InMemoryHistory()
    return PromptSession(message=">>> ", history=history, completer=SlashCompleter(),
                         complete_while_typing=True, key_bindings=key_bindings(), multiline=True,
                         prompt_continuation="... ", enable_history_search=False,
                         input=input, output=output)


def run_repl(settings: Settings) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        # Ctrl-C must stop a reply even when a launcher started us with SIGINT ignored (shells do
        # that to background jobs, and the setting is inherited).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    renderer = Renderer(color=settings.ui.color, markdown=settings.ui.markdown, show_stats=settings.ui.show_stats)
    if renderer.rich:
        with renderer.console.status(f"loading {settings.engine.model}…", spinner="dots") as status:
            rt = open_runtime(settings, lambda text: status.update(text + "…"))
        lm = rt.loaded
        renderer.notice(f"{os.path.basename(lm.source)} · {lm.n_params / 1e6:.0f}M params · "
                        f"{lm.weight_format} · {str(rt.dtype).replace('torch.', '')} on {rt.device} "
                        f"({rt.dtype_reason}) · "
                        f"loaded in {rt.load_seconds:.1f}s · /help for commands, Ctrl-D to exit")
    else:
        rt = open_runtime(settings)
    app = ReplApp(ChatController(rt, settings), renderer)
    return run_loop(app, make_prompt_session(settings) if interactive else None)
