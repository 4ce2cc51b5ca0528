"""The GPU path on the real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF): it starts at the
default settings, answers as the fp32 reference does, and a conversation, a recording and its
replays are deterministic with and without the CUDA graph.

Runs where CUDA exists and CHAT_TEST_GGUF names the model file (the device machine gets the
file in two halves: ../shared/tools/gguf-halves). The fp32 reference is our dequantized fp32 CPU
path, which tests/families/llama/test_parity_dense.py and tests/formats/test_gguf.py hold token-exact with transformers.
"""
import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.gpu

GGUF = os.environ.get("CHAT_TEST_GGUF", "")
if not GGUF:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="CHAT_TEST_GGUF names no model file")]

CAPITAL = "What is the capital of France?"


def chat(*args, stdin: str | None = None, timeout=600):
    env = dict(os.environ, CHAT_HISTORY_FILE=os.devnull)
    proc = subprocess.run([sys.executable, "-m", "chat", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def reference_reply():
    proc = chat("--model", GGUF, "--device", "cpu", "--dtype", "float32", "--quantized", "off",
                "--temperature", "0", "--max-new-tokens", "48", "--prompt", CAPITAL)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_capital_question_on_cuda_at_defaults_equals_the_fp32_reference(reference_reply):
    proc = chat("--model", GGUF, "--device", "cuda", "--temperature", "0", "--max-new-tokens", "48", "--prompt", CAPITAL)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in reference_reply
    assert proc.stdout == reference_reply, (proc.stdout, reference_reply)


@pytest.mark.parametrize("graph", ["auto", "off"])
def test_piped_conversation_with_undo_and_retry_is_byte_identical(graph):
    script = ("Hi! Who are you?\nName three colours.\n/undo\nName three animals.\n/retry\n"
              "And one more?\n/exit\n")
    runs = [chat("--model", GGUF, "--device", "cuda", "--temperature", "0", "--max-new-tokens", "40",
                 "--cuda-graph", graph, stdin=script) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.count("\n") >= 4


@pytest.mark.parametrize("graph", ["auto", "off"])
def test_run_then_replay_three_times(tmp_path, graph):
    script = tmp_path / "s.yaml"
    script.write_text(
        "format: chat-transcript\nversion: 1\n"
        f"model: {{source: {GGUF}}}\nengine: {{device: cuda, cuda_graph: {graph}}}\n"
        "sampling: {temperature: 0.7, seed: 11, max_new_tokens: 40}\n"
        "events:\n  - user: \"What is the capital of France?\"\n  - user: \"And of Germany?\"\n"
        "  - command: /retry\n  - user: \"Thanks!\"\n", encoding="utf-8")
    rec = tmp_path / "r.yaml"
    proc = chat("run", str(script), "-o", str(rec))
    assert proc.returncode == 0, proc.stderr
    proc = chat("replay", str(rec), "--runs", "3")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "replay identical" in proc.stdout
