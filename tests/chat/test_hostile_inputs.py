"""Hostile inputs beyond settings and recordings: files that are not files, schemas JSON cannot
hold, chat templates that fail in Python, blocks that look like commands. Each ends in one line
(exit 2), or the REPL says so and answers the next message.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from tests.support.cli import run_chat
from tests.support.paths import ROOT

TINY = os.path.join(ROOT, "tests", "golden", "tiny-llama")


def chat(*args, stdin: str | None = None, tmp_path=None):
    return run_chat(*args, stdin=stdin, tmp_path=tmp_path, timeout=60)


def one_line(p, *needles, status=2):
    assert p.returncode == status and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chat: error:"), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--config", "{f}", "--prompt", "hi"], ["run", "{f}"], ["replay", "{f}"], ["--resume", "{f}"],
    ["--prompt", "hi", "--json-schema", "{f}"], ["--prompt", "hi", "--grammar", "{f}"],
])
def test_a_fifo_never_blocks(tmp_path, fifo, args):
    """(these hung, blocked in open or read, before input_files.read_text)"""
    model = [] if args[0] in ("run", "replay") else ["--model", TINY]  # (subcommands take the model from the file)
    one_line(chat(*[a.format(f=fifo) for a in args], *model, tmp_path=tmp_path), str(fifo), "named pipe")


@pytest.mark.slow
def test_a_device_is_not_read_whole(tmp_path):
    one_line(chat("--model", TINY, "--prompt", "hi", "--grammar", "/dev/zero", tmp_path=tmp_path),
             "/dev/zero", "character device")


@pytest.mark.slow
@pytest.mark.parametrize("schema,needle", [('{"const": 1e999}', "out of range"), ('{"maximum": NaN}', "NaN"),
                                           ('{"minimum": -Infinity}', "-Infinity")])
def test_schemas_hold_only_json_numbers(tmp_path, schema, needle):
    one_line(chat("--model", TINY, "--prompt", "hi", "--json-schema", schema, tmp_path=tmp_path), needle)


@pytest.mark.slow
def test_a_script_schema_with_yaml_only_values(tmp_path):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nevents:\n"
                      "- {user: hi, output_format: {json_schema: {const: 2020-01-01}}}\n")
    one_line(chat("run", script, "--model", TINY, tmp_path=tmp_path), "a value JSON cannot")


@pytest.mark.slow
@pytest.mark.parametrize("template,needle", [
    ("{{ 1/0 }}", "ZeroDivisionError"), ("{{ messages + 1 }}", "TypeError"),
    ("{% for x in range(10**9) %}{% endfor %}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{% for m in messages %}{% endfor %}", "rendered nothing"),
])
def test_templates_that_fail_in_python(tmp_path, template, needle):
    model = shutil.copytree(TINY, tmp_path / "m")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line(chat("--model", model, "--prompt", "hi", "--max-new-tokens", "2", tmp_path=tmp_path),
             "chat template", needle)
    p = chat("--model", model, "--max-new-tokens", "2", stdin="hi\n/exit\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr and needle in p.stderr, p.stderr


TEMPLATE_BOMBS = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "loop steps"),
    ("{{ 'a' * 10**9 }}", "would make 1,000,000,000 items"),
    ("{{ [0] * 2**40 }}", "would make"),
    ("{{ 2 ** 100000000 }}", "exponent of 100,000,000"),
    ("{% set s = namespace(v='a') %}{% for i in range(60) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}", "MiB"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "characters"),
]


@pytest.mark.parametrize("template,needle", TEMPLATE_BOMBS)
def test_a_template_is_bounded(template, needle):
    """(each of these hung for hours, or grew the process until the kernel killed it, before
    chat/template.py's Limits)"""
    import time

    from chat.template import ChatTemplate, TemplateError
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="chat template") as e:
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])
    assert needle in str(e.value) and time.monotonic() - t0 < 30


def test_a_slow_template_is_stopped_by_the_clock():
    from chat.template import ChatTemplate, Limits, TemplateError
    slow = "{% for i in range(100000) %}{% for m in messages %}{{ m.content|length }}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match="ran past 0.05 s"):
        ChatTemplate(slow, limits=Limits(seconds=0.05, text=1 << 30)).render([{"role": "user", "content": "x"}] * 50)


def test_real_templates_keep_their_range(tmp_path):
    from chat.template import ChatTemplate
    src = "{{ range(5)|length }}{% for i in range(3)|reverse %}{{ i }}{% endfor %}{{ range(10)[3] }}{{ 'ab' * 2 }}"
    assert ChatTemplate(src).render([]) == "52103abab"


@pytest.mark.slow
def test_a_template_bomb_leaves_the_repl_answering(tmp_path):
    model = shutil.copytree(TINY, tmp_path / "m")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE_BOMBS[0][0]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line(chat("--model", model, "--prompt", "hi", tmp_path=tmp_path), "chat template", "loop steps")
    p = chat("--model", model, "--max-new-tokens", "2", stdin="hi\n/show\n/exit\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "loop steps" in p.stderr and "model:" in p.stdout, p.stderr


@pytest.mark.slow
def test_repl_goes_on_after_bad_system_and_schema_and_a_block_is_a_message(tmp_path):
    script = '/system a\x00b\n/format schema {"maximum": NaN}\nhi\n"""\n/undo\n"""\n/exit\n'
    p = chat("--model", TINY, "--max-new-tokens", "3", "--temperature", "0", stdin=script, tmp_path=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "system_prompt: 'a\\x00b' is not valid" in p.stderr and "NaN is not a JSON number" in p.stderr
    assert "nothing to undo" not in p.stderr  # (the block was sent as a message, not run as /undo)
    assert len([line for line in p.stdout.splitlines() if line.strip()]) >= 1


def test_history_file_on_a_fifo_is_not_read(tmp_path, fifo):
    from chat.repl import SafeFileHistory
    h = SafeFileHistory(str(fifo))
    assert list(h.load_history_strings()) == [] and h.failed
    assert "not a regular file" in h.take_notice()
    h.store_string("hello")  # (in memory only: nothing blocks)


def test_a_model_whose_files_went_leaves_the_repl_without_a_model(tmp_path, capsys):
    """/model to a bad path after the current model's files were removed: the old model cannot load
    again; the REPL says so and goes on (only /model, /help and /exit run) until /model loads one
    (before, the failed reload ended the session with a traceback)."""
    import io

    from chat.controller import ChatController
    from chat.render import Renderer
    from chat.repl import ReplApp
    from chat.runtime import open_runtime
    from chat.settings import load_settings

    model = shutil.copytree(TINY, tmp_path / "m")
    settings = load_settings(None, env={}, overrides={"model": str(model), "temperature": "0", "max_new_tokens": "3"})
    rt = open_runtime(settings)
    out = io.StringIO()
    app = ReplApp(ChatController(rt, rt.settings), Renderer(out=out, color="never"))

    seen = [0]

    def said() -> str:  # (what the REPL wrote since the last call)
        text = out.getvalue()[seen[0]:]
        seen[0] = len(out.getvalue())
        return text + capsys.readouterr().err
    app.handle("hi")
    shutil.rmtree(model)
    said()
    app.handle("/model /no/such/model")
    text = said()
    assert "could not load /no/such/model" in text and "did not load again" in text and "/exit leaves" in text
    assert app.controller.rt is None
    for line in ("hello", "/show", "/save x.yaml"):
        app.handle(line)
        assert "no model is loaded: /model PATH loads one" in said()
    app.handle(f"/model {TINY}")
    app.handle("hi again")
    assert app.controller.rt is not None and len(app.controller.conv.messages) == 4  # (the conversation kept)


@pytest.mark.slow
def test_conversations_dir_naming_a_file_fails_before_the_load(tmp_path):
    rec = os.path.join(ROOT, "tests", "golden", "recordings", "kv-greedy.yaml")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad, needle in ((a_file, "is not a directory"), (a_file / "sub", "cannot be made")):
        p = chat("--resume", rec, "--conversations-dir", bad, tmp_path=tmp_path)
        one_line(p, "conversations_dir", needle)


@pytest.mark.slow
def test_system_shows_a_loaded_conversations_prompt(tmp_path):
    rec = tmp_path / "r.yaml"
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsystem_prompt: be brief\n"
                      "sampling: {temperature: 0, max_new_tokens: 2}\nevents:\n- user: hi\n")
    assert chat("run", script, "--model", TINY, "-o", rec, tmp_path=tmp_path).returncode == 0
    p = chat("--model", TINY, stdin=f"/load {rec}\n/system\n/show\n/exit\n", tmp_path=tmp_path)
    assert "system prompt: 'be brief'" in p.stdout and "system prompt: be brief" in p.stdout, p.stdout + p.stderr
