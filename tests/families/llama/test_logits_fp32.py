"""Logits are fp32 on every path: the final norm's output and the LM head's sums are never
rounded to the model's half dtype (a bf16 rounding of a logit near 25 is 0.125, enough to flip
a near tie under greedy decoding). CPU here; tests/kernels/test_gemv.py and tests/engine/test_graphs.py check the CUDA kernels."""
import pytest
import torch
import torch.nn.functional as F

import models
from models.architectures.layers import head_logits


def _reference(model, stream):
    norm, w = model.model.norm, model.lm_head.weight
    nw = norm.offset + norm.weight.double()
    return F.rms_norm(stream.double(), (stream.shape[-1],), nw, norm.eps) @ w.double().t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_model_hands_the_sampler_fp32_logits(tiny_dirs, dtype):
    lm = models.load(tiny_dirs["qwen3"][0], "cpu", dtype)
    seen = []
    hook = lm.model.model.norm.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        from engine.reference import full_logits
        logits = full_logits(lm.model, list(range(3, 40)), torch.device("cpu"), dtype)
    finally:
        hook.remove()
    assert logits.dtype == torch.float32
    ref = _reference(lm.model, seen[-1]).float()
    assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5), float((logits - ref).abs().max())
    # not merely widened half values
    assert bool((logits.to(dtype).float() != logits).any())


def test_chunked_head_equals_one_matmul(tiny_dirs, monkeypatch):
    """The row chunks of a widened half head (any chunk size) give the whole matmul's values (up
    to the matmul's own blocking of the sums)."""
    import models.architectures.layers as layers
    lm = models.load(tiny_dirs["llama"][0], "cpu", torch.bfloat16)
    h = torch.randn(3, lm.model.config.hidden_size)
    whole = head_logits(lm.model.lm_head, h)
    monkeypatch.setattr(layers, "HEAD_CHUNK_ELEMENTS", lm.model.config.hidden_size * 7)  # 7 rows at a time
    ref = h.double() @ lm.model.lm_head.weight.double().t()
    assert torch.allclose(head_logits(lm.model.lm_head, h).double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(whole.double(), ref, rtol=1e-6, atol=1e-6)
