"""Conversations as trees: /edit N forks a branch that shares the first N-1 exchanges, /branches
lists them, /branch K goes on from another. Each branch's replies equal a fresh session given
that branch's messages (greedy and seeded); going back to a fork prefills only the tokens after
it (on a hybrid too, through its turn-boundary checkpoint); the tree survives /save, /load,
--resume and replay, where its history is the commands that built it."""
from __future__ import annotations

import os

import pytest
import yaml

from tests.support.cli import run_chat as chat
from tests.support.paths import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden")


def controller(model: str, **over):
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    rt = open_runtime(load_settings(env={}, overrides={"model": os.path.join(GOLDEN, model), "max_new_tokens": "6",
                                                        **over}))
    return ChatController(rt, rt.settings)


def say(c, text, edit=None):
    from chat.turn import TurnResult
    r = TurnResult([])
    list(c.send(text, r) if edit is None else c.edit(edit, text, r))
    return r


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3_5"])
@pytest.mark.parametrize("sampling", [{"temperature": "0"}, {"temperature": "0.9", "seed": "7"}],
                         ids=["greedy", "seeded"])
def test_a_branch_replies_as_a_fresh_session_would(model, sampling):
    c = controller(model, **sampling)
    first = [say(c, m) for m in ("hello there", "second message", "third one")]
    edited = say(c, "an edited second", edit=2)
    say(c, "and then")
    assert c.current == 1 and [t.user for t in c.turns] == ["hello there", "an edited second", "and then"]
    assert [t.user for t in c.branches[0].turns] == ["hello there", "second message", "third one"]
    fresh = controller(model, **sampling)
    for t in c.turns:
        assert say(fresh, t.user).ids == t.result.ids
    # going back to the fork reuses what going on from it did the first time (the second turn): only
    # the tokens after the fork are prefilled, the hybrid's through its turn-boundary checkpoint
    at_fork = first[1].stats.reused_tokens
    assert at_fork > 0 and edited.stats.reused_tokens >= at_fork
    c.switch(0)
    again = say(c, "back on the first")
    assert again.stats.reused_tokens >= at_fork
    other = controller(model, **sampling)
    for t in c.turns:
        assert say(other, t.user).ids == t.result.ids


def test_a_failed_edit_leaves_no_branch():
    from engine.session import ContextOverflow
    c = controller("tiny-llama", temperature="0", max_context="64")
    say(c, "hi")
    with pytest.raises(ContextOverflow):
        say(c, "x " * 80, edit=1)
    assert len(c.branches) == 1 and c.current == 0 and len(c.turns) == 1


@pytest.mark.slow
def test_the_repl_edits_lists_and_switches(tmp_path):
    saved = tmp_path / "tree.yaml"
    lines = ["one", "two", "three", "/edit 2 TWO", "four", "/branches", "/branch 1", "/undo", "/undo", "/edit 9 x",
             "/edit 1", "/branch 3", "five", f"/save {saved}", "/branches", "/exit"]
    p = chat("--model", os.path.join(GOLDEN, "tiny-llama"), "--temperature", "0", "--max-new-tokens", "4",
             stdin="\n".join(lines) + "\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "   1  from the start, 3 exchanges: 'three'" in p.stdout
    assert "*  2  from branch 1 after exchange 1, 3 exchanges: 'four'" in p.stdout
    assert "/edit 9: there is no exchange 9 to edit (this branch has 1)" in p.stderr
    assert "usage: /edit 1 TEXT (piped input and scripts give the new text" in p.stderr
    assert "/branch 3: there is no branch 3 (there are 2)" in p.stderr
    assert "*  1  from the start, 2 exchanges: 'five'" in p.stdout  # (the /undo's and the new turn: branch 1's own)
    events = yaml.safe_load(saved.read_text())["events"]
    assert [e.get("user") or e["command"] for e in events] == ["one", "five", "/edit 2 TWO", "four", "/branch 1"]
    assert all("prompt_ids" in e for e in events[:4])
    p = chat("replay", saved, "--runs", "1", tmp_path=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    p = chat("--model", os.path.join(GOLDEN, "tiny-llama"), stdin=f"/load {saved}\n/branches\n/exit\n",
             tmp_path=tmp_path)
    assert "*  1  from the start, 2 exchanges: 'five'" in p.stdout and "   2  from branch 1 after exchange 1" in p.stdout


@pytest.mark.slow
def test_a_script_forks_and_its_recording_replays(tmp_path):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 3}\n"
                      "events:\n- user: a\n- user: b\n- command: \"/edit 1 A  \"\n- user: c\n- command: /branch 1\n"
                      "- user: d\n")
    rec = tmp_path / "r.yaml"
    p = chat("run", script, "--model", os.path.join(GOLDEN, "tiny-qwen3_5"), "-o", rec, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    events = yaml.safe_load(rec.read_text())["events"]
    assert events[2]["command"] == "/edit 1 A  " and events[2]["prompt_ids"]  # (the text exactly, spaces kept)
    assert chat("replay", rec, "--runs", "1", tmp_path=tmp_path).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("events,needle", [
    ("- user: a\n- command: /edit 2 x\n", "/edit 2: the current branch has 1 exchange"),
    ("- user: a\n- command: /branch 2\n", "/branch 2: there are 1 branches"),
    ("- user: a\n- command: /edit 1\n", "usage: /edit N TEXT"),
    ("- user: a\n- command: /edit 0 x\n", "usage: /edit N TEXT"),
    ("- user: a\n- command: /branch x\n", "usage: /branch K"),
])
def test_bad_edits_in_a_script_are_one_line(tmp_path, events, needle):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nevents:\n" + events)
    p = chat("run", script, "--model", os.path.join(GOLDEN, "tiny-llama"), tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and needle in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
