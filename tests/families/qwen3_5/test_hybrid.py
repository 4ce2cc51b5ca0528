"""Hybrid LinearAttention models: parity with transformers, the gated delta forms, and state resets."""
import json
import os

import pytest
import torch

import models
from engine.config import SamplingConfig
from models.architectures import gated_delta, qwen3_5
from tests.support.parity import (LENGTHS, TOL, check_decode, check_prefill, check_prefill_forms, check_second_turn,
                    check_split_prefill, hf_logits, load_with_hf, rand_ids, session)

KINDS = ["qwen3_5", "qwen3_next", "lfm2", "olmo_hybrid", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return load_with_hf(tmp_path_factory, KINDS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logits_match_transformers(hybrids, kind, length):
    check_prefill(*hybrids[kind], length)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_match_transformers(hybrids, kind):
    check_decode(*hybrids[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_split_prefill_equals_one_prefill(hybrids, kind):
    check_split_prefill(hybrids[kind][0])


@pytest.mark.parametrize("T", [1, 2, 31, 63, 64, 65, 129])
def test_chunked_equals_naive_from_nonzero_state(T):
    g = torch.Generator().manual_seed(T)
    H, dk, dv = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g)
    s_naive, s_chunk = s0.clone(), s0.clone()
    o_naive = gated_delta.recurrent_naive(q, k, v, decay, beta, s_naive)
    o_chunk = gated_delta.chunked(q, k, v, decay, beta, s_chunk, chunk=16)
    assert (o_naive - o_chunk).abs().max() <= 1e-5 and (s_naive - s_chunk).abs().max() <= 1e-5
    if T == 1:
        s_step = s0.clone()
        assert (gated_delta.step(q, k, v, decay, beta, s_step) - o_naive).abs().max() <= 1e-6
        assert (s_step - s_naive).abs().max() <= 1e-6


def test_chunked_takes_unrepeated_key_heads():
    """chunked with Hk key heads (value head h reading key head h // (H / Hk)) equals chunked on
    the key heads repeated to H (the layer passes them unrepeated: no copy on CUDA)."""
    q, k, v, g, beta, s0 = gated_delta.example_inputs(70, 4, 16, 8, torch.device("cpu"))
    qk, kk = q[:, ::2], k[:, ::2]
    s_rep, s_un = s0.clone(), s0.clone()
    rep = gated_delta.chunked(qk.repeat_interleave(2, 1), kk.repeat_interleave(2, 1), v, g, beta, s_rep, chunk=16)
    assert torch.equal(gated_delta.chunked(qk, kk, v, g, beta, s_un, chunk=16), rep) and torch.equal(s_un, s_rep)


PREPARE_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from models.architectures import gated_delta
from models.kernels.cuda import scan
for T, H, Hk, dk, dv, C in [(5, 4, 2, 32, 16, 16), (64, 3, 3, 16, 32, 16), (130, 4, 1, 16, 16, 32)]:
    q, k, v, g, beta, _ = gated_delta.example_inputs(T, H, dk, dv, torch.device("cpu"), seed=T)
    big = torch.randn(T, H, dv + 8)
    big[..., :dv] = v
    v = big[..., :dv]  # a slice of a wider projection, as the layer's v is
    q, k = q[:, :Hk], k[:, :Hk]
    if T == 130:  # v as a torch conv's transposed output leaves it: its feature stride is T
        v = v.reshape(T, H * dv).t().contiguous().t().reshape(T, H, dv)
        assert v.stride(-1) == T
    want = gated_delta.chunk_terms(q, k, v, g, beta, C)
    got = scan.prepare(q, k, v, g, beta, C)
    for a, b in zip(got, want):
        assert a.shape == b.shape, (a.shape, b.shape)
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max())), float((a - b).abs().max())
print("ok")
"""


RAW_INTERPRETED = r"""
import sys, torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from models.architectures import gated_delta, qwen3_5
from models.kernels.cuda import scan
for T, H, Hk, dk, dv, C, beta_scale in [(5, 4, 2, 32, 16, 16, 1.0), (70, 2, 2, 16, 32, 16, 2.0), (40, 4, 1, 16, 16, 32, 1.0)]:
    g = torch.Generator().manual_seed(T)
    width = 2 * Hk * dk + H * dv
    mixed = torch.randn(T, width + 24, generator=g)[:, :width]  # the conv's output, a slice of a wider row
    proj = torch.randn(T, 3 * H + 5, generator=g) * 3  # a and b: columns of the input projection
    a, b = proj[:, 1:1 + H], proj[:, 2 + H:2 + 2 * H]
    a[0, 0] = 100.0  # softplus past its threshold (20): the identity (exp overflows fp32 there)
    neg_a, dt_bias = -torch.rand(H, generator=g) * 2, torch.randn(H, generator=g)
    q_raw = mixed[:, :Hk * dk].unflatten(1, (Hk, dk))
    k_raw = mixed[:, Hk * dk:2 * Hk * dk].unflatten(1, (Hk, dk))
    v = mixed[:, 2 * Hk * dk:].unflatten(1, (H, dv))
    # the layer's torch form of the same quantities
    q = qwen3_5.l2norm_scaled(q_raw, torch.full((dk,), 1.0 / dk))
    k = qwen3_5.l2norm_scaled(k_raw, torch.full((dk,), dk ** -0.5))
    beta = b.sigmoid() * beta_scale
    decay = neg_a * F.softplus(a + dt_bias)
    want = scan.prepare(q, k, v, decay, beta, C)
    got = scan.prepare_raw(q_raw, k_raw, v, a, b, neg_a, dt_bias, beta_scale, C)
    for x, y in zip(got, want):
        assert x.shape == y.shape, (x.shape, y.shape)
        assert (x - y).abs().max() <= 1e-5 * max(1.0, float(y.abs().max())), float((x - y).abs().max())
    # the output norm: o as the scan leaves it ([H, n C, dv] read transposed), z a slice of the projection
    o = torch.randn(H, T + 9, dv, generator=g)[:, :T].transpose(0, 1)
    z = torch.randn(T, H * dv + 3, generator=g)[:, :H * dv].unflatten(1, (H, dv))
    norm = qwen3_5.GatedRMSNorm(dv, 1e-6)
    norm.weight.data = torch.rand(dv, generator=g) + 0.5
    got = scan.gated_norm(o, z, norm.weight.data, norm.eps)
    want = norm(o, z).reshape(T, H * dv)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * float(want.abs().max()), \
        float((got - want).abs().max())
print("ok")
"""


SOLVE_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from models.architectures import gated_delta
from models.kernels.cuda import scan
for T, H, dk, dv, beta_scale in [(150, 2, 32, 16, 1.0), (64, 1, 16, 64, 2.0)]:
    q, k, v, g, beta, _ = gated_delta.example_inputs(T, H, dk, dv, torch.device("cpu"), seed=T)
    system, _, v_beta, k_cum, *_ = gated_delta.chunk_terms(q, k, v, g, beta * beta_scale, 64)
    eye = torch.eye(64, dtype=torch.float64).expand_as(system)
    inv = torch.linalg.solve_triangular(system.double(), eye, upper=False, unitriangular=True)
    garbage = system + torch.triu(torch.randn_like(system))  # the diagonal and above: not read
    u, w = scan.solve(garbage, v_beta, k_cum)
    for got, want in ((u, inv @ v_beta.double()), (w, inv @ k_cum.double())):
        assert (got.double() - want).abs().max() <= 1e-5 * float(want.abs().max()), float((got - want).abs().max())
print("ok")
"""


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="Triton is not importable here")
def test_chunk_solve_kernel_under_the_interpreter_equals_the_triangular_solve():
    """cuda_scan.solve ((I + A)^-1 by 16-row blocks, and its products with v_beta and k_cum, one
    program a chunk) against torch's triangular solve in fp64, by Triton's interpreter: several
    chunks and heads, betas up to 2 (OLMo-Hybrid's scale), the system's upper half ignored."""
    from tests.support.interpreted import run_interpreted
    run_interpreted(SOLVE_INTERPRETED)


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="Triton is not importable here")
def test_chunk_prepare_kernel_under_the_interpreter_equals_the_torch_terms():
    """cuda_scan.prepare (the chunks' terms in one kernel, CUDA prefill) against
    gated_delta.chunk_terms, by Triton's interpreter on the CPU: partial chunks, unrepeated and
    repeated key heads, v read from a strided slice and with a feature stride of T."""
    from tests.support.interpreted import run_interpreted
    run_interpreted(PREPARE_INTERPRETED)


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="Triton is not importable here")
def test_chunk_prepare_from_raw_projections_under_the_interpreter():
    """cuda_scan.prepare_raw (the layer's l2 norms, g and beta inside the chunks' first kernel)
    against prepare on the layer's torch forms of them, and cuda_scan.gated_norm against
    GatedRMSNorm, by Triton's interpreter: strided slices as the layer passes them, softplus past
    its threshold, betas scaled by 2, unrepeated key heads."""
    from tests.support.interpreted import run_interpreted
    run_interpreted(RAW_INTERPRETED)


def test_model_prefill_forms_agree(hybrids, monkeypatch):
    check_prefill_forms(hybrids["qwen3_5"][0], qwen3_5, monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0, max_new_tokens=12),
                                 SamplingConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11,
                                                max_new_tokens=12)])
def test_generate_twice_on_one_session_is_identical(hybrids, kind, cfg):
    lm, _ = hybrids[kind]
    s = session(lm)
    prompt = rand_ids(40, 3)
    a = list(s.generate(prompt, cfg))
    b = list(s.generate(prompt, cfg))
    assert a == b
    assert s.last_stats.reused_tokens == 40  # restored from the checkpoint taken after the prompt


@pytest.mark.parametrize("kind", KINDS)
def test_second_turn_appended_equals_cold_run(hybrids, kind):
    lm, _ = hybrids[kind]
    check_second_turn(lm)


def test_non_extension_prompt_falls_back_to_reset(hybrids):
    lm, _ = hybrids["qwen3_5"]
    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    s = session(lm)
    list(s.generate(rand_ids(30, 1), greedy))
    other = rand_ids(30, 1)[:10] + rand_ids(5, 2)
    assert list(s.generate(other, greedy)) == list(session(lm).generate(other, greedy))
    assert s.last_stats.reused_tokens == 0
    with pytest.raises(Exception, match="without a checkpoint"):
        s.state.rewind(5)


def test_multimodal_checkpoint_loads_its_text_model(hybrids, tmp_path):
    """Qwen3.5 multimodal layout: text weights under model.language_model.*, a vision tower to
    skip, the text config nested under text_config and tie_word_embeddings at the top level."""
    import shutil

    from safetensors.torch import save_file

    _, hf = hybrids["qwen3_5"]
    src = tmp_path / "mm"
    src.mkdir()
    from tests.support.tiny import write_checkpoint
    text_dir = write_checkpoint("qwen3_5", str(tmp_path / "text"), model=hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(text_dir, name), src / name)
    cfg = json.load(open(os.path.join(text_dir, "config.json")))
    tie = cfg.pop("tie_word_embeddings")
    json.dump({"model_type": "qwen3_5", "text_config": cfg, "tie_word_embeddings": tie,
               "vision_config": {"depth": 1}}, open(src / "config.json", "w"))
    tensors = {k.replace("model.", "model.language_model.", 1): v.contiguous()
               for k, v in hf.state_dict().items() if not k.startswith("lm_head") or not tie}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(src / "model.safetensors"))
    lm = models.load(str(src))
    ids = rand_ids(30, 11)
    assert (session(lm).prefill(ids, all_logits=True) - hf_logits(hf, ids)).abs().max() <= TOL


def test_qwen3_next_per_expert_checkpoint_layout(hybrids, tmp_path):
    """Hub Qwen3-Next checkpoints store each expert's gate/up/down as 2D weights; the loader stacks them."""
    import shutil

    from safetensors.torch import save_file

    _, hf = hybrids["qwen3_next"]
    from tests.support.tiny import write_checkpoint
    d = write_checkpoint("qwen3_next", str(tmp_path / "ref"), model=hf)
    tensors = {}
    for k, v in hf.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            tensors[k] = v.contiguous()
    assert any(".experts.0.gate_proj.weight" in k for k in tensors)
    out = tmp_path / "per-expert"
    shutil.copytree(d, out)
    os.remove(out / "model.safetensors")
    save_file(tensors, str(out / "model.safetensors"))
    ids = rand_ids(25, 12)
    assert (session(models.load(str(out))).prefill(ids, all_logits=True) - hf_logits(hf, ids)).abs().max() <= TOL


def test_fused_l2norm_equals_the_reference_form():
    from models.architectures.qwen3_5 import l2norm, l2norm_scaled
    x = torch.randn(3, 4, 64, dtype=torch.float64)
    for scale in (1.0 / 64, 64 ** -0.5):
        w = torch.full((64,), scale, dtype=torch.float64)
        assert torch.allclose(l2norm_scaled(x, w), l2norm(x) * (scale * 8), rtol=1e-12, atol=0)
