"""models/formats/hf_quant.py: HF quantized checkpoints (FP8 with 128 x 128 block scales, AWQ,
GPTQ sym/asym, v1/v2) read from config.json's quantization_config, on tiny checkpoints written by
tests/support/tiny_hf_quant.py (encoders written from the formats' descriptions).

On the CPU the loader widens them: the model then computes exactly what the same model with the
dequantized weights written as fp32 computes (the same weights bit for bit, the same ops: logits
equal to fp32 rounding of nothing, compared with a 1e-6 relative margin). The CUDA kernels on
these formats: tests/kernels/test_quant_kernels.py and tests/formats/test_quant.py.
"""
import json
import os

import pytest
import torch

import models
from engine.reference import full_logits
from models.formats import hf_quant
from models.quant import hf_layers
from models.formats.checkpoints import CheckpointError
from tests.support.tiny_hf_quant import CONFIGS, write_quantized

CASES = [("llama", "fp8"), ("qwen2", "awq"), ("llama", "gptq"), ("qwen2", "gptq_asym"), ("llama", "gptq_v2"),
         ("qwen3_5", "fp8"), ("qwen3_5", "awq")]


@pytest.mark.parametrize("kind,method", CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_cpu_load_is_the_dequantized_checkpoint(tmp_path, kind, method):
    qdir, rdir = write_quantized(kind, str(tmp_path), method)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    ref = load_file(os.path.join(rdir, "model.safetensors"))
    config = json.load(open(os.path.join(qdir, "config.json")))
    hf_quant.collect(tensors, config)
    quantized = {k: t for k, t in tensors.items() if isinstance(t, hf_quant.QuantizedTensor)}
    assert len(quantized) >= 6
    for k, t in quantized.items():  # the oracle: the writer's values, bit for bit
        assert torch.equal(t.dequantize().view(torch.int32), ref[k].float().view(torch.int32)), k
    a, b = models.load(qdir), models.load(rdir)
    ids = list(range(3, 50))
    la, lb = full_logits(a.model, ids), full_logits(b.model, ids)
    assert float((la - lb).abs().max()) <= 1e-6 * float(lb.abs().max())


def test_repacked_int4_is_the_checkpoints_weights(tmp_path):
    """AWQ/GPTQ repacked for the kernels (GroupInt4Linear): its torch form dequantizes to the
    same weights as the checkpoint's layout."""
    qdir, rdir = write_quantized("llama", str(tmp_path), "awq")
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    hf_quant.collect(tensors, json.load(open(os.path.join(qdir, "config.json"))))
    t = tensors["model.layers.0.mlp.down_proj.weight"]
    lin = hf_layers.module(t, torch.device("cpu"))
    assert torch.equal(lin.dequantize(), t.dequantize())
    x = torch.randn(3, lin.in_features)
    assert torch.allclose(lin(x), x @ t.dequantize().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "only e4m3"),
])
def test_unsupported_quantization_is_a_one_line_error(tmp_path, qc, needle):
    qdir, _ = write_quantized("llama", str(tmp_path), "fp8")
    config = json.load(open(os.path.join(qdir, "config.json")))
    config["quantization_config"] = qc
    json.dump(config, open(os.path.join(qdir, "config.json"), "w"))
    with pytest.raises(CheckpointError) as e:
        models.load(qdir)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_gptq_act_order_is_refused(tmp_path):
    qdir, _ = write_quantized("llama", str(tmp_path), "gptq")
    from safetensors.torch import load_file, save_file
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    key = "model.layers.0.mlp.down_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="act-order"):
        models.load(qdir)
    assert set(CONFIGS) == {"fp8", "awq", "gptq", "gptq_asym", "gptq_v2"}


def test_weight_format_names_the_formats_and_bytes(tmp_path):
    """What /show and the load line print for a model holding these linears (as CUDA holds them):
    the format names and their bytes, no GGUF prefix."""
    from models.quant import layers as quant
    from models.loader import LoadedModel
    qdir, _ = write_quantized("llama", str(tmp_path), "fp8")
    lm = models.load(qdir)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    hf_quant.collect(tensors, json.load(open(os.path.join(qdir, "config.json"))))
    lm.model.model.layers[0].mlp.down_proj = hf_layers.module(tensors["model.layers.0.mlp.down_proj.weight"], torch.device("cpu"))
    fmt = quant.weight_formats(lm.model)
    assert fmt["FP8"] == 128 * 256 + 4 * 1 * 2  # e4m3 bytes and one fp32 scale per 128 x 128 block
    text = LoadedModel.weight_format.fget(lm)
    assert text.startswith("float32 ") and " + FP8 0.0 MB" in text and "GGUF" not in text


def test_a_normed_row_the_kernels_do_not_fit_takes_the_torch_form(monkeypatch):
    """A NormedRow (a deferred RMSNorm, kernels.cuda.linear) reaching a quantized linear whose
    format or row length the CUDA kernels do not take: the torch form materializes it and
    computes; the kernels are never called (they would read weights they cannot decode)."""
    from models.kernels.cuda import qlinear
    from models.plan import bind_forms
    g = torch.Generator().manual_seed(0)
    n, k, group = 6, 256, 128
    lin = hf_layers.GroupInt4Linear("AWQ", torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                                   (torch.rand(n, k // group, generator=g) * 0.02).half(),
                                   torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g), group)
    called = []

    def gemv(*a, **kw):
        called.append(1)
        raise AssertionError("the kernels were handed a weight they do not fit")

    class Row:  # a NormedRow's interface: not a tensor, materialized on demand
        def __init__(self, h):
            self.h, self.shape, self.dtype = h, h.shape, h.dtype

        def materialize(self):
            return self.h

    bind_forms(lin)  # (as a CUDA plan binds them), the kernels taking no format but serving any row
    monkeypatch.setattr(qlinear, "fits", lambda fmt, k, group=None: False)
    monkeypatch.setattr(qlinear, "usable", lambda x: True)
    monkeypatch.setattr(qlinear, "gemv", gemv)
    h = torch.randn(1, k, generator=g)
    assert not lin.cuda_serves(Row(h))
    assert torch.allclose(lin(Row(h)), torch.nn.functional.linear(h, lin.dequantize()), atol=1e-5) and not called
