"""End to end in a pseudo-terminal: the embedded model; Ctrl-C in the middle of a reply, at an empty
prompt and at random moments; a process killed mid-reply, then `chat --resume`."""
import contextlib
import os
import re
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"
Q1 = "What is the capital of France?"
Q2 = "Write a long story about a brave dragon."
NEW = "160"  # long enough that Ctrl-C lands mid-reply even on a fast machine
ARGS = ["--temperature", "0", "--max-new-tokens", NEW]


def clean(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]", "", text).replace("\r", "")


@pytest.mark.slow
def test_two_turns_with_ctrl_c_then_same_reply_as_fresh(tmp_path):
    expected1, expected2 = replies([Q1, Q2], NEW)
    with running(tmp_path, *ARGS) as child:
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
    # the whole reply after the interruption equals the fresh session's reply
    for line in expected2.splitlines()[1:]:
        assert line.strip() in streamed


# --- the REPL never loses a conversation: Ctrl-C that comes late, a killed process ------------

HINT = "Ctrl-D or /exit to leave"
QA, QB, QC = "What is the capital of France?", "And of Germany?", "Write a long poem about the sea."


@contextlib.contextmanager
def running(tmp_path, *args):
    """`chat ARGS` in a pty, killed on the way out whatever happened."""
    child = spawn(tmp_path, *args)
    try:
        yield child
    finally:
        child.close(force=True)


def spawn(tmp_path, *args):
    # PROMPT_TOOLKIT_NO_CPR: a pty answers no cursor-position request, and prompt-toolkit would
    # wait ~1 s for one after each Enter, in raw mode, where a Ctrl-C is a key press, not SIGINT
    env = dict(os.environ, CHAT_HISTORY_FILE=str(tmp_path / "history"), TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1",
               CHAT_CONVERSATIONS_DIR=str(tmp_path / "conversations"))
    return pexpect.spawn(sys.executable, ["-m", "chat", "--color", "never", *args], env=env,
                         encoding="utf-8", timeout=120, dimensions=(50, 200))


def replies(questions: list[str], new: str) -> list[str]:
    """A fresh in-process conversation's replies (same settings as the spawned chat)."""
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.turn import TurnResult
    settings = load_settings(None, env={}, overrides={"temperature": "0", "max_new_tokens": new})
    c = ChatController(open_runtime(settings), settings)
    return ["".join(c.send(q, TurnResult([]))) for q in questions]


def first_words(text: str, n: int = 4) -> str:
    return " ".join(text.split()[:n])


def ask(child, question: str, reply: str) -> None:
    """Send a question; the terminal shows exactly `reply`, then the prompt."""
    child.send(question + "\r")
    assert read_reply(child, reply) == " ".join(reply.split())


def leave(child) -> None:
    child.sendcontrol("d")
    child.expect(pexpect.EOF)


def read_reply(child, reply: str) -> str:
    """The reply as the terminal showed it, from its first words to the next prompt, with its
    whitespace normalised (plain mode streams the text as it is)."""
    child.expect_exact(first_words(reply))
    seen = child.after
    child.expect_exact(PROMPT)
    return " ".join(clean(seen + child.before).split())


@pytest.mark.slow
def test_ctrl_c_at_an_empty_prompt_stays_and_many_ctrl_c_during_replies_change_nothing(tmp_path):
    import random
    (answer,) = replies([QA], "400")
    with running(tmp_path, "--temperature", "0", "--max-new-tokens", "400") as child:
        child.expect_exact(PROMPT)
        for _ in range(3):
            child.sendcontrol("c")
            child.expect_exact(HINT)
        assert child.isalive()
        rng = random.Random(7)
        for _ in range(20):  # (the poem runs to a few hundred tokens, most of a second at the CPU's
            # fastest decode: a Ctrl-C within its first third of a second lands in the prefill or the reply)
            child.send(QC + "\r")
            time.sleep(rng.uniform(0.05, 0.35))
            child.sendcontrol("c")
            child.expect_exact("interrupted")
        ask(child, QA, answer)
        leave(child)


@pytest.mark.slow
def test_kill_9_during_the_third_reply_then_resume_continues_at_the_second(tmp_path):
    a, b, c = replies([QA, QB, QC], "200")
    with running(tmp_path, "--temperature", "0", "--max-new-tokens", "200") as child:
        child.expect_exact(PROMPT)
        for q, reply in ((QA, a), (QB, b)):
            ask(child, q, reply)
        child.send(QC + "\r")
        child.expect_exact(first_words(c, 2))  # streaming
        child.kill(9)
    saved = sorted(p.name for p in (tmp_path / "conversations").iterdir() if not p.name.startswith(".tmp-"))
    assert len(saved) == 2 and saved[1] == saved[0] + ".state", saved  # (the recording, its state beside it)
    with running(tmp_path, "--resume") as child:
        child.expect_exact("resumed 2 turns")
        child.expect_exact("resumed from saved state")
        child.send("/show\r")
        child.expect_exact("turns: 2")
        ask(child, QC, c)
        leave(child)


@pytest.mark.slow
def test_model_switch_to_a_tiny_checkpoint_and_back_keeps_the_messages(tmp_path, tiny_dirs):
    (a,) = replies([QA], "24")
    with running(tmp_path, "--temperature", "0", "--max-new-tokens", "24") as child:
        child.expect_exact(PROMPT)
        ask(child, QA, a)
        child.send(f"/model {tiny_dirs['llama'][0]}\r")
        child.expect_exact("1 exchanges kept")
        child.send("/model smollm2\r")
        child.expect_exact("1 exchanges kept")
        saved = tmp_path / "after.yaml"
        child.send(f"/save {saved}\r")
        child.expect_exact("saved 1 turns")
        child.expect_exact(PROMPT)
        leave(child)
    from chat import transcript as tr
    t = tr.load(str(saved))
    assert [e.user for e in t.events] == [QA] and t.events[0].result["text"] == a


@pytest.mark.slow
def test_edit_a_message_in_the_prompt_then_switch_branches(tmp_path):
    """On a terminal: /edit 2 puts message 2 in the prompt; the edited message's reply is the one a
    fresh session gives to the edited conversation, on branch 2; /branch 1 goes back, and the next
    reply is the one the first conversation would have given."""
    edited = QB.replace("Germany", "Spain")
    a, b, c = replies([QA, QB, QC], "24")
    with_edit = replies([QA, edited], "24")[1]
    with running(tmp_path, "--temperature", "0", "--max-new-tokens", "24") as child:
        child.expect_exact(PROMPT)
        ask(child, QA, a)
        ask(child, QB, b)
        child.send("/edit 2\r")
        child.expect_exact("editing message 2")
        child.expect_exact(QB)  # (the prompt holds message 2)
        ask(child, "\x7f" * len(QB) + edited, with_edit)  # (the old text erased, the new one typed)
        child.send("/branches\r")
        child.expect_exact("*  2  from branch 1 after exchange 1, 2 exchanges")
        child.send("/branch 1\r")
        child.expect_exact("on branch 1: 2 exchanges")
        ask(child, QC, c)
        leave(child)
