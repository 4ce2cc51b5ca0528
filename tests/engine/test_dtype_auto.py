"""dtype: auto picks per checkpoint and says why; a half dtype whose range the model overflows is
detected by a calibration prefill (DecodeSession.finite_on)."""
import json
import shutil

import torch

import models
from engine.config import EngineConfig
from engine.device import resolve_dtype
from engine.session import DecodeSession

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_follows_the_checkpoint_on_cuda_and_float32_on_the_cpu(tiny_dirs, tmp_path, smollm2_path):
    auto = EngineConfig(dtype="auto")
    d = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    for key, name, want in (("torch_dtype", "bfloat16", torch.bfloat16), ("dtype", "float16", torch.float16),
                            ("torch_dtype", "float32", torch.float32)):
        cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
        cfg[key] = name
        (d / "config.json").write_text(json.dumps(cfg))
        dtype, why = resolve_dtype(auto, CUDA, models.native_dtype(str(d)))
        assert dtype == want and name in why
        assert resolve_dtype(auto, CPU, models.native_dtype(str(d)))[0] == torch.float32
    cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert resolve_dtype(auto, CUDA, models.native_dtype(str(d))) == (torch.bfloat16, "auto: the checkpoint names no dtype")
    dtype, why = resolve_dtype(auto, CUDA, models.native_dtype(smollm2_path))
    assert dtype == torch.float16 and "GGUF" in why
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), CUDA, models.native_dtype(smollm2_path)) == \
        (torch.bfloat16, "set by dtype")


def test_finite_on_detects_a_half_range_overflow_and_leaves_the_state_reset(tiny_dirs):
    lm = models.load(tiny_dirs["llama"][0], "cpu", torch.float16)
    s = DecodeSession(lm.model, max_context=64, device=CPU, dtype=torch.float16, cpu_kernel="off")
    ids = list(range(3, 30))
    assert s.finite_on(ids) and s.state.length == 0 and s.cached == []
    with torch.no_grad():  # activations past fp16's 65504
        mlp = lm.model.model.layers[0].mlp
        mlp.gate_up_proj.weight.mul_(10)
        mlp.down_proj.weight.fill_(6e4)
    assert not s.finite_on(ids) and s.state.length == 0
