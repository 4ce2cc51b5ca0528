"""The `cpu_isa` setting: the C++ library built for the AVX2 level runs, and passes the same
equivalence tests, on whatever x86 CPU CI gets (an AVX-512 one included), so both kernel sets are
checked; a level the CPU lacks is refused with one line.

The library's ops register once per process, so the AVX2 build's tests run in a child pytest
(CHAT_CPU_ISA=avx2, which conftest.py hands to `select_isa`).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models.kernels.cpu import step

from tests.support.paths import ROOT

HAS_AVX2 = all(f in step._cpu_flags() for f in step.ISA_NEEDS["avx2"])


def test_each_level_has_its_own_library(monkeypatch):
    monkeypatch.setattr(step, "_loaded", None)
    paths = {}
    for isa in ("native", "avx2"):
        monkeypatch.setattr(step, "_isa", isa)
        paths[isa] = step.library_path()
    assert paths["native"] != paths["avx2"]
    monkeypatch.setattr(step, "_isa", "avx2")
    assert "-march=x86-64-v3" in step._flags() and "-march=native" not in step._flags()


def test_a_missing_level_is_refused(monkeypatch):
    monkeypatch.setattr(step, "_cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "f16c"})
    monkeypatch.setattr(step, "_loaded", None)
    with pytest.raises(step.Unavailable, match="cpu_isa avx512 needs AVX512F"):
        step.select_isa("avx512")
    step.select_isa("native")


def test_one_level_per_process(monkeypatch):
    monkeypatch.setattr(step, "_loaded", "/some/lib.so")
    monkeypatch.setattr(step, "_isa", "native")
    with pytest.raises(step.Unavailable, match="already loaded for cpu_isa native"):
        step.select_isa("avx2")


def test_cli_refuses_a_level_the_cpu_lacks(monkeypatch, capsys):
    from chat.__main__ import main
    monkeypatch.setattr(step, "_cpu_flags", lambda: {"sse2"})
    code = main(["--prompt", "hi", "--device", "cpu", "--cpu-isa", "avx2",
                 "--model", os.path.join(ROOT, "tests", "golden", "tiny-llama")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("chat: error: cpu_isa avx2 needs AVX2"), err


@pytest.mark.slow
@pytest.mark.skipif(not HAS_AVX2, reason="needs an AVX2 CPU")
def test_avx2_build_passes_the_kernel_tests():
    """The C++ step and block products built with `cpu_isa: avx2`, against the torch step and the
    dequantized products, as the native build is tested; its verify rows against its steps, bit
    for bit (speculative decoding)."""
    files = [f"tests/kernels/{name}.py" for name in ("test_cpu_step", "test_block_int8", "test_block_quant", "test_delta_cpu",
                                                     "test_hybrid_step", "test_rows16")]
    files.append("tests/engine/test_speculative.py")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500, env=dict(os.environ, CHAT_CPU_ISA="avx2"))
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]
    assert " passed" in tail and "failed" not in tail, tail
