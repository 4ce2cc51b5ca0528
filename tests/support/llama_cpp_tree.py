"""llama.cpp's source tree as a test-time reference: its HF→GGUF converter and its vocab-only
GGUF files with tokenizer test vectors. Never a dependency of the product.

The tree ships inside llama-cpp-python's sdist (pinned, 0.3.36). `tree()` returns the path of
the extracted `vendor/llama.cpp`, fetching the sdist from the package registry with pip once and
keeping only what the tests read (the converter, its `conversion` package and `gguf-py`, and
`models/ggml-vocab-*`) under $XDG_CACHE_HOME/chat (default ~/.cache/chat). Set
CHAT_LLAMA_CPP_TREE to an extracted tree to use that instead. Where neither works (no registry),
`tree()` skips the calling test with the reason.

`convert(hf_dir, out_path, outtype)` runs the converter in a subprocess with its own gguf-py
first on the path (the converter expects that version, not the installed `gguf`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile

import pytest

VERSION = "0.3.36"
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "chat", f"llama.cpp-{VERSION}")


def _extract(sdist: str, dest: str) -> None:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".llama-cpp-")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(_PREFIX) and m.name[len(_PREFIX):].startswith(_KEEP)
                   and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(_PREFIX):]
        tar.extractall(tmp, members=members, filter="data")
    os.replace(tmp, dest)  # atomic: a half-extracted tree is never seen


def tree() -> str:
    given = os.environ.get("CHAT_LLAMA_CPP_TREE")
    if given:
        return given
    dest = _cache_dir()
    if os.path.exists(os.path.join(dest, "convert_hf_to_gguf.py")):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                            "--no-deps", "-d", tmp, f"llama-cpp-python=={VERSION}"],
                           capture_output=True, text=True)
        sdists = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        if r.returncode != 0 or not sdists:
            pytest.skip(f"llama-cpp-python {VERSION}'s sdist is not reachable: {r.stderr.strip()[-200:]}")
        if not os.path.exists(dest):
            _extract(os.path.join(tmp, sdists[0]), dest)
    return dest


# Runs the converter with its pre-tokenizer detection answered by name: tiny test tokenizers are
# not among the hashes it knows (the tensor layouts are what such conversions are for).
_CONVERT_WITH_PRE = """
import runpy, sys
import conversion.base
pre = sys.argv.pop()
sys.argv = sys.argv[1:]  # [converter, its arguments...]
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf_dir: str, out_path: str, outtype: str = "f32", pre: str | None = None,
            options: tuple[str, ...] = ()) -> str:
    """llama.cpp's convert_hf_to_gguf.py on `hf_dir` → `out_path` (outtype f32, f16, bf16, q8_0).
    pre: the `tokenizer.ggml.pre` name to write instead of detecting it from the tokenizer;
    options: further converter flags (`--no-mtp` for Qwen3-Next/3.5 checkpoints without MTP layers)."""
    root = tree()
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "gguf-py") + os.pathsep + root,
               NO_LOCAL_GGUF="")
    args = [os.path.join(root, "convert_hf_to_gguf.py"), hf_dir, "--outfile", out_path, "--outtype", outtype, *options]
    cmd = [sys.executable] + args if pre is None else [sys.executable, "-c", _CONVERT_WITH_PRE] + args + [pre]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stderr[-3000:]}")
    return out_path


def vocab_files(name: str) -> tuple[str, str, str]:
    """(ggml-vocab-NAME.gguf, its .inp, its .out) in the tree."""
    base = os.path.join(tree(), "models", f"ggml-vocab-{name}.gguf")
    return base, base + ".inp", base + ".out"
