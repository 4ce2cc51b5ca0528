"""bench/llama_cuda.py's host side: the sources it packs for the GPU machine's llama.cpp build, and
the parts a build travels back in (the benchmark itself runs on the device)."""
from __future__ import annotations

import io
import os
import sys
import tarfile

import pytest

from tests.support.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import llama_cuda  # noqa: E402
from tests.support.llama_cpp_tree import VERSION  # noqa: E402

PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# a template instance's path is longer than a plain tar header holds (a pax record carries it)
LONG = "ggml/src/ggml-cuda/template-instances/fattn-mma-f16-instance-ncols1_1-ncols2_16-a-name-past-a-hundred.cu"


def _sdist(path, names) -> None:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            data = name.encode()
            info = tarfile.TarInfo(PREFIX + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/pyproject.toml")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))


@pytest.fixture
def here(tmp_path, monkeypatch):
    d = tmp_path / ".llama-cuda"
    monkeypatch.setattr(llama_cuda, "DIR", str(d))
    monkeypatch.setattr(llama_cuda, "SRC", str(d / "src.tar.gz"))
    monkeypatch.setattr(llama_cuda, "BUILD", str(d / "build"))
    return d


def test_pack_keeps_what_the_cuda_build_reads_under_their_own_names(tmp_path, here):
    kept = ["CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/ggml-cpu/ggml-cpu.c", "ggml/src/ggml-cuda/mmq.cu", LONG,
            "tools/llama-bench/llama-bench.cpp", "vendor/nlohmann/json.hpp", "convert_hf_to_gguf.py",
            "gguf-py/gguf/__init__.py", "src/llama.cpp", "common/common.cpp"]
    left = ["ggml/src/ggml-sycl/ggml-sycl.cpp", "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/ui/index.html",
            "docs/build.md", "models/ggml-vocab-llama.gguf", "tests/test-backend-ops.cpp"]
    _sdist(tmp_path / "sdist.tar.gz", kept + left)
    llama_cuda.pack(str(tmp_path / "sdist.tar.gz"))
    with tarfile.open(here / "src.tar.gz") as tar:
        names = {m.name: tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    assert sorted(names) == sorted(kept)
    assert all(names[n] == n for n in kept)  # each file's own bytes


def test_build_parts_unpack_into_a_runnable_bin_folder(tmp_path, here, monkeypatch):
    built = tmp_path / "bin"
    built.mkdir()
    quantize = os.urandom(5000)  # (what xz cannot shrink: several parts)
    for name, data in (("llama-bench", b"#!/bin/sh\n"), ("llama-quantize", quantize), ("libggml.so.0.25.3", os.urandom(9000)),
                       ("llama-cli", b"not needed")):
        (built / name).write_bytes(data)
    (built / "llama-bench").chmod(0o755)
    os.symlink("libggml.so.0.25.3", built / "libggml.so.0")
    monkeypatch.setattr(llama_cuda, "PART_BYTES", 1000)
    llama_cuda._write_parts(str(built), str(here))
    parts = sorted(p for p in os.listdir(here) if p.startswith("llama-cuda-bin.tar.xz."))
    assert len(parts) >= 2 and all(os.path.getsize(here / p) <= 1000 for p in parts)
    bin_dir = llama_cuda._bin_dir(None)
    assert sorted(os.listdir(bin_dir)) == ["libggml.so.0", "libggml.so.0.25.3", "llama-bench", "llama-quantize"]
    assert os.readlink(os.path.join(bin_dir, "libggml.so.0")) == "libggml.so.0.25.3"
    assert open(os.path.join(bin_dir, "llama-quantize"), "rb").read() == quantize
    assert os.access(os.path.join(bin_dir, "llama-bench"), os.X_OK)


def test_no_build_and_no_parts_is_one_line(here):
    with pytest.raises(SystemExit, match="no llama.cpp build"):
        llama_cuda._bin_dir(None)
