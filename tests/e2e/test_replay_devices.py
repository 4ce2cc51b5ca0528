"""Replays across devices (CUDA): the counter-based sampler draws the same token from the same logits
on the GPU as on the CPU, and recordings made on one device replay on the other, teacher-forced
within a tolerance, with no divergence.

The golden scripts are recorded here on each device (so the embedded model's fingerprint is the
local file's), except those pinned to sampler version 1, whose torch.Generator streams differ by
device by design; the committed CPU recordings of the tiny models replay on CUDA as they are.
"""
import glob
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from chat import transcript as tr
from engine.config import SamplingConfig
from engine.sampling import Sampler

from tests.support.paths import ROOT

pytestmark = pytest.mark.gpu

GOLDEN = os.path.join(ROOT, "tests", "golden")
DEVICES = ("cpu", "cuda")


def chat(*args, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "chat", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ, CHAT_HISTORY_FILE=os.devnull))
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def smollm2_available() -> bool:
    import models
    try:
        models.resolve("smollm2")
        return True
    except Exception:  # the embedded model's package is not installed on this machine
        return False


def scripts() -> list[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(GOLDEN, "scripts", "*.yaml"))):
        t = tr.load(path)
        if t.sampler_to_run == 1 or (t.model.get("source") == "smollm2" and not smollm2_available()):
            continue
        out.append(path)
    return out


def device_bound(rec) -> bool:
    """Sampled turns drawn by sampler version 1 (a device's torch.Generator stream)."""
    return rec.sampler_to_replay == 1 and any(e.result["sampling"]["temperature"] > 0
                                              for e in rec.events if e.result is not None)


def record_all(directory, *flags) -> None:
    os.makedirs(directory, exist_ok=True)
    for script in scripts():
        target = os.path.join(directory, os.path.basename(script))
        proc = chat("run", os.path.relpath(script, ROOT), "-o", target, *flags)
        assert proc.returncode == 0, (script, proc.stderr)


def assert_suite_passes(proc, junit) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 diverged, 0 invalid" in proc.stdout, proc.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and int(suite.get("tests")) >= 4


CONFIGS = [SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3),
           SamplingConfig(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=3),
           SamplingConfig(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, seed=3),
           SamplingConfig(temperature=0.7, top_k=20, top_p=1.0, min_p=0.1, repetition_penalty=1.3,
                          frequency_penalty=0.2, presence_penalty=0.1, seed=3),
           SamplingConfig(temperature=0, repetition_penalty=1.2, seed=3),
           SamplingConfig(temperature=0, seed=3)]


@pytest.mark.parametrize("vocab", [300, 151936])
@pytest.mark.parametrize("cfg", CONFIGS,
                         ids=lambda c: f"t{c.temperature}k{c.top_k}p{c.top_p}m{c.min_p}r{c.repetition_penalty}")
def test_the_same_logits_give_the_same_tokens_on_cuda_and_cpu(cfg, vocab):
    g = torch.Generator().manual_seed(vocab)
    steps = [torch.randn(vocab, generator=g) * 4 for _ in range(64)]
    steps[0][[5, 9]] = steps[0].max() + 1  # a tie at the top: greedy takes the lower id on both
    got = {}
    for device in DEVICES:
        s = Sampler(cfg, [1, 2, 3, 2], 1234, turn=3)
        out = []
        for logits in steps:
            x = logits.to(device)
            t = s(x)
            out.append((t, s.log_probs(x, [t, 7])))
            s.accept(t)
        got[device] = out
    assert got[DEVICES[0]] == got[DEVICES[1]]
    if cfg.greedy and cfg.repetition_penalty == 1.0:
        assert got[DEVICES[1]][0][0] == 5


def test_a_cuda_bf16_recording_replays_on_the_cpu_in_fp32(tmp_path):
    record_all(tmp_path / "cuda", "--device", "cuda", "--dtype", "bfloat16")
    junit = tmp_path / "cuda-on-cpu.xml"
    proc = chat("replay", tmp_path / "cuda", "--device", "cpu", "--dtype", "float32", "--tolerance", "1.0",
                "--runs", "1", "--junit", junit)
    assert_suite_passes(proc, junit)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_recordings_replay_on_cuda(tmp_path, dtype):
    record_all(tmp_path / "cpu", "--device", "cpu", "--dtype", "float32")
    committed = [p for p in sorted(glob.glob(os.path.join(GOLDEN, "recordings", "*.yaml")))
                 if "smollm2" not in os.path.basename(p) and not device_bound(tr.load(p))]
    junit = tmp_path / f"cpu-on-cuda-{dtype}.xml"
    proc = chat("replay", tmp_path / "cpu", *committed, "--device", "cuda", "--dtype", dtype, "--tolerance", "1.0",
                "--runs", "1", "--junit", junit)
    assert_suite_passes(proc, junit)
