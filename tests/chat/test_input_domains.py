"""Bad settings and bad recordings: one line, exit 2, never a traceback, never a divergence.

Every setting has a domain (type, bounds or choices) declared once beside its default
(engine/config.py, chat/settings.py), checked at every entry: config file (with its line),
CHAT_* variable, flag, `/set`, a recording's settings. A recording is validated whole before
anything runs (chat/transcript.py): event order, settings, seeds and ids in range, then the
model's vocabulary once it is loaded.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import yaml

from chat import transcript as tr
from chat.settings import SECTIONS, load_settings
from engine.config import ConfigError, quote

from tests.support.paths import ROOT

KV = os.path.join(ROOT, "tests", "golden", "recordings", "kv-greedy.yaml")
TINY = os.path.join(ROOT, "tests", "golden", "tiny-llama")


@pytest.fixture
def chat_here(chat_here, monkeypatch):
    """conftest's, with a state folder of these tests' own."""
    monkeypatch.setenv("XDG_STATE_HOME", str(os.path.join(os.environ.get("TMPDIR", "/tmp"), "chat-domains-state")))
    return chat_here


def one_line_error(code: int, err: str, *needles: str, status: int = 2) -> str:
    assert code == status, (code, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chat: error:"), err
    assert len(lines[0]) < 400, f"{len(lines[0])} characters"
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --- settings ----------------------------------------------------------------------------------

def _fields():
    return [(cls, f) for cls in SECTIONS.values() for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls,f", _fields(), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_every_setting_is_bounded(cls, f):
    """No integer, number or text setting is open-ended: 10**23, inf, nan, a NUL or a megabyte-long
    path are refused by the field's own check."""
    check, kind = f.metadata["check"], f.metadata["kind"]
    if kind in (int, (int, str)):
        assert not check(10**23) and not check(-10**23), f.name
    elif kind is float:
        assert not any(check(v) for v in (math.inf, -math.inf, math.nan, 1e300, -1e300)), f.name
    elif kind is str and " | " not in f.metadata["allowed"]:  # (choices are bounded by themselves)
        assert not check("x" * (1 << 21)) and not check("a\0b"), f.name
    elif kind is list:
        assert not check(["x"] * 100_000) and not check(["x" * (1 << 21)]), f.name


def test_huge_penalty_window_flag_is_one_line(chat_here):
    one_line_error(*chat_here("--prompt", "hi", "--penalty-last-n", "99999999999999999999999")[::2],
                   "--penalty-last-n", "penalty_last_n", "1048576")


def test_variable_names_itself(monkeypatch):
    monkeypatch.setenv("CHAT_TOP_K", "99999999999999999999999")
    with pytest.raises(ConfigError, match=r"^CHAT_TOP_K: top_k: "):
        load_settings(config_path=os.devnull)


@pytest.mark.parametrize("text,error", [
    ("engine:\n  device: cpu\nsampling:\n  temperature: 0.5\n  top_k: 1e400\n", r":5: top_k: "),
    ("sampling:\n  temperature: 0.5\n  bogus: 1\n", r":3: sampling.bogus: unknown setting"),
    ("sampling:\n  temperature: 0.5\n  temperature: 0.9\n", r":3: duplicate key 'temperature' \(first at line 2\)"),
])
def test_config_file_errors_name_the_line(tmp_path, text, error):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{p}{error}"):
        load_settings(str(p), env={})


def test_merge_keys_may_be_overridden(tmp_path):
    p = tmp_path / "c.yaml"
    # (a merge key's values may be overridden: not a duplicate)
    p.write_text("sampling:\n  <<: {temperature: 0.5, top_k: 3}\n  temperature: 0.9\n")
    s = load_settings(str(p), env={})
    assert (s.sampling.temperature, s.sampling.top_k) == (0.9, 3)


def test_alias_bomb_makes_a_short_line(tmp_path, chat_here):
    """A 9**8-leaf list from a few hundred bytes of YAML: the error quotes ~80 characters of it."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    p = tmp_path / "bomb.yaml"
    p.write_text(f"ui:\n  history_file: [{', '.join(parts)}]\n")
    assert len(p.read_bytes()) < 1000
    line = one_line_error(*chat_here("--config", p, "--prompt", "hi")[::2], f"{p}:2: history_file: [[")
    assert len(line) < 300


def test_quote_is_bounded():
    nested: list = ["lol"] * 9
    for _ in range(12):
        nested = [nested] * 9  # 9**13 leaves: a full repr would never finish
    assert len(quote(nested)) <= 80
    assert len(quote("x" * 10**6)) <= 80 and len(quote(10**4000)) <= 80


@pytest.mark.slow
def test_repl_set_out_of_range_then_next_message_is_answered():
    """`/set penalty_last_n 1e23` is refused in the REPL and the conversation goes on."""
    script = "/set penalty_last_n 99999999999999999999999\n/set top_k 99999999999999999999999\nhello\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "chat", "--model", TINY, "--temperature", "0", "--max-new-tokens", "4",
                        "--repetition-penalty", "1.1"], input=script, capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env=dict(os.environ, XDG_STATE_HOME=os.path.join(ROOT, ".pytest_cache", "st")))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "penalty_last_n: 99999999999999999999999 is not valid" in p.stderr
    assert "top_k: 99999999999999999999999 is not valid" in p.stderr
    assert p.stdout.strip(), "the message after the bad /set was not answered"


# --- recordings --------------------------------------------------------------------------------

def _kv() -> dict:
    with open(KV) as f:
        return yaml.safe_load(f)


def _write(tmp_path, doc: dict, name: str = "rec.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_retry_first_is_a_bad_file(tmp_path, chat_here):
    doc = _kv()
    doc["events"].insert(0, {"command": "/retry"})
    path = _write(tmp_path, doc)
    with pytest.raises(tr.TranscriptError, match=r":\d+: event 1: /retry with no exchange before it"):
        tr.load(path)
    one_line_error(*chat_here("replay", path)[::2], "/retry with no exchange")
    one_line_error(*chat_here("--resume", path)[::2], "/retry with no exchange")


def test_undo_after_reset_is_a_bad_file(tmp_path):
    doc = _kv()
    doc["events"][1:1] = [{"command": "/reset"}, {"command": "/undo"}]
    with pytest.raises(tr.TranscriptError, match=r"event 3: /undo with no exchange before it"):
        tr.load(_write(tmp_path, doc))


@pytest.mark.parametrize("field,value,needle", [
    ("generated_ids", [10**23], "generated_ids must be a list of token ids"),
    ("prompt_ids", [1, -3], "prompt_ids must be a non-empty list"),
    ("seed", 2**70, "seed must be an integer in [0, 9223372036854775807]"),
    ("reused", 10**6, "reused must be a count >= 0, at most the prompt's length"),
    ("sampling", {"temperature": 0.0, "penalty_last_n": 10**23}, "penalty_last_n: 100000000000000000000000 is not"),
    ("sampling", {"top_p": float("nan")}, "top_p: nan is not valid"),
])
def test_recorded_values_out_of_range(tmp_path, chat_here, field, value, needle):
    doc = _kv()
    doc["events"][0][field] = value
    path = _write(tmp_path, doc)
    one_line_error(*chat_here("replay", path)[::2], needle)
    one_line_error(*chat_here("replay", path, "--tolerance", "1.0")[::2], needle)


def test_settings_in_a_transcript_are_checked(tmp_path):
    doc = _kv()
    doc["events"][0]["set"] = {"penalty_last_n": 10**23}
    with pytest.raises(tr.TranscriptError, match=r"event 1: set: penalty_last_n: "):
        tr.load(_write(tmp_path, doc))
    doc = _kv()
    doc["events"].insert(1, {"command": "/set top_k 99999999999999999999999"})
    with pytest.raises(tr.TranscriptError, match=r"event 2: /set: top_k: "):
        tr.load(_write(tmp_path, doc))
    doc = _kv()
    doc["sampling"]["max_new_tokens"] = 0
    with pytest.raises(tr.TranscriptError, match=r"sampling: max_new_tokens: 0 is not valid"):
        tr.load(_write(tmp_path, doc))


@pytest.mark.parametrize("tolerance", [(), ("--tolerance", "1.0")])
def test_id_outside_the_vocabulary_is_a_bad_file_not_a_divergence(tmp_path, chat_here, tolerance):
    doc = _kv()
    doc["events"][1]["generated_ids"][2] = 5000  # the tiny model's vocabulary is 320 ids
    path = _write(tmp_path, doc)
    one_line_error(*chat_here("replay", path, *tolerance)[::2], "event 2: generated_ids: token id 5000",
                   "outside the model's vocabulary")


def test_duplicate_keys_in_a_recording(tmp_path):
    text = open(KV).read().replace("  reused: 0\n", "  reused: 0\n  reused: 0\n", 1)
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(tr.TranscriptError, match=r"duplicate key 'reused'"):
        tr.load(str(path))


@pytest.mark.slow
def test_load_of_a_bad_recording_keeps_the_repl(tmp_path):
    doc = _kv()
    doc["events"].insert(0, {"command": "/retry"})
    path = _write(tmp_path, doc)
    script = f"/load {path}\nhello\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "chat", "--model", TINY, "--temperature", "0", "--max-new-tokens", "4"],
                       input=script, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state")))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "/retry with no exchange before it" in p.stderr
    assert p.stdout.strip(), "the message after the bad /load was not answered"


@pytest.mark.parametrize("value", ["1_000", "\u0663", "0x10", " 1e3x"])
def test_numbers_are_ascii_decimal_text(chat_here, value):
    """(int() takes 1_000 and an Arabic-Indic 3; a setting's text takes neither)"""
    one_line_error(*chat_here("--prompt", "hi", "--max-new-tokens", value)[::2], "max_new_tokens")


@pytest.mark.parametrize("field,value,needle", [("version", True, "transcript version True"),
                                                ("version", 1.0, "transcript version 1.0")])
def test_header_values_of_the_wrong_type(tmp_path, field, value, needle):
    doc = _kv()
    doc[field] = value
    with pytest.raises(tr.TranscriptError, match=needle):
        tr.load(_write(tmp_path, doc))


def test_finish_reason_is_one_the_engine_gives(tmp_path):
    doc = _kv()
    doc["events"][0]["finish_reason"] = "banana"
    with pytest.raises(tr.TranscriptError, match="finish_reason must be one of stop, length"):
        tr.load(_write(tmp_path, doc))
