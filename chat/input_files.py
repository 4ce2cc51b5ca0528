"""The text files a user names (config, scripts, recordings, schemas, grammars): read whole, but
only where the path is a regular file of bounded size, so a FIFO never blocks the process and
/dev/zero never fills its memory. `read_text(path)` returns the text or raises InputFileError,
whose message is one line naming the path and what is wrong with it.
"""
from __future__ import annotations

import os
import stat

MAX_BYTES = 64 << 20  # (no config, transcript, schema or grammar of ours comes near it)


class InputFileError(ValueError):
    """One line: the path and the problem (callers raise it again as their own error type)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def read_text(path: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes` (/dev/null reads as empty: the usual
    way to say "no file")."""
    if os.path.realpath(path) == os.devnull:
        return ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # (a FIFO's open never blocks)
    except OSError as e:
        raise InputFileError(f"{path}: cannot read: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{path}: {_kind(info.st_mode)}, not a file; name a regular file")
        if info.st_size > max_bytes:
            raise InputFileError(f"{path}: {info.st_size} bytes, more than the {max_bytes >> 20} MiB a file "
                                 "may have here")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputFileError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:  # (it grew while being read)
        raise InputFileError(f"{path}: more than the {max_bytes >> 20} MiB a file may have here")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not UTF-8 text") from None
