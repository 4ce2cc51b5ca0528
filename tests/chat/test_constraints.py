"""Output formats (llguidance masks) on a tiny random model with sampling: every reply parses and
validates under a hypothesis-generated JSON Schema, fullmatches its regex, follows its grammar;
the mask is the same inline and on the worker thread; bad formats are one line (exit 2 on the
command line, the REPL goes on); constrained recordings replay exactly."""
import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import models
from chat.constraints import ConstraintError, Format, parse_arg, schema_format
from engine.config import SamplingConfig
from engine.constraint import ConstraintMask
from engine.session import DecodeSession

_CACHE = {}


def tiny_session(tiny_dirs):
    """One session on the tiny Llama for the module (hypothesis runs many examples on it)."""
    if "s" not in _CACHE:
        lm = models.load(tiny_dirs["llama"][0])
        _CACHE["lm"] = lm
        _CACHE["s"] = DecodeSession(lm.model, max_context=2048, device=torch.device("cpu"), dtype=torch.float32,
                                    eos_ids=lm.eos_ids)
    return _CACHE["lm"], _CACHE["s"]


PROMPT = [1, 90, 100, 110, 120, 2, 1, 70, 80]


def reply(tiny_dirs, fmt: Format, seed: int, temperature=1.0, context_full_ok=False, **over):
    lm, s = tiny_session(tiny_dirs)
    compiled = fmt.compile(lm.tokenizer, s.eos_ids, s.vocab_size)
    cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=over.pop("max_new_tokens", 600),
                         top_k=0, top_p=1.0, min_p=0.0, **over)
    ids = list(s.generate(PROMPT, cfg, constraint=compiled.constraint()))
    if context_full_ok and s.last_stats.finish_reason == "context":
        return None
    assert s.last_stats.finish_reason == "stop", (s.last_stats.finish_reason, lm.tokenizer.decode(ids))
    assert ids[-1] in s.eos_ids and not set(ids[:-1]) & {0, 1, 2}  # no control token but the final end of turn
    return ids, lm.tokenizer.decode(ids[:-1], skip_special_tokens=False)


# --- JSON Schema --------------------------------------------------------------------------------

def _leaf():
    strings = st.tuples(st.integers(0, 3), st.integers(0, 6)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})
    ints = st.tuples(st.integers(-1000, 1000), st.integers(0, 5000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    nums = st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    enums = st.lists(st.one_of(st.text("abcxyz ", min_size=1, max_size=5), st.integers(-9, 99)),
                     min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v})
    return st.one_of(strings, ints, nums, enums, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _object(children):
    keys = st.lists(st.text("abcdefgh_", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)

    def build(ks, draw_children, required_bits):
        props = dict(zip(ks, draw_children))
        required = [k for k, r in zip(ks, required_bits) if r]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return keys.flatmap(lambda ks: st.tuples(st.lists(children, min_size=len(ks), max_size=len(ks)),
                                             st.lists(st.booleans(), min_size=len(ks), max_size=len(ks)))
                        .map(lambda t: build(ks, t[0], t[1])))


def _array(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


SCHEMAS = st.recursive(_leaf(), lambda inner: st.one_of(_object(inner), _array(inner)), max_leaves=6)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32), penalty=st.sampled_from([0.0, 0.5]))
def test_sampled_replies_validate_under_generated_schemas(tiny_dirs, schema, seed, penalty):
    out = reply(tiny_dirs, Format("json_schema", json.dumps(schema)), seed, presence_penalty=penalty,
                context_full_ok=True)
    # random weights can fill the tiny model's context with the whitespace a large schema allows
    # between its tokens: such a reply says nothing about the constraint
    assume(out is not None)
    jsonschema.validate(json.loads(out[1]), schema)


def test_format_json_is_any_object(tiny_dirs):
    """(Random weights write unbounded strings without end, so this one is checked on the matcher.)"""
    lm, s = tiny_session(tiny_dirs)
    compiled = Format("json").compile(lm.tokenizer, s.eos_ids, s.vocab_size)
    for text, ok in [('{"a": [1, "x", {"b": null}], "c": -2.5e3}', True), ("[1]", False), ('"x"', False)]:
        c = compiled.constraint()
        ids = lm.tokenizer.encode(text, add_special_tokens=False).ids
        assert (c.matcher.try_consume_tokens(ids) == len(ids) and c.accepting) == ok, text


# --- regular expressions and grammars -----------------------------------------------------------

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,3})?",
           r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r"[^\n]{0,5}!"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rx=st.sampled_from(REGEXES), seed=st.integers(0, 2**32), temperature=st.sampled_from([0.0, 0.8, 1.5]))
def test_sampled_replies_fullmatch_the_regex(tiny_dirs, rx, seed, temperature):
    _, text = reply(tiny_dirs, Format("regex", rx), seed, temperature)
    assert re.fullmatch(rx, text), (rx, text)


def test_lark_grammar(tiny_dirs):
    grammar = 'start: "Answer: " ans ("." | "!")\nans: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/\n'
    for seed in range(4):
        _, text = reply(tiny_dirs, Format("grammar", grammar), seed)
        assert re.fullmatch(r"Answer: (yes|no|[0-9]{1,3})[.!]", text), text


def test_overlapped_mask_equals_inline(tiny_dirs, monkeypatch):
    """The worker-thread path (CUDA's) gives the same tokens as the inline one (the CPU's)."""
    fmt = Format("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 6}))
    out = {}
    for overlap in (False, True):
        monkeypatch.setattr(ConstraintMask, "overlap", overlap)
        out[overlap] = [reply(tiny_dirs, fmt, seed)[0] for seed in range(3)]
    assert out[False] == out[True]


def test_greedy_is_argmax_over_the_allowed_tokens(tiny_dirs):
    lm, s = tiny_session(tiny_dirs)
    c = Format("regex", "[0-9]+").compile(lm.tokenizer, s.eos_ids, s.vocab_size).constraint()
    first = next(iter(s.generate(PROMPT, SamplingConfig(temperature=0, max_new_tokens=1), constraint=c)))
    from engine.reference import full_logits
    ref = full_logits(lm.model, PROMPT, torch.device("cpu"), torch.float32)[-1]
    digits = [lm.tokenizer.token_to_id(d) for d in "0123456789"]
    assert first == digits[int(ref[digits].argmax())]


def test_forced_token_the_grammar_rejects_is_a_departure(tiny_dirs):
    lm, s = tiny_session(tiny_dirs)
    c = Format("regex", "[0-9]+").compile(lm.tokenizer, s.eos_ids, s.vocab_size).constraint()
    forced = [lm.tokenizer.token_to_id("5"), lm.tokenizer.token_to_id("x"), lm.tokenizer.token_to_id("7"), 2]
    ids = list(s.generate(PROMPT, SamplingConfig(temperature=0, max_new_tokens=8), forced=forced, constraint=c))
    assert ids == forced
    d = [d for d in s.last_stats.departures if d.index == 1]
    assert d and d[0].logp_forced == float("-inf")


# --- bad formats: one line naming the place --------------------------------------------------------

@pytest.mark.parametrize("fmt, needle", [
    (('json_schema', '{"type":"object","properties":{"a":{"not":{}}}}'), "at /properties/a: unsupported keyword 'not'"),
    (('json_schema', '{"type":"integer","minimum":5,"maximum":2}'), "minimum (5) is greater than maximum (2)"),
    (('json_schema', '{"type":"string","pattern":"(?=a)"}'), "at /: invalid regex: look-around"),
    (('regex', '[a-z'), "invalid regex at column 1: unclosed character class"),
    (('regex', r'[^\s\S]'), "no token sequence can match it"),
    (('grammar', 'start: "a" b\n'), 'line 1, column 8: unknown name: "b"'),
])
def test_bad_formats_name_the_place(tiny_dirs, fmt, needle):
    lm, s = tiny_session(tiny_dirs)
    with pytest.raises(ConstraintError) as e:
        Format(*fmt).compile(lm.tokenizer, s.eos_ids, s.vocab_size, "--flag")
    assert str(e.value).startswith("--flag: ") and needle in str(e.value) and "\n" not in str(e.value)


def test_schema_json_syntax_error_names_line_and_column():
    with pytest.raises(ConstraintError, match=r"--json-schema:2:7: not valid JSON"):
        schema_format('{"type":"object",\n "x": }', "--json-schema")
    with pytest.raises(ConstraintError, match="cannot read"):
        parse_arg("grammar", "/no/such.lark", "--grammar")


def run_main(capsys, *argv):
    from chat.__main__ import main
    code = main(list(argv))
    return code, capsys.readouterr()


def test_cli_bad_formats_exit_2(tiny_dirs, tmp_path, capsys):
    model = ["--model", tiny_dirs["llama"][0], "--prompt", "hi"]
    bad = tmp_path / "bad.lark"
    bad.write_text('start: "x" |\n foo', encoding="utf-8")
    for flags, needle in [(["--json-schema", '{"type": "frob"}'], "--json-schema: at /: Invalid type: frob"),
                          (["--regex", "a{3,2}"], "--regex a{3,2}: invalid regex at column 2"),
                          (["--grammar", str(bad)], f"--grammar {bad}: line 2, column 5"),
                          (["--json-schema", str(tmp_path / "none.json")], "cannot read")]:
        code, out = run_main(capsys, *model, *flags)
        lines = out.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], (flags, out.err)
    with pytest.raises(SystemExit) as e:  # argparse: the flags exclude each other
        run_main(capsys, *model, "--regex", "a", "--grammar", str(bad))
    assert e.value.code == 2 and "not allowed with argument --regex" in capsys.readouterr().err


def test_cli_prompt_with_schema(tiny_dirs, tmp_path, capsys):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    for arg in (json.dumps(schema), str(path)):
        code, out = run_main(capsys, "--model", tiny_dirs["llama"][0], "--prompt", "hi", "--temperature", "0",
                             "--max-new-tokens", "200", "--json-schema", arg)
        assert code == 0, out.err
        jsonschema.validate(json.loads(out.out), schema)


# --- the REPL ------------------------------------------------------------------------------------

def test_repl_format_commands(tiny_dirs, tmp_path, capsys):
    from chat.controller import ChatController
    from chat.render import Renderer
    from chat.repl import ReplApp
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from tests.support.repl import Out, drive

    settings = load_settings(None, env={}, overrides={"model": tiny_dirs["llama"][0], "temperature": "0.9",
                                                     "seed": "3", "max_new_tokens": "300",
                                                     "history_file": str(tmp_path / "h")})
    out = Out()
    app = ReplApp(ChatController(open_runtime(settings), settings), Renderer(out=out, color="never"))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "A" | "B"\n', encoding="utf-8")
    keys = ("/format regex [0-9]{2}\rfirst\r"
            "/format json\rsecond\r"
            '/format schema {"type":"array","items":{"type":"boolean"},"maxItems":3}\rthird\r'
            f"/format grammar {grammar}\rfourth\r/show\r"
            "/format regex (?=x)\r/format bogus\r/format schema {nope\r"
            "/format off\rfifth\r/format\r/exit\r")
    assert drive(app, settings, keys) == 0
    texts = [t.result.text for t in app.controller.turns]
    assert len(texts) == 5
    assert re.fullmatch("[0-9]{2}", texts[0]) and texts[1].startswith("{")  # (random weights: may not close)
    assert all(isinstance(v, bool) for v in json.loads(texts[2])) and texts[3] in ("A", "B")
    assert [t.format is None for t in app.controller.turns] == [False] * 4 + [True]
    assert f"format: grammar 'start: \"A\" | \"B\"\\n'" in out.text and "format: off (free text)" in out.text
    err = capsys.readouterr().err
    assert "/format regex: invalid regex at column 1: look-around" in err
    assert "usage: /format" in err and "/format schema:1:2: not valid JSON" in err


# --- transcripts ---------------------------------------------------------------------------------

SCRIPT = """format: chat-transcript
version: 1
model: {{source: {model}}}
engine: {{device: cpu}}
sampling: {{temperature: 0.9, seed: 5, max_new_tokens: 300}}
output_format:
  json_schema: {{type: object, properties: {{ok: {{type: boolean}}}}, required: [ok], additionalProperties: false}}
events:
  - user: "first"
  - user: "second"
    output_format: {{regex: "[a-c]{{2,5}}"}}
  - command: /retry
  - user: "third"
    output_format: "off"
  - user: "fourth"
    output_format: json
"""


@pytest.mark.slow
def test_run_then_replay_constrained_recording(tiny_dirs, tmp_path, capsys):
    from chat import transcript as tr
    script, rec = tmp_path / "s.yaml", tmp_path / "r.yaml"
    script.write_text(SCRIPT.format(model=tiny_dirs["llama"][0]), encoding="utf-8")
    code, out = run_main(capsys, "run", str(script), "-o", str(rec))
    assert code == 0, out.err
    r = tr.load(str(rec))
    turns = [e for e in r.events if e.result is not None]
    assert json.loads(turns[0].result["text"]) in ({"ok": True}, {"ok": False})
    assert re.fullmatch("[a-c]{2,5}", turns[1].result["text"]) and re.fullmatch("[a-c]{2,5}", turns[2].result["text"])
    assert isinstance(json.loads(turns[4].result["text"]), dict)
    # each turn states the format in force (off where one was in force before)
    assert [e.format if e.format == tr.UNSET or e.format is None else e.format.kind for e in turns] == \
        ["json_schema", "regex", "regex", None, "json"]
    code, out = run_main(capsys, "replay", str(rec), "--runs", "3")
    assert code == 0 and "replay identical" in out.out, out.out + out.err
    code, out = run_main(capsys, "replay", str(rec), "--tolerance", "0.5")  # teacher-forced, masked
    assert code == 0, out.out + out.err
    # a changed format is a divergence
    rec.write_text(rec.read_text(encoding="utf-8").replace("[a-c]{2,5}", "[d-f]{2,5}"), encoding="utf-8")
    code, out = run_main(capsys, "replay", str(rec))
    assert code == 1


# --- the embedded model (slow) -------------------------------------------------------------------

CITY = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'
QUESTION = "Which city is the capital of France? Answer in JSON."


def chat_cli(*args):
    import os
    import subprocess
    import sys
    from tests.support.paths import ROOT
    return subprocess.run([sys.executable, "-m", "chat", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, CHAT_HISTORY_FILE=os.devnull), stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_embedded_model_answers_in_json(tmp_path):
    proc = chat_cli("--prompt", QUESTION, "--json-schema", CITY, "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert isinstance(answer["city"], str)
    script, rec = tmp_path / "s.yaml", tmp_path / "r.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0}\n"
                      f"output_format: {{json_schema: {CITY}}}\n"
                      f"events:\n  - user: \"{QUESTION}\"\n  - user: \"And of Italy?\"\n"
                      "    set: {temperature: 0.8, seed: 7}\n", encoding="utf-8")
    proc = chat_cli("run", str(script), "-o", str(rec))
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert json.loads(first) == answer and isinstance(json.loads(second)["city"], str)
    proc = chat_cli("replay", str(rec), "--runs", "3")
    assert proc.returncode == 0 and "replay identical" in proc.stdout, proc.stdout + proc.stderr


def test_repl_starts_with_the_flag_format(tiny_dirs, monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/format\nagain\n"))
    code, out = run_main(capsys, "--model", tiny_dirs["llama"][0], "--regex", "[xyz]{3}", "--temperature", "0.9",
                         "--seed", "1")
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert re.fullmatch("[xyz]{3}", lines[0]) and lines[1] == "format: regex [xyz]{3}" and re.fullmatch("[xyz]{3}", lines[2])
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    code, out = run_main(capsys, "--model", tiny_dirs["llama"][0], "--regex", "(?<=a)b")
    assert code == 2 and "--regex (?<=a)b: invalid regex" in out.err


# --- a reply cut off before its format was complete (issue 69) ----------------------------------

PERSON = ('{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
          '"required":["name","age"]}')


def test_cut_off_reply_is_never_passed_off_as_whole(tiny_dirs, tmp_path, monkeypatch, capsys):
    """--prompt and piped input: the text as far as it got, a one-line notice, exit 3; in the
    REPL the notice, the stats line's finish reason, and `length` in the recording."""
    import io
    model = ["--model", tiny_dirs["llama"][0], "--temperature", "0", "--json-schema", PERSON]
    code, out = run_main(capsys, *model, "--max-new-tokens", "5", "--prompt", "hi")
    lines = out.err.strip().splitlines()
    assert code == 3 and out.out.startswith("{") and len(lines) == 1, (code, out)
    assert "max_new_tokens (5)" in lines[0] and "cut off" in lines[0] and "--max-new-tokens" in lines[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, out = run_main(capsys, *model, "--max-new-tokens", "5")
    assert code == 3 and "max_new_tokens (5)" in out.err and out.out.startswith("{"), (code, out)
    # a reply that completes its format ends as before, also where its last token was the last allowed
    code, out = run_main(capsys, "--model", tiny_dirs["llama"][0], "--regex", "[xyz]{3}", "--temperature", "0",
                         "--max-new-tokens", "3", "--prompt", "hi")
    assert code == 0 and out.err == "" and re.fullmatch("[xyz]{3}\n", out.out), out

    from chat import transcript as tr
    from chat.controller import ChatController
    from chat.render import Renderer
    from chat.repl import ReplApp
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from tests.support.repl import Out, drive
    settings = load_settings(None, env={}, overrides={"model": tiny_dirs["llama"][0], "temperature": "0",
                                                     "max_new_tokens": "5", "history_file": str(tmp_path / "h")})
    shown = Out()
    app = ReplApp(ChatController(open_runtime(settings), settings),
                  Renderer(out=shown, color="always", force_terminal=True))
    rec = tmp_path / "r.yaml"
    assert drive(app, settings, f"/format schema {PERSON}\rhi\r/stats\r/save {rec}\r/exit\r") == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown.text)
    assert text.count("finish: length") == 2 and "max_new_tokens (5)" in text and "/set max_new_tokens" in text
    assert [e.result["finish_reason"] for e in tr.load(str(rec)).events] == ["length"]


def test_chat_run_reports_a_cut_off_reply_after_recording_it(tiny_dirs, tmp_path, capsys):
    """`chat run`: each cut-off turn is a notice naming its line, the recording is written with
    `length`, and the exit status is 3; a script whose replies complete exits 0."""
    import json

    from chat import transcript as tr
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 5}\n"
                      f"output_format: {{json_schema: {json.dumps(PERSON)}}}\nevents:\n- user: hi\n- user: again\n")
    rec = tmp_path / "r.yaml"
    code, out = run_main(capsys, "run", str(script), "-o", str(rec), "--model", tiny_dirs["llama"][0])
    notes = [line for line in out.err.splitlines() if line.startswith("chat: note:")]
    assert code == 3 and len(notes) == 2, (code, out.err)
    assert f"{script}:6: turn 1:" in notes[0] and "max_new_tokens (5)" in notes[0] and "cut off" in notes[0]
    assert [e.result["finish_reason"] for e in tr.load(str(rec)).events] == ["length", "length"]
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 3}\n"
                      "output_format: {regex: '[xyz]{3}'}\nevents:\n- user: hi\n")
    code, out = run_main(capsys, "run", str(script), "--model", tiny_dirs["llama"][0])
    assert code == 0 and "chat: note:" not in out.err, (code, out.err)
