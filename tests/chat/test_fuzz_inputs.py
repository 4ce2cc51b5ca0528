"""Fuzzing what a user can type or hand us: config files, flags, `/set` lines and recordings,
through the real CLI entry point (`chat.__main__.main`) in this process, on the tiny golden
llama checkpoint.

Each input must end in exactly one of two ways: refused with one line `chat: error: ...` and exit
2, or accepted and working (a reply printed; a replay that matches or reports its divergence).
No exception may leave `main`, and the REPL must answer the message after a bad command. The
value strategies lean on the edges that broke things before: huge integers, non-finite numbers,
NUL bytes, long text, nested lists, wrong types.
"""
from __future__ import annotations

import dataclasses
import io
import os
import string

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, example, given, settings, strategies as st

from chat.__main__ import main
from chat.settings import SECTIONS, SETTABLE

from tests.support.paths import ROOT

TINY = os.path.join(ROOT, "tests", "golden", "tiny-llama")
KV = os.path.join(ROOT, "tests", "golden", "recordings", "kv-greedy.yaml")
KEYS = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
# Keys whose valid values would make one example slow or change the test process itself (threads
# of this process, torch.compile, worker processes, another model): fuzzed for refusal only.
HEAVY = {"model", "threads", "compile", "tensor_parallel", "device", "history_file", "conversations_dir"}
FAST = ["--model", TINY, "--max-new-tokens", "3", "--max-context", "256"]

scalars = st.one_of(
    st.integers(), st.integers(min_value=2**31 - 2, max_value=2**80), st.integers(min_value=-2**80, max_value=-1),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=12), st.text(alphabet=string.printable + "\0\u2028é", max_size=8),
    st.sampled_from(["auto", "on", "off", "cpu", "cuda", "float16", "1e400", "nan", "-1", "0", "", "  3 "]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                      max_leaves=6)
flag_text = st.one_of(scalars.map(str), st.text(max_size=20))
FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """main(argv) with `stdin` as piped input: (exit status, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for key in KEYS:
        monkeypatch.delenv(f"CHAT_{key.upper()}", raising=False)

    def run(argv, stdin: str = ""):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # (argparse's usage errors exit from inside: as the `chat` script would)
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def refused_or_working(code: int, out: str, err: str, works) -> bool:
    """True where the input was refused cleanly; asserts `works(out)` where it was accepted."""
    assert "Traceback" not in err
    event("refused" if code == 2 else "accepted")  # (--hypothesis-show-statistics: both must occur)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("chat: error:") and len(lines[0]) < 600, err
        return True
    assert code == 0, (code, err)
    assert works(out), (out, err)
    return False


@FUZZ
@given(body=st.dictionaries(st.sampled_from(list(SECTIONS) + ["bogus"]),
                            st.dictionaries(st.sampled_from(KEYS + ["nope"]), values, max_size=3), max_size=3))
def test_config_files(cli, tmp_path, body):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(body))
    assume(not any(k in HEAVY for section in body.values() for k in section))
    code, out, err = cli(["--config", path, "--prompt", "hi", *FAST])
    refused_or_working(code, out, err, lambda o: o != "")


# The edges that broke things before, tried on every key besides what hypothesis draws.
EDGES = ["99999999999999999999999", "-99999999999999999999999", "9223372036854775808", "1e400", "nan", "-inf",
         "a\0b", "x" * 5000, ""]


def with_edges(test):
    for edge in EDGES:
        test = example(value=edge)(test)
    return test


@pytest.mark.parametrize("key", [k for k in KEYS if k not in HEAVY])
@settings(FUZZ, max_examples=len(EDGES) + 6)
@with_edges
@given(value=flag_text)
def test_flags(cli, key, value):
    code, out, err = cli(["--prompt", "hi", *FAST, f"--{key.replace('_', '-')}", value])
    refused_or_working(code, out, err, lambda o: o != "")


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), flag_text), min_size=2, max_size=4))
def test_flag_combinations(cli, pairs):
    assume(not any(k in HEAVY or k in ("max_new_tokens", "max_context") for k, _ in pairs))
    argv = [a for k, v in pairs for a in (f"--{k.replace('_', '-')}", v)]
    code, out, err = cli(["--prompt", "hi", *FAST, *argv])
    refused_or_working(code, out, err, lambda o: o != "")


@pytest.mark.parametrize("key", SETTABLE + ["max_context", "bogus"])
@settings(FUZZ, max_examples=len(EDGES) + 2)
@with_edges
@given(value=flag_text)
def test_set_lines_keep_the_repl(cli, key, value):
    value = " ".join(value.split())[:200]  # (one line of input)
    lines = f"/set {key} {value}\nhello\n/exit\n"
    code, out, err = cli([*FAST, "--temperature", "0"], stdin=lines)
    assert code == 0 and "Traceback" not in err, (code, err)
    assert out.strip(), f"no reply after `/set {key} {value}`: {err}"


@FUZZ
@given(commands=st.lists(st.tuples(st.sampled_from(["/edit", "/branch", "/branches", "/think", "/undo", "/retry"]),
                                   flag_text), min_size=1, max_size=4))
def test_tree_commands_keep_the_repl(cli, commands):
    """/edit, /branch and the rest with any argument, between turns: the REPL answers the message
    after them (and says what was wrong on stderr, one line each)."""
    lines = ["first"] + [f"{name} {' '.join(arg.split())[:200]}".rstrip() for name, arg in commands] + ["last", "/exit"]
    code, out, err = cli([*FAST, "--temperature", "0"], stdin="\n".join(lines) + "\n")
    assert code == 0 and "Traceback" not in err, (code, err)
    assert len([line for line in out.splitlines() if line.strip()]) >= 2, (out, err)


def _mutations():
    fields = ["seed", "prompt_ids", "generated_ids", "reused", "text", "finish_reason", "sampling"]
    edit = st.tuples(st.sampled_from(["event"]), st.integers(0, 3), st.sampled_from(fields), values)
    token = st.tuples(st.sampled_from(["token"]), st.integers(0, 3),
                      st.sampled_from(["prompt_ids", "generated_ids"]), st.integers(-5, 2**70))
    insert = st.tuples(st.sampled_from(["insert"]), st.integers(0, 4),
                       st.sampled_from(["/retry", "/undo", "/reset", "/system hi", "/set top_k 3", "/set", "/bogus",
                                        "/edit 1 hi", "/edit 9 hi", "/edit 1", "/edit x y", "/branch 1", "/branch 2",
                                        "/branch 0", "/think off", "/think maybe"]),
                       st.none())
    header = st.tuples(st.sampled_from(["header"]), st.just(0),
                       st.sampled_from(["sampler", "version", "sampling", "system_prompt", "engine", "events"]), values)
    return st.lists(st.one_of(edit, token, insert, header), min_size=1, max_size=3)


@pytest.mark.slow
@settings(FUZZ, max_examples=15)
@given(mutations=_mutations())
def test_recordings(cli, tmp_path, mutations):
    with open(KV) as f:
        doc = yaml.safe_load(f)
    for kind, i, name, value in mutations:
        events = doc.get("events")
        if not isinstance(events, list) or i >= len(events) or not isinstance(events[i], dict):
            continue  # (an earlier mutation replaced the events)
        if kind == "event":
            events[i][name] = value
        elif kind == "token" and isinstance(events[i].get(name), list) and events[i][name]:
            events[i][name][len(events[i][name]) // 2] = value
        elif kind == "insert":
            events.insert(i, {"command": name})
        elif kind == "header":
            doc[name] = value
    path = tmp_path / "rec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out, err = cli(["replay", path])
    assert "Traceback" not in err
    assert code in (0, 1, 2), (code, err)
    event({0: "replayed", 1: "diverged", 2: "refused"}[code])
    if code == 2:  # a bad file: one line
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("chat: error:"), err
