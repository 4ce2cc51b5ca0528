"""Runs a test script under Triton's interpreter (TRITON_INTERPRET=1: the kernels on the CPU, in
numpy) in a child process, for the tests of kernels that CI's CPU machine cannot compile. The
script gets the repository root as argv[1] and prints "ok" when its checks pass."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The interpreter holds a kernel's scalars as one-element arrays, and int() of one (a loop over a
# runtime bound: range(0, n, BLOCK)) raises under NumPy >= 2.4; .item() takes them on every NumPy.
PRELUDE = r"""
from triton.runtime import interpreter as _interp
_patch = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
_interp._patch_lang_tensor = _patch_lang_tensor
"""


def run_interpreted(script: str, timeout: int = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", PRELUDE + script, ROOT], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
