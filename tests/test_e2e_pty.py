"""End to end in a pseudo-terminal: the embedded model, two turns, Ctrl-C in the middle of a reply."""
import os
import re
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"
Q1 = "What is the capital of France?"
Q2 = "Write a long story about a brave dragon."
NEW = "160"  # long enough that Ctrl-C lands mid-reply even on a fast machine
ARGS = ["--temperature", "0", "--max-new-tokens", NEW]


def clean(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]", "", text).replace("\r", "")


def fresh_replies() -> list[str]:
    """What a fresh session replies to the same two turns (in-process, same settings)."""
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.turn import TurnResult
    settings = load_settings(None, env={}, overrides={"temperature": "0", "max_new_tokens": NEW})
    c = ChatController(open_runtime(settings), settings)
    return ["".join(c.send(q, TurnResult([]))) for q in (Q1, Q2)]


@pytest.mark.slow
def test_two_turns_with_ctrl_c_then_same_reply_as_fresh(tmp_path):
    expected1, expected2 = fresh_replies()
    env = dict(os.environ, CHAT_HISTORY_FILE=str(tmp_path / "history"), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "chat", "--color", "never", *ARGS], env=env,
                          encoding="utf-8", timeout=120, dimensions=(50, 200))
    try:
        child.expect_exact(PROMPT)
        child.send(Q1 + "\r")
        child.expect_exact(expected1.splitlines()[0])
        assert "Paris" in expected1
        child.expect_exact(PROMPT)
        child.send(Q2 + "\r")
        child.expect_exact(" ".join(expected2.split()[:3]))  # the reply has started streaming
        child.sendcontrol("c")
        child.expect_exact("interrupted")
        child.expect_exact(PROMPT)
        child.send(Q2 + "\r")
        child.expect_exact(expected2.splitlines()[0])
        child.expect_exact(PROMPT)
        streamed = clean(child.before)
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    # the whole reply after the interruption equals the fresh session's reply
    for line in expected2.splitlines()[1:]:
        assert line.strip() in streamed
