"""Rendering helpers: reasoning kept out of history, markdown blocks committed at safe points."""
import io

from chat.conversation import strip_reasoning
from chat.render import Renderer, split_committed, split_reasoning


def test_reasoning_is_split_and_stripped_from_history():
    text = "<think>\nweigh the options\n</think>\n\nThe answer is 4."
    assert split_reasoning(text) == ("\nweigh the options\n", "The answer is 4.")
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert strip_reasoning(text) == "The answer is 4."
    assert strip_reasoning("no reasoning here") == "no reasoning here"


def test_committed_blocks_never_cut_inside_a_code_fence():
    text = "Intro paragraph.\n\n```python\nx = 1\n\ny = 2\n```\n\nTail being typed"
    done, live = split_committed(text)
    assert done.endswith("```\n\n") and live == "Tail being typed"
    assert split_committed("```\nopen fence\n\nstill code")[0] == ""


def test_plain_mode_writes_exactly_the_reply():
    out = io.StringIO()
    r = Renderer(out=out, color="never")
    assert r.stream(iter(["Hello", ", ", "world"])) == "Hello, world"
    assert out.getvalue() == "Hello, world\n"


def test_rich_mode_renders_markdown_and_dims_reasoning():
    out = io.StringIO()
    r = Renderer(out=out, color="always", force_terminal=True)
    r.stream(iter(["<think>hmm</think>", "\n\n**bold** answer\n\n", "- item"]))
    shown = out.getvalue()
    assert "hmm" in shown and "bold" in shown and "**" not in shown and "\x1b[" in shown
