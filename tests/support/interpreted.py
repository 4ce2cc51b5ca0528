"""Runs a test script under Triton's interpreter (TRITON_INTERPRET=1: the kernels on the CPU, in
numpy) in a child process, for the tests of kernels that CI's CPU machine cannot compile. The
script gets the repository root as argv[1] and prints "ok" when its checks pass."""
import os
import platform
import subprocess
import sys

from tests.support.paths import ROOT


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


def run_interpreted(script: str, timeout: int = 600, portable_blas: bool = False) -> None:
    """portable_blas: numpy's OpenBLAS on its generic x86 kernels (the interpreter's tl.dot is
    np.matmul). Its AVX2 (Haswell) GEMM kernels round an output element differently by where it
    falls in their tiles, so the same rows of q and k in blocks cut at other rows can differ by an
    ulp there; on the GPU the kernel's rows do not depend on their neighbours (tests/kernels/test_prefill_attention.py
    checks those bits). With the generic kernels the interpreter checks the kernel, not OpenBLAS."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if portable_blas and platform.machine().lower() in ("x86_64", "amd64"):
        env["OPENBLAS_CORETYPE"] = "Prescott"
    r = subprocess.run([sys.executable, "-c", PRELUDE + script, ROOT], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
