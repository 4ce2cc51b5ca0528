"""Keys typed while prompt-toolkit still held the terminal, taken when a reply starts.

Contract: `take_pending(fd, input)` reads what waits in terminal `fd`'s input queue (without
blocking, leaving the terminal's settings as they were), gives prompt-toolkit `input` every key
of it but Ctrl-C as typeahead (the next prompt starts with them, as it would have read them from
the terminal), and says whether a Ctrl-C was among them. Not a terminal, or nothing waiting:
nothing happens.

Why: Enter ends the prompt while the terminal is still in raw mode; a Ctrl-C pressed in the next
few tens of milliseconds (before prompt-toolkit gives the terminal back) reaches the queue as a
byte, not as SIGINT, so the reply it was meant for ran to its end and the byte ended the next
prompt instead (tests/test_e2e_pty.py, 20 Ctrl-Cs after 0.05-0.6 s: the one after 82 ms was lost).
"""
from __future__ import annotations

import os
import select

CTRL_C = b"\x03"


def take_pending(fd: int, input=None) -> bool:
    """Whether a Ctrl-C waited in `fd`'s queue; the other keys go to `input`'s typeahead."""
    try:
        import termios
    except ImportError:  # (not POSIX: no such race to mend)
        return False
    try:
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # not a terminal
        return False
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
        termios.tcsetattr(fd, termios.TCSANOW, saved)  # (TCSANOW: a flush would drop typed keys)
    if not data:
        return False
    rest = data.replace(CTRL_C, b"")
    if rest and input is not None:
        _store(input, rest.decode("utf-8", "replace"))
    return CTRL_C in data


def _store(input, text: str) -> None:
    """`text` after `input`'s typeahead (get_typeahead hands it over and clears it), parsed as
    prompt-toolkit's reader parses keys."""
    from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
    from prompt_toolkit.input.vt100_parser import Vt100Parser
    keys: list = []
    parser = Vt100Parser(keys.append)
    parser.feed(text)
    parser.flush()
    store_typeahead(input, get_typeahead(input) + keys)
