"""Keys typed while prompt-toolkit still held the terminal, taken when a reply starts.

Contract: `take_pending(fd, input)` reads what waits in terminal `fd`'s input queue (without
blocking, leaving the terminal's settings as they were) and what prompt-toolkit `input` read but
left unhandled (its typeahead), gives `input` every key of both but Ctrl-C back as typeahead (the
next prompt starts with them, as it would have read them), and says whether a Ctrl-C was among
them. Not a terminal, and no typeahead: nothing happens.

Why: Enter ends the prompt while the terminal is still in raw mode; a Ctrl-C pressed in the next
few tens of milliseconds (before prompt-toolkit gives the terminal back) reaches the queue as a
byte, not as SIGINT, so the reply it was meant for ran to its end and the byte ended the next
prompt instead (tests/e2e/test_e2e_pty.py presses Ctrl-C at random delays after Enter: an early one was lost).
"""
from __future__ import annotations

import os
import select

from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
from prompt_toolkit.input.vt100_parser import Vt100Parser
from prompt_toolkit.keys import Keys

CTRL_C = b"\x03"


def take_pending(fd: int, input=None) -> bool:
    """Whether a Ctrl-C waited, in `fd`'s queue or among the keys prompt-toolkit read but left
    (its typeahead for `input`: read with the Enter); the other keys go back to that typeahead,
    the queue's after it. Call it where SIGINT cannot raise (the terminal's settings are changed
    and restored around the read)."""
    keys = get_typeahead(input) if input is not None else []  # (handed over and cleared)
    ctrl_c = any(k.key == Keys.ControlC for k in keys)
    keys = [k for k in keys if k.key != Keys.ControlC]
    data = _read_queue(fd)
    ctrl_c = ctrl_c or CTRL_C in data
    rest = data.replace(CTRL_C, b"")
    if rest:
        # (a read that stopped inside an escape sequence or a UTF-8 character gives that key as
        # Escape and characters, or U+FFFD: the queue is read whole, so only a key typed as it is
        # read can be cut)
        keys += _parse(rest.decode("utf-8", "replace"))
    if input is not None and keys:
        store_typeahead(input, keys)
    return ctrl_c


def _read_queue(fd: int) -> bytes:
    """What waits in terminal `fd`'s input queue, read without blocking (canonical mode off for
    the read, the settings restored with TCSANOW: a flush would drop typed keys); b"" where `fd`
    is not a terminal."""
    try:
        import termios
    except ImportError:  # (not POSIX: no such race to mend)
        return b""
    try:
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # not a terminal
        return b""
    raw = list(saved)
    raw[3] &= ~termios.ICANON  # what waits, whole lines or not, readable now
    raw[6] = list(saved[6])
    raw[6][termios.VMIN], raw[6][termios.VTIME] = 0, 0
    data = b""
    try:
        termios.tcsetattr(fd, termios.TCSANOW, raw)
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
    return data


def _parse(text: str) -> list:
    """`text` as prompt-toolkit's key presses, parsed as its terminal reader parses them."""
    keys: list = []
    parser = Vt100Parser(keys.append)
    parser.feed(text)
    parser.flush()
    return keys
