"""OLMo-Hybrid's variants as config data: NoPE attention (no rope_theta), beta = sigmoid(b)
(linear_allow_neg_eigval off) and more value heads than key heads (grouped), each against
transformers. transformers 5 saves the published
layout (per-part q/k/v convs, attention_layer_norm), so every test loads that layout.

The default variant's parity, splits, resets and checkpoints are in test_hybrid.py (KINDS),
test_state_reset.py and test_checkpoints.py.
"""
import os

import pytest
import torch

import models
from engine.session import DecodeSession
from tests.support.hybrid import delta_layer_and_states
from models import kernels


def parity(hf, path, n=70):
    ids = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    s = DecodeSession(models.load(path).model, max_context=256, device=torch.device("cpu"), dtype=torch.float32)
    ours = s.prefill(ids, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ids.append(int(ours[-1].argmax()))
    step = s.step(ids[-1])[-1]
    with torch.no_grad():
        ref_step = hf(torch.tensor([ids])).logits[0, -1]
    return max(float((ours - ref).abs().max()), float((step - ref_step).abs().max()))


@pytest.mark.parametrize("over", [dict(rope_parameters={"rope_type": "default"}),
                                  dict(linear_allow_neg_eigval=False),
                                  dict(linear_num_value_heads=4)], ids=["nope", "beta-sigmoid", "grouped-value-heads"])
def test_variant_matches_transformers(tmp_path, over):
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("olmo_hybrid", **over)
    if "rope_parameters" in over:
        assert hf.model.rotary_emb is None
    assert parity(hf, write_checkpoint("olmo_hybrid", str(tmp_path), model=hf)) <= 1e-4


def test_value_heads_not_a_multiple_of_key_heads_are_refused():
    from models.architectures.olmo_hybrid import config_from_hf
    c = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
             linear_num_key_heads=2, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_num_value_heads 3"):
        config_from_hf(c)


def delta_kernel_vs_torch(device, dtype, monkeypatch):
    from models.kernels.cuda import delta as cuda_delta
    layer, states = delta_layer_and_states(device, dtype)
    xs = torch.randn(5, 1, 256, device=device, dtype=dtype)
    st_k, st_t = ({k: v.clone() for k, v in states.items()} for _ in range(2))
    with torch.inference_mode():  # (x.clone(): each step starts with a torch op, as test_delta_split's _steps says)
        fused = [layer.out_proj(cuda_delta.decode(layer.project_in(x.clone()), st_k["conv"], layer.conv1d.weight,
                                                  st_k["recurrent"], layer.neg_A, layer.dt_bias32, layer.norm.weight,
                                                  layer.norm.eps, 2, 2, 64, 128, beta_scale=layer.beta_scale))
                 for x in xs]
        kernels.switch(triton=False)
        plain = [layer(x, st_t) for x in xs]
    return fused, plain, st_k, st_t


@pytest.mark.gpu
def test_delta_decode_kernel_takes_olmos_beta_scale(monkeypatch):
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    fused, plain, st_k, st_t = delta_kernel_vs_torch(torch.device("cuda"), torch.bfloat16, monkeypatch)
    for a, b in zip(fused, plain):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=3e-2), float((a - b).abs().max())
    assert torch.allclose(st_k["recurrent"], st_t["recurrent"], atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's interpreter)")
def test_delta_decode_kernel_takes_olmos_beta_scale_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    fused, plain, st_k, st_t = delta_kernel_vs_torch(torch.device("cpu"), torch.float32, monkeypatch)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() <= 1e-4
    assert (st_k["recurrent"] - st_t["recurrent"]).abs().max() <= 1e-5 and torch.equal(st_k["conv"], st_t["conv"])


def test_attention_decode_branch_writes_the_cache_the_kernel_reads(tmp_path, monkeypatch):
    """The one-token branch that hands the split-K kernel its query (CUDA only) on the CPU, with a
    torch stand-in of the kernel's contract (attend slots 0..positions[0]): decode steps still
    match transformers, so the branch (layers.rope_and_attend, nemotron_h's too) writes k and v
    where the kernel reads them."""
    from models.architectures.layers import attend_cached
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("olmo_hybrid")
    path = write_checkpoint("olmo_hybrid", str(tmp_path), model=hf)
    calls = []

    def kernel_contract(q, k_cache, v_cache, positions):
        calls.append(1)
        return attend_cached(q, k_cache, v_cache, int(positions[0]) + 1, None)

    from models.architectures import olmo_hybrid
    from models.ops import attention as attention_ops
    monkeypatch.setattr(attention_ops, "decode_serves", lambda x, d: x.shape[0] == 1)
    monkeypatch.setattr(attention_ops, "decode", kernel_contract)
    # (the torch step's branch: the C++ step, which now decodes this family on the CPU, held back)
    monkeypatch.setattr(olmo_hybrid.OlmoHybridForCausalLM, "offers_cpu_step", lambda self: False)
    assert parity(hf, path, n=33) <= 1e-4 and calls
