"""Text that reaches us as bytes of unknown quality: piped stdin lines and command-line arguments.

Contract: what leaves here is valid Unicode (no lone surrogates), so the tokenizer can always
encode it. Bytes that are not UTF-8 become U+FFFD, and the caller is told (one notice per line),
never a traceback. Python hands argv (and, outside UTF-8 locales, stdin) over with undecodable
bytes as lone surrogates (PEP 383); those are the same bytes and are replaced the same way.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

NOTICE = "is not valid UTF-8: the bad bytes were replaced by U+FFFD"


def clean(text: str) -> tuple[str, bool]:
    """(text with each lone surrogate, an undecodable byte included, replaced by U+FFFD, whether
    any was)."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text), True


def stdin_lines(stream, notice: Callable[[str], None]) -> Iterator[str]:
    """The lines of a piped text stream, decoded from its bytes where it has them (`.buffer`)."""
    raw_lines: Iterable = getattr(stream, "buffer", None) or stream
    for n, raw in enumerate(raw_lines, 1):
        if isinstance(raw, bytes):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                notice(f"input line {n} {NOTICE}")
                line = raw.decode("utf-8", "replace")
            yield line.replace("\r\n", "\n")
        else:
            line, replaced = clean(raw)
            if replaced:
                notice(f"input line {n} {NOTICE}")
            yield line
