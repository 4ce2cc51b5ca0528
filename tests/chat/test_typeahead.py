"""chat/typeahead.py: keys that reached the terminal's queue while a prompt held it in raw mode."""
from __future__ import annotations

import os
import select
import termios
import tty

import pytest
from prompt_toolkit.input.typeahead import get_typeahead
from prompt_toolkit.keys import Keys

from chat.typeahead import take_pending


@pytest.fixture
def terminal():
    """(the pty's master fd, its slave fd), the slave in cooked mode as a reply finds it."""
    master, slave = os.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


class _Input:
    """What prompt-toolkit's typeahead store keys on."""

    def typeahead_hash(self) -> str:
        return "test-input"


def _typed_in_raw_mode(master, slave, data: bytes) -> None:
    """`data` typed while the slave is raw (as prompt-toolkit holds it), then cooked again."""
    saved = termios.tcgetattr(slave)
    tty.setraw(slave)
    os.write(master, data)
    assert select.select([slave], [], [], 5)[0]  # (the line discipline takes the bytes as raw ones)
    termios.tcsetattr(slave, termios.TCSANOW, saved)


def test_a_ctrl_c_typed_while_the_prompt_held_the_terminal_is_found(terminal):
    master, slave = terminal
    inp = _Input()
    get_typeahead(inp)
    saved = termios.tcgetattr(slave)
    _typed_in_raw_mode(master, slave, b"\x03")
    assert take_pending(slave, inp)
    assert termios.tcgetattr(slave) == saved  # the terminal's settings as they were
    assert get_typeahead(inp) == []
    assert not take_pending(slave, inp)  # consumed: the next prompt does not see it


def test_other_keys_become_the_next_prompts_typeahead(terminal):
    master, slave = terminal
    inp = _Input()
    get_typeahead(inp)
    _typed_in_raw_mode(master, slave, b"ab\x03c\x1b[A")
    assert take_pending(slave, inp)
    assert [k.key for k in get_typeahead(inp)] == ["a", "b", "c", Keys.Up]
    _typed_in_raw_mode(master, slave, b"next")
    assert not take_pending(slave, inp)
    assert "".join(k.key for k in get_typeahead(inp)) == "next"


def test_nothing_waiting_or_not_a_terminal(terminal, tmp_path):
    master, slave = terminal
    assert not take_pending(slave, _Input())
    with open(tmp_path / "f", "wb") as f:
        assert not take_pending(f.fileno(), _Input())


def test_a_ctrl_c_prompt_toolkit_read_with_the_enter_is_found(terminal):
    """Keys read in the same chunk as the Enter stay in prompt-toolkit's typeahead, not the queue."""
    from prompt_toolkit.input.typeahead import store_typeahead
    from prompt_toolkit.key_binding import KeyPress
    master, slave = terminal
    inp = _Input()
    get_typeahead(inp)
    store_typeahead(inp, [KeyPress(Keys.ControlC, "\x03"), KeyPress("x", "x")])
    _typed_in_raw_mode(master, slave, b"y")
    assert take_pending(slave, inp)
    assert [k.key for k in get_typeahead(inp)] == ["x", "y"]


def test_the_reply_stops_before_it_starts(terminal):
    """ReplApp.interruptible on a terminal: a Ctrl-C that waited (a key in the queue, or a SIGINT
    noted since the prompt returned) raises KeyboardInterrupt before the reply's body runs; with
    nothing waiting the body runs, and SIGINT's handler is put back either way."""
    import signal

    from chat.repl import ReplApp
    master, slave = terminal
    app = ReplApp(None, None)
    app.own_sigint = True
    app.terminal = (slave, _Input())
    handler = signal.getsignal(signal.SIGINT)
    ran = []
    _typed_in_raw_mode(master, slave, b"\x03")
    with pytest.raises(KeyboardInterrupt):
        with app.interruptible():
            ran.append("queued")
    app.late_interrupt = True
    with pytest.raises(KeyboardInterrupt):
        with app.interruptible():
            ran.append("noted")
    assert not app.late_interrupt
    with app.interruptible():
        ran.append("clear")
    assert ran == ["clear"] and signal.getsignal(signal.SIGINT) is handler
