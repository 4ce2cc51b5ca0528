"""`chat` in a child process for tests: state and config folders of the test's own, the
repository as the working directory, stdin given or closed."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT


def run_chat(*args, stdin: str | None = None, tmp_path=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    return subprocess.run([sys.executable, "-m", "chat", *map(str, args)], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, env=env,
                          stdin=None if stdin is not None else subprocess.DEVNULL)
