"""The REPL: a prompt-toolkit loop over one ChatController (one DecodeSession) for the process.

On a terminal: line editing, persistent history ($XDG_STATE_HOME/chat/history), multi-line input
(Alt+Enter inserts a newline; a block between \"\"\" lines is one message), bracketed paste,
completion of slash commands and /set keys. Piped stdin: plain lines, byte-stable output.
Ctrl-C during a reply stops that turn only (the conversation and state are as before it); at the
prompt it clears the line, and on an empty line it says how to leave (Ctrl-D or /exit) and stays:
a Ctrl-C meant for a reply that has just ended must not end the chat. On a terminal the
conversation is saved after every line that changed it (chat/conversations.py), so a killed
process loses at most the reply in progress; `chat --resume` continues it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import stat
import sys

from prompt_toolkit import PromptSession
from prompt_toolkit.application import get_app_or_none
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.history import FileHistory
from prompt_toolkit.key_binding import KeyBindings

from engine.config import ConfigError
from engine.constraint import ConstraintDeadEnd
from engine.session import ContextOverflow, ReuseMismatch

from .commands import COMMANDS, CommandError, EditTurn, ExitRepl, run_command
from .constraints import ConstraintError
from .controller import ChatController
from .conversation import think_note
from .conversations import ConversationStore, default_directory, directory_problem
from .input_text import stdin_lines
from .render import Renderer
from .runtime import open_runtime
from .settings import Settings
from .state_cache import StateSaver
from .state_cache import resume as resume_state
from .template import TemplateError
from .transcript import TranscriptError, load_into_controller
from .turn import EXIT_CUT_OFF, TurnResult, cut_off_notice
from .typeahead import take_pending

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


class SafeFileHistory(FileHistory):
    """prompt-toolkit's FileHistory, except that a history file that cannot be read or written (a
    full or read-only disk) does not break the prompt, where the plain one raised on every Enter:
    the history goes on in memory, and `take_notice` gives one line saying so, once."""

    def __init__(self, path: str):
        super().__init__(path)
        self.failed = False
        self._notice: str | None = None
        try:  # a FIFO or a device would block the load or never end it: only a regular file is history
            mode = os.stat(path).st_mode
        except OSError:
            mode = None  # (created at the first store, or a notice then)
        if mode is not None and not stat.S_ISREG(mode):
            self.fail(OSError(0, "not a regular file"), "use")

    def fail(self, error: OSError, doing: str) -> None:
        if not self.failed:
            self.failed = True
            self._notice = (f"cannot {doing} the history file {self.filename}: {error.strerror or error}; "
                            "this session's history stays in memory (history_file moves it)")

    def take_notice(self) -> str | None:
        notice, self._notice = self._notice, None
        return notice

    def load_history_strings(self):
        if self.failed:
            return []
        try:
            return list(super().load_history_strings())
        except OSError as e:
            self.fail(e, "read")
            return []

    def store_string(self, string: str) -> None:
        if self.failed:
            return
        entry = f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in string.split("\n"))
        data = entry.encode("utf-8", errors="replace")
        try:
            with open(self.filename, "ab", buffering=0) as f:
                start = os.fstat(f.fileno()).st_size
                try:
                    done = 0
                    while done < len(data):
                        done += f.write(data[done:]) or 0
                except OSError:
                    os.ftruncate(f.fileno(), start)  # no torn entry for the next load to misread
                    raise
        except OSError as e:
            self.fail(e, "write")


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
        # Ctrl-C clears a line being typed; on an empty line the loop prints how to leave
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


LEAVE_HINT = "(Ctrl-D or /exit to leave)"


class ReplApp:
    def __init__(self, controller: ChatController, renderer: Renderer, store: ConversationStore | None = None):
        self.controller = controller
        self.renderer = renderer
        self.store = store  # None: nothing is saved (piped input is its own record)
        self._save_failed = False
        self.own_sigint = False  # run_repl on a terminal: SIGINT interrupts replies only
        self.late_interrupt = False
        self.terminal = None  # (on a terminal: its fd and the prompt's input, for typeahead.take_pending)
        self.cut_off = 0  # constrained replies cut off before their format was complete
        self.interactive = False  # a prompt-toolkit prompt reads the lines (run_loop): /edit N can prefill it
        self.state_saver: StateSaver | None = None  # the session's state beside each autosave (chat/state_cache.py)
        self.pending_edit: int | None = None  # /edit N on a terminal: the next message replaces message N
        self.next_default = ""  # text the next prompt starts with (the message /edit N puts there)

    def take_default(self) -> str:
        text, self.next_default = self.next_default, ""
        return text

    def note_interrupt(self, signum, frame) -> None:
        """SIGINT outside a reply: answered with the hint at the next prompt. One that lands as a
        prompt starts (before prompt-toolkit takes the terminal) ends that prompt as an empty
        line's Ctrl-C does."""
        self.late_interrupt = True
        app = get_app_or_none()
        if app is not None and app.future is not None and not app.future.done():
            self.answer_late_interrupt()

    def answer_late_interrupt(self) -> None:
        """(prompt-toolkit's pre_run, and the SIGINT handler while a prompt runs) A Ctrl-C that
        came between prompts ends the prompt on its empty line: the loop prints the hint."""
        app = get_app_or_none()
        if self.late_interrupt and app is not None and not app.current_buffer.text:
            self.late_interrupt = False
            app.exit(exception=KeyboardInterrupt)

    @contextlib.contextmanager
    def interruptible(self):
        """Inside: Ctrl-C (SIGINT) raises KeyboardInterrupt, which stops the reply. Outside, on a
        terminal, SIGINT does nothing: at the prompt prompt-toolkit reads Ctrl-C as a key, and one
        that lands between a reply and the prompt (a late Ctrl-C meant for the reply) must not
        escape the loop halfway through printing or saving: it is noted (note_interrupt). One
        pressed right after Enter stops the reply before it starts: one typed while the prompt
        still held the terminal arrived as a key (typeahead.take_pending finds it), one after that
        as a SIGINT that note_interrupt noted (run_loop clears the note when a prompt returns)."""
        if not self.own_sigint:
            yield
            return
        # (before the handler that raises: a SIGINT during the terminal's read is only noted)
        pending = self.terminal is not None and take_pending(*self.terminal)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if pending or self.late_interrupt:  # pressed after Enter, before this handler took over
                self.late_interrupt = False
                raise KeyboardInterrupt
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def autosave(self) -> None:
        """Save the conversation if it changed; a failure is reported once, the chat goes on."""
        if self.store is None or self.controller.rt is None:
            return
        try:
            written = self.store.save(self.controller)
            if written is not None and self.state_saver is not None:
                self.state_saver.save(self.controller, written)  # (a thread writes it)
                if self.state_saver.failure:
                    self.renderer.error(self.state_saver.failure)
                    self.state_saver.failure, self.state_saver.budget = None, 0  # (once: not again)
            self._save_failed = False
        except (OSError, TranscriptError) as e:
            if not self._save_failed:
                self.renderer.error(f"cannot save the conversation in {self.store.directory}: {e}")
            self._save_failed = True

    def switch_model(self, target: str) -> None:
        """/model: the conversation's messages on another model. The old model's memory is freed
        first; if the new one fails to load, the old one is loaded again (the same settings) and
        the error is one line."""
        c = self.controller
        try:
            settings = c.settings.with_value("model", target)
        except ConfigError as e:
            raise CommandError(str(e)) from None
        old_settings = c.settings
        c.rt = None  # the only reference to the runtime: free it before the new one loads
        _free_memory()
        try:
            rt = open_runtime(settings)
        except Exception as e:  # any load failure: the current model comes back
            first = _first_line(e)
            try:
                back = open_runtime(old_settings)
            except Exception as again:  # (its files gone or changed since): no model until /model loads one
                self.store_after_switch()
                raise CommandError(f"could not load {target}: {first}; {old_settings.engine.model} did not load "
                                   f"again either ({_first_line(again)}); /model PATH loads another, /exit leaves"
                                   ) from None
            c.replace_runtime(back, back.settings)
            raise CommandError(f"could not load {target}: {first}; still on {old_settings.engine.model}") from None
        c.replace_runtime(rt, rt.settings)  # (the old model's sampling defaults gone, the new one's taken)
        self.store_after_switch()
        lm = rt.loaded
        self.renderer.info(f"now on {os.path.basename(lm.source)} ({lm.model_type}, {lm.n_params / 1e6:.0f}M params, "
                           f"{str(rt.dtype).replace('torch.', '')} on {rt.device}); "
                           f"{len(c.conv.messages) // 2} exchanges kept")

    def store_after_switch(self) -> None:
        if self.store is not None:
            self.store.begin_new()  # the recording so far belongs to the old model

    def handle(self, line: str) -> None:
        """One input line: a command, or a message to the model. Errors are reported, not raised;
        the conversation is saved afterwards where it changed."""
        try:
            self._handle(line)
        finally:
            self.autosave()

    def _handle(self, line: str) -> None:
        text = unwrap_block(line)
        if not text.strip():
            return
        try:
            if self.controller.rt is None and not (text == line and text.strip().split(" ")[0] in NO_MODEL_COMMANDS):
                raise CommandError("no model is loaded: /model PATH loads one, /exit leaves")
            edit, self.pending_edit = self.pending_edit, None  # (a command instead of the edited message drops it)
            if text.startswith("/") and text == line:  # (a """ block is one message, even one that starts with /)
                message = run_command(self, text.strip())
                if message is None:
                    return
                if isinstance(message, EditTurn):
                    edit, message = message.n, message.text
                else:
                    edit = None
                text = message
            self.turn(text, edit)
        except (CommandError, ConstraintError) as e:
            self.renderer.error(f"{e}")
        except ConstraintDeadEnd as e:  # the reply was discarded, as an interrupted one is
            self.renderer.error(f"{e}; the reply was discarded")
        except (ContextOverflow, TemplateError) as e:
            self.renderer.error(f"{e}; nothing was sent")
        except ReuseMismatch as e:  # verify_reuse found the cache wrong: report it, start clean
            self.controller.session.reset()
            self.renderer.error(f"{e}; the cache was cleared")

    def turn(self, text: str, edit: int | None = None) -> None:
        """One message and its reply; `edit`: the message replaces message `edit` of the current
        branch, on a new branch (controller.edit)."""
        c = self.controller
        result = TurnResult([])
        try:
            with self.interruptible():
                self.renderer.stream(c.send(text, result) if edit is None else c.edit(edit, text, result))
        except KeyboardInterrupt:
            self.renderer.notice("(interrupted: the reply was discarded)")
            return
        self.renderer.stats(result.stats, c.context_used, c.session.max_context)
        if result.cut_off:
            self.cut_off += 1
            self.renderer.notice("note: " + cut_off_notice(result, c.settings.sampling, c.session.max_context,
                                                           "max_new_tokens (/set max_new_tokens N)"))


# what the REPL still runs after a /model whose load failed and whose old model did not load again
NO_MODEL_COMMANDS = ("/model", "/exit", "/quit", "/q", "/help", "/?")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _read_piped(stream, notice=lambda text: None):
    """Plain lines from a pipe (bytes that are not UTF-8 replaced, with a notice), with \"\"\"
    blocks joined into one message."""
    block: list[str] | None = None
    for raw in stdin_lines(stream, notice):
        line = raw.rstrip("\n")
        if block is not None:
            if line.strip() == BLOCK:
                yield _as_block(block)
                block = None
            else:
                block.append(line)
        elif line.strip() == BLOCK:
            block = []
        else:
            yield line
    if block:
        yield _as_block(block)


def _as_block(lines: list[str]) -> str:
    """A piped block handed on as the REPL's own BLOCK-delimited block: one message, even where it
    starts with /."""
    return f"{BLOCK}\n" + "\n".join(lines) + f"\n{BLOCK}"


def run_loop(app: ReplApp, session: PromptSession | None, stdin=None) -> int:
    app.interactive = session is not None
    if session is None:
        try:
            for line in _read_piped(stdin or sys.stdin, app.renderer.notice):
                app.handle(line)
        except ExitRepl:
            pass
        return EXIT_CUT_OFF if app.cut_off else 0  # (a script reading stdout must know)
    if app.own_sigint and app.terminal is None:
        app.terminal = (_terminal_fd(session), session.input)
    while True:
        try:
            try:
                line = session.prompt(pre_run=app.answer_late_interrupt, default=app.take_default())
            except EOFError:
                return 0
            finally:  # (said here, not while the prompt holds the terminal)
                notice = getattr(session.history, "take_notice", lambda: None)()
                if notice:
                    app.renderer.notice(notice)
            app.late_interrupt = False  # (one from here on was meant for this line's reply)
            app.handle(line)
        except ExitRepl:
            return 0
        except KeyboardInterrupt:
            # at an empty prompt (see key_bindings), or one that came just after a reply ended,
            # between the reply and the prompt: the conversation is as it was; stay
            app.renderer.notice(LEAVE_HINT)


def _terminal_fd(session: PromptSession) -> int:
    """The fd the prompt reads (its input's), -1 where it has none: take_pending then reads
    nothing from the terminal."""
    try:
        return session.input.fileno()
    except (AttributeError, NotImplementedError, OSError, ValueError):
        return -1


def make_prompt_session(settings: Settings, input=None, output=None) -> PromptSession:
    path = history_path(settings.ui.history_file)
    history = SafeFileHistory(path)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError as e:
        history.fail(e, "create the directory of")
    return PromptSession(message=">>> ", history=history, completer=SlashCompleter(),
                         complete_while_typing=True, key_bindings=key_bindings(), multiline=True,
                         prompt_continuation="... ", enable_history_search=False,
                         input=input, output=output)


def _free_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_repl(settings: Settings, resume: str | None = None, fmt=(None, "")) -> int:
    """The REPL; `resume`: a saved conversation (a recording) to continue, and save into; `fmt`:
    the output format to start with and the flag that named it."""
    interactive = sys.stdin.isatty()
    if interactive:
        # Ctrl-C must stop a reply even when a launcher started us with SIGINT ignored (shells do
        # that to background jobs, and the setting is inherited): loading can be interrupted
        # (KeyboardInterrupt: exit 130), replies can (ReplApp.interruptible), the rest cannot.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if (interactive or resume) and settings.ui.keep_conversations > 0:  # (before a load, not at the first save)
        directory = default_directory(settings.ui.conversations_dir)
        problem = directory_problem(directory)
        if problem:
            raise ConfigError(f"conversations_dir: {directory} {problem}; name a directory (or \"\" for the "
                              f"default) or set keep_conversations: 0", "conversations_dir")
    renderer = Renderer(color=settings.ui.color, markdown=settings.ui.markdown, show_stats=settings.ui.show_stats)
    if renderer.rich:
        with renderer.console.status(f"loading {settings.engine.model}…", spinner="dots") as status:
            rt = open_runtime(settings, lambda text: status.update(text + "…"))
        lm = rt.loaded
        renderer.notice(f"{os.path.basename(lm.source)} · {lm.n_params / 1e6:.0f}M params · "
                        f"{lm.weight_format} · {str(rt.dtype).replace('torch.', '')} on {rt.device} "
                        f"({rt.dtype_reason}) · "
                        f"loaded in {rt.load_seconds:.1f}s · /help for commands, Ctrl-D to exit")
        for note in lm.notes:  # e.g. GGUF types dequantized rather than kept in their blocks
            renderer.notice(note)
    else:
        rt = open_runtime(settings)
    store = ConversationStore(default_directory(settings.ui.conversations_dir), settings.ui.keep_conversations)
    app = ReplApp(ChatController(rt, rt.settings), renderer, store if interactive or resume else None)
    if interactive:
        app.own_sigint = True
        signal.signal(signal.SIGINT, app.note_interrupt)
    if fmt[0] is not None:
        app.controller.set_format(*fmt)  # a bad one: exit 2 before the first prompt
    note = think_note(rt.template, rt.settings.ui.think)
    if note:
        renderer.notice(note)
    if app.store is not None:
        app.state_saver = StateSaver(settings.ui.state_cache_mib)
    if resume:
        n = load_into_controller(app.controller, resume)
        app.controller.set("system_prompt", app.controller.conv.system_prompt)
        if app.store is not None:
            app.store.continue_file(resume)
        renderer.notice(f"resumed {n} turns from {resume}")
        note = resume_state(app.controller, resume) if settings.ui.state_cache_mib > 0 else None
        if note:
            renderer.notice(note)
    try:
        return run_loop(app, make_prompt_session(settings) if interactive else None)
    finally:
        if app.state_saver is not None:
            app.state_saver.wait()  # (a state being written is finished, never left half done)
