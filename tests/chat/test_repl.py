"""The REPL driven through the real prompt-toolkit application (pipe input, dummy output)."""
import os
import subprocess
import sys

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from chat.controller import ChatController
from chat.render import Renderer
from chat.repl import ReplApp, make_prompt_session, run_loop
from chat.runtime import open_runtime
from chat.settings import load_settings
from tests.support.repl import Out, drive


@pytest.fixture
def app_factory(tiny_dirs, tmp_path):
    def make(**over):
        settings = load_settings(None, env={}, overrides={"model": tiny_dirs["llama"][0], "temperature": "0",
                                                         "max_new_tokens": "12", "history_file": str(tmp_path / "h"),
                                                         **over})
        out = Out()
        renderer = Renderer(out=out, color="never")
        app = ReplApp(ChatController(open_runtime(settings), settings), renderer)
        return app, out, settings
    return make


def test_multi_turn_conversation_with_commands(app_factory):
    app, out, settings = app_factory()
    c = app.controller
    keys = ("hello there\r"            # turn 1
            "/set temperature 0\r"
            "tell me more\r"           # turn 2
            "/show\r/stats\r"
            "/undo\r"
            "tell me more\r"           # turn 2 again, after the undo
            "/bogus\r"
            "/set top_k -3\r"
            "/exit\r")
    assert drive(app, settings, keys) == 0
    assert len(c.turns) == 2 and len(c.conv.messages) == 4
    t1, t2 = c.turns
    # on a KV model turn 2 prefills only its new tokens: everything of turn 1 but its last token came from the cache
    assert t2.result.stats.reused_tokens >= len(t1.result.prompt_ids) + len(t1.result.ids) - 2
    assert t2.result.stats.prefilled_tokens < len(t2.result.prompt_ids) - len(t1.result.prompt_ids)
    assert c.session.state.length == len(c.session.cached)
    assert "temperature = 0" in out.text and "context:" in out.text and "weights: float32" in out.text
    assert "decode step: C++ step (cpu_kernel)" in out.text


def test_unknown_command_sends_nothing(app_factory, capsys):
    app, out, settings = app_factory()
    drive(app, settings, "/frobnicate\r/set nonsense 1\r/exit\r")
    assert app.controller.turns == [] and app.controller.session.state.length == 0
    err = capsys.readouterr().err
    assert "unknown command /frobnicate" in err and "unknown key 'nonsense'" in err


def test_retry_regenerates_and_multiline_block(app_factory):
    app, out, settings = app_factory()
    drive(app, settings, '"""\rline one\rline two\r"""\r/retry\r/exit\r')
    c = app.controller
    assert len(c.turns) == 1 and c.turns[0].user == "line one\nline two"


def test_context_overflow_refused_state_untouched(app_factory, capsys):
    app, out, settings = app_factory(max_context="48")
    drive(app, settings, "hi\r" + "word " * 60 + "\r/exit\r")
    c = app.controller
    assert len(c.turns) == 1
    assert "context holds 48" in capsys.readouterr().err
    assert c.session.state.length == len(c.session.cached)


def test_interrupted_turn_leaves_pre_turn_state(app_factory):
    app, out, settings = app_factory(max_new_tokens="40")
    c = app.controller
    app.handle("first question")
    before = (list(c.session.cached), [dict(m) for m in c.conv.messages])
    chunks = 0
    from chat.turn import TurnResult
    result = TurnResult([])
    gen = c.send("second question", result)
    with pytest.raises(KeyboardInterrupt):
        for _ in gen:
            chunks += 1
            if chunks == 2:
                gen.throw(KeyboardInterrupt)
    assert c.conv.messages == before[1]
    assert c.session.cached == before[0][:len(c.session.cached)]
    # the next turn gives what a fresh session gives
    app.handle("second question")
    fresh, _, _ = app_factory(max_new_tokens="40")
    fresh.handle("first question")
    fresh.handle("second question")
    assert c.turns[-1].result.ids == fresh.controller.turns[-1].result.ids


@pytest.mark.slow
def test_piped_stdout_is_byte_stable(tiny_dirs):
    cmd = [sys.executable, "-m", "chat", "--model", tiny_dirs["llama"][0], "--temperature", "0",
           "--max-new-tokens", "16"]
    runs = [subprocess.run(cmd, input="hi\nwhat now?\n/exit\n", capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, CHAT_HISTORY_FILE=os.devnull)) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.count("\n") >= 2
    assert "\x1b" not in runs[0].stdout  # no colour or cursor codes in plain mode


def test_save_then_load_resumes_the_conversation(app_factory, tmp_path):
    app, out, settings = app_factory()
    rec = tmp_path / "conv.yaml"
    drive(app, settings, f"first\rsecond\r/save {rec}\r/exit\r")
    from chat import transcript as tr
    t = tr.load(str(rec))
    assert [e.user for e in t.events] == ["first", "second"] and t.is_recording
    other, _, settings2 = app_factory()
    drive(other, settings2, f"/load {rec}\r/exit\r")
    assert other.controller.conv.messages == app.controller.conv.messages
    assert len(other.controller.turns) == 2
    drive(other, settings2, "/load /no/such/file.yaml\r/exit\r")  # an error line, nothing lost
    assert len(other.controller.turns) == 2


@pytest.mark.slow
def test_piped_embedded_model_is_byte_identical():
    cmd = [sys.executable, "-m", "chat", "--temperature", "0"]
    runs = [subprocess.run(cmd, input="hi\n/exit\n", capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, CHAT_HISTORY_FILE=os.devnull)) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout and runs[0].stdout == runs[1].stdout


class PipedBytes:
    """A piped stdin: text lines over raw bytes (`.buffer`), as sys.stdin is."""

    def __init__(self, raw: bytes):
        import io
        self.buffer = io.BytesIO(raw)


def test_piped_bytes_that_are_not_utf8_are_replaced_with_a_notice(app_factory, capsys):
    app, out, _ = app_factory(max_new_tokens="4")
    assert run_loop(app, None, stdin=PipedBytes(b"caf\xe9 \xff\nplain\n/exit\n")) == 0
    assert [m["content"] for m in app.controller.conv.messages[::2]] == ["caf\ufffd \ufffd", "plain"]
    err = capsys.readouterr().err
    assert "input line 1 is not valid UTF-8" in err and "line 2" not in err


@pytest.mark.parametrize("text, replaced", [("café", False), ("caf\udce9", True), ("a\ud800b", True)])
def test_clean_replaces_lone_surrogates(text, replaced):
    from chat.input_text import clean
    out, flag = clean(text)
    assert flag == replaced and out.encode("utf-8") and len(out) == len(text)


def test_fuzz_random_bytes_on_stdin(app_factory):
    """Random bytes piped in: every line reaches the conversation or a command as text; no
    exception leaves the loop."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    app, _, _ = app_factory(max_new_tokens="2")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.binary(max_size=120))
    def feed(raw):
        app.controller.reset()  # (a context that fills would only refuse further lines)
        assert run_loop(app, None, stdin=PipedBytes(raw)) == 0

    feed()


# --- saved conversations, /history, /model ----------------------------------------------------

def test_conversations_are_saved_after_each_change_and_pruned(app_factory, tmp_path):
    from chat import transcript as tr
    from chat.conversations import ConversationStore
    store = ConversationStore(str(tmp_path / "convs"), keep=2)
    app, out, settings = app_factory(max_new_tokens="4")
    app.store = store
    app.handle("/system be brief")  # no turn yet: nothing to save
    assert store.path is None
    app.handle("first")
    first = store.path
    assert [e.user for e in tr.load(first).events] == ["first"]
    app.handle("second")
    app.handle("/undo")
    t = tr.load(first)
    assert [e.user for e in t.events] == ["first"] and t.system_prompt == "be brief"
    app.handle("/reset")
    app.handle("third")
    assert store.path != first and len(store.entries()) == 2
    app.handle("/reset")
    app.handle("fourth")  # keep=2: the oldest goes
    assert [os.path.exists(p) for p in (first,)] == [False] and len(store.entries()) == 2
    assert store.latest() == store.path
    app.handle("/history")
    assert "fourth" in out.text and "turns" in out.text


def test_an_unwritable_conversations_dir_is_one_error_and_the_chat_goes_on(app_factory, tmp_path, capsys):
    from chat.conversations import ConversationStore
    blocker = tmp_path / "file"
    blocker.write_text("x")
    app, out, _ = app_factory(max_new_tokens="3")
    app.store = ConversationStore(str(blocker / "convs"), keep=5)
    app.handle("one")
    app.handle("two")
    assert len(app.controller.turns) == 2
    assert capsys.readouterr().err.count("cannot save the conversation") == 1


def test_model_switch_keeps_the_messages_and_a_failed_one_keeps_the_model(app_factory, tiny_dirs, capsys):
    app, out, _ = app_factory(max_new_tokens="4")
    app.handle("hello there")
    messages = list(app.controller.conv.messages)
    app.handle(f"/model {tiny_dirs['qwen3'][0]}")
    c = app.controller
    assert c.rt.loaded.model_type == "qwen3" and c.conv.messages == messages
    app.handle("and now?")  # the whole conversation prefilled on the new model
    assert c.session.last_stats.reused_tokens == 0 and len(c.conv.messages) == 4
    app.handle("/model /no/such/model")
    assert "could not load /no/such/model" in capsys.readouterr().err and c.rt.loaded.model_type == "qwen3"
    app.handle(f"/model {tiny_dirs['llama'][0]}")
    assert c.rt.loaded.model_type == "llama" and c.conv.messages[:2] == messages


@pytest.mark.slow
def test_version_names_torch_and_the_device():
    proc = subprocess.run([sys.executable, "-m", "chat", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "torch" in proc.stdout and "device cpu" in proc.stdout


@pytest.mark.slow
def test_resume_without_saved_conversations_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "chat", "--resume"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, CHAT_CONVERSATIONS_DIR=str(tmp_path / "none")),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no saved conversation" in proc.stderr


# --- bad input and failing disks: one line, and the REPL goes on (issue 69) ----------------------

def _failing_appends(monkeypatch, path, err):
    """Appends to `path` fail with `err` (a full or read-only disk); reads and other files work."""
    import builtins
    import errno
    real_open = builtins.open

    class Failing:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(err, os.strerror(err))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if os.fspath(file) == str(path) and "a" in mode:
            return Failing(f)
        return f
    monkeypatch.setattr(builtins, "open", fake_open)
    assert errno.errorcode[err]


@pytest.mark.parametrize("err", [28, 30])  # ENOSPC, EROFS
def test_history_on_a_full_disk_goes_to_memory_with_one_notice(app_factory, tmp_path, monkeypatch, capsys, err):
    app, out, settings = app_factory(max_new_tokens="2")
    path = tmp_path / "h"
    path.write_text("\n# then\n+an older line\n", encoding="utf-8")
    _failing_appends(monkeypatch, path, err)
    with create_pipe_input() as inp:
        inp.send_text("first\rsecond\r/exit\r")
        inp.close()  # (EOF after the keys: a prompt left waiting ends the loop)
        session = make_prompt_session(settings, input=inp, output=DummyOutput())
        assert run_loop(app, session) == 0
    assert [t.user for t in app.controller.turns] == ["first", "second"]
    assert session.history.get_strings() == ["an older line", "first", "second", "/exit"]
    assert path.read_text(encoding="utf-8") == "\n# then\n+an older line\n"  # nothing torn
    err_text = capsys.readouterr().err
    notices = [ln for ln in err_text.splitlines() if "history" in ln.replace(str(tmp_path), "")]
    assert len(notices) == 1 and "stays in memory" in notices[0] and str(path) in notices[0], err_text
    assert "Traceback" not in err_text and "Unhandled exception" not in err_text


def test_resume_skips_newer_conversations_that_do_not_read(app_factory, tmp_path, monkeypatch, capsys):
    import io
    from chat import transcript as tr
    from chat.__main__ import main
    convs = tmp_path / "convs"
    convs.mkdir()
    app, _, _ = app_factory(max_new_tokens="3")
    app.handle("hello")
    good = convs / "2020-01-01T00-00-00-1.yaml"
    tr.save_controller(app.controller, str(good))
    torn = convs / "2020-01-02T00-00-00-1.yaml"
    torn.write_text(good.read_text(encoding="utf-8")[:150], encoding="utf-8")
    binary = convs / "2020-01-03T00-00-00-1.yaml"
    binary.write_bytes(b"\xff\xfe" * 40)
    for i, p in enumerate((good, torn, binary)):
        os.utime(p, (1_600_000_000 + i, 1_600_000_000 + i))
    monkeypatch.setenv("CHAT_CONVERSATIONS_DIR", str(convs))
    monkeypatch.setenv("CHAT_HISTORY_FILE", os.devnull)
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    assert main(["--resume"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "skipped" in err[0] and str(torn) in err[0] and str(binary) in err[0], err
    assert f"resumed 1 turns from {good}" in err[1]
    # a given file that does not read stays a one-line error
    assert main(["--resume", str(torn)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"chat: error: {torn}"), err


def test_save_errors_name_the_target_and_nothing_but_files_is_replaced(app_factory, tmp_path, capsys):
    app, out, settings = app_factory(max_new_tokens="3")
    missing = tmp_path / "no" / "such" / "conv.yaml"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    drive(app, settings, f"/save {tmp_path / 'early.yaml'}\rhello\r/save {missing}\r/save {tmp_path}\r/save {fifo}\r"
                         "again\r/exit\r")
    assert [t.user for t in app.controller.turns] == ["hello", "again"]  # the REPL answered after each
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: /save ") for line in err), err
    assert "nothing to save" in err[0] and not (tmp_path / "early.yaml").exists()
    assert f"no such directory {missing.parent}" in err[1] and "create it" in err[1] and ".tmp" not in err[1]
    assert "is a directory" in err[2] and "is not a regular file" in err[3]
    assert os.path.isdir(tmp_path) and not os.path.isfile(fifo) and os.path.exists(fifo)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "h"]  # no temporary file left behind


@pytest.mark.slow
def test_run_output_into_a_missing_directory_fails_before_the_run(tiny_dirs, tmp_path):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nevents:\n  - user: hi\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "chat", "run", str(script), "-o", str(tmp_path / "no" / "r.yaml"),
                           "--model", tiny_dirs["llama"][0], "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"no such directory {tmp_path / 'no'}" in lines[0], proc.stderr


def test_edit_puts_the_message_in_the_prompt_and_forks(app_factory):
    """/edit N on a terminal: message N fills the next prompt; what is sent replaces it on a new
    branch."""
    app, out, settings = app_factory()
    c = app.controller
    keys = ("first\r" "second\r"
            "/edit 2\r" " again\r"       # the prompt holds "second": the message is "second again"
            "/exit\r")
    assert drive(app, settings, keys) == 0
    assert [t.user for t in c.branches[0].turns] == ["first", "second"]
    assert len(c.branches) == 2 and c.current == 1
    assert [t.user for t in c.turns] == ["first", "second again"]
    assert "editing message 2: change it and press Enter" in out.text
