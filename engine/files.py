"""Files written atomically: the content goes to a temporary file beside the target, is fsynced,
then renamed over it, so a reader (or a process killed at any moment) sees the old file or the
new one, never a torn one; a failure leaves no temporary behind."""
from __future__ import annotations

import os
import tempfile
from typing import Callable


def write_atomic(path: str, fill: Callable[[str], None], suffix: str = ".tmp") -> None:
    """`fill(tmp)` writes the content to the temporary path; then it is synced and renamed to `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        fill(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
