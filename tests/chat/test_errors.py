"""Bad input: one clear line on stderr, exit code 2, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest


def run_chat(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "chat", *args], capture_output=True, text=True,
                          timeout=120, env=e, stdin=subprocess.DEVNULL)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chat: error:"), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_path():
    assert_clean_error(run_chat("--model", "/no/such/model", "--prompt", "hi"), "/no/such/model", "no such file")


def test_unknown_architecture(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"][0], tmp_path / "m")
    cfg = json.load(open(d / "config.json"))
    cfg["model_type"] = "mamba"
    json.dump(cfg, open(d / "config.json", "w"))
    assert_clean_error(run_chat("--model", str(d), "--prompt", "hi"), "'mamba'", "not supported")


def test_truncated_safetensors(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"][0], tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_clean_error(run_chat("--model", str(d), "--prompt", "hi"), "model.safetensors", "corrupt")


def test_garbage_safetensors_header(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"][0], tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_clean_error(run_chat("--model", str(d), "--prompt", "hi"), "corrupt")


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0.3, 0.9999])
def test_truncated_gguf(smollm2_path, tmp_path, keep):
    data = open(smollm2_path, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    assert_clean_error(run_chat("--model", str(bad), "--prompt", "hi"), "bad.gguf")


@pytest.mark.slow
def test_not_a_model_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert_clean_error(run_chat("--model", str(f), "--prompt", "hi"), "not a GGUF file")


@pytest.mark.slow
def test_malformed_config_yaml(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("sampling:\n  temperature: [unclosed\n")
    assert_clean_error(run_chat("--config", str(f), "--prompt", "hi"), "config.yaml", "malformed YAML")


@pytest.mark.slow
def test_config_unknown_key_and_bad_value(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("sampling:\n  temprature: 0.5\n")
    assert_clean_error(run_chat("--config", str(f), "--prompt", "hi"), "temprature", "known keys")
    f.write_text("engine:\n  cuda_graph: maybe\n")
    assert_clean_error(run_chat("--config", str(f), "--prompt", "hi"), "cuda_graph", "auto | on | off")


@pytest.mark.slow
def test_prompt_longer_than_context(tiny_dirs):
    proc = run_chat("--model", tiny_dirs["llama"][0], "--max-context", "16", "--prompt", "word " * 50)
    assert_clean_error(proc, "context")


@pytest.mark.slow
def test_unknown_flag_and_cpu_only_switches():
    assert_clean_error(run_chat("--nonsense", "1"), "unrecognized arguments", "--help")
    assert_clean_error(run_chat("--compile", "maybe", "--prompt", "hi"), "compile")
    import torch
    if not torch.cuda.is_available():
        assert_clean_error(run_chat("--device", "cuda", "--prompt", "hi"), "no CUDA device")
