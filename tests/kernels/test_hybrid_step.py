"""The C++ decode step of the DeltaNet hybrids (models/kernels/cpu/hybrid_step.py: Qwen3.5, its MoE
and Qwen3-Next with routed experts in GGUF blocks, OLMo-Hybrid) against the torch step it replaces:
fp32 weights, GGUF blocks on fp32 and int8 inputs, DeltaNet value heads in the tiled order, OLMo's
attention with RoPE and without, routed experts with a gated shared expert, logits step after step
and the states left behind, greedy and sampled replies."""
import pytest
from gguf import GGMLQuantizationType as Q

import models
from engine.config import SamplingConfig
from models.kernels.cpu import hybrid_step
from tests.support.hybrid import STEP_PROMPT as PROMPT, cpu_session as session, tiny
from tests.support.hybrid import steps_after_prompt as steps

GREEDY = SamplingConfig(temperature=0, max_new_tokens=24)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=77, max_new_tokens=24)


@pytest.mark.parametrize("kind,qtype,int8,tiled,nope", [
    ("qwen3_5", None, False, False, False), ("qwen3_5", None, False, True, False), ("qwen3_5", Q.Q8_0, False, False, False),
    ("qwen3_5", Q.Q4_0, False, True, False), ("qwen3_5", Q.Q8_0, True, False, False),
    ("olmo_hybrid", None, False, False, False), ("olmo_hybrid", None, False, False, True),
    ("olmo_hybrid", Q.Q8_0, False, False, False)],
    ids=["fp32", "fp32-tiled", "Q8_0", "Q4_0-tiled", "Q8_0-int8", "olmo-fp32", "olmo-fp32-nope", "olmo-Q8_0"])
def test_the_hybrid_step_is_the_torch_step(tmp_path, kind, qtype, int8, tiled, nope):
    lm, ref = (tiny(tmp_path, qtype, tiled, kind, nope) for _ in range(2))  # (two loads: the step sets kernels)
    for m in (lm, ref):
        models.use_int8_inputs(m.model, int8)
    assert hybrid_step.supports(lm.model)
    on, off = session(lm, "on"), session(ref, "off")
    assert isinstance(on._step_fn, hybrid_step.HybridStep) and on.decode_path.startswith("C++ step")
    (got, got_s), (want, want_s) = steps(on), steps(off)
    tol = 1e-4 if qtype is None else 0.02
    assert float((got - want).abs().max()) <= tol * float(want.abs().max()) + 1e-5
    for a, b in zip(got_s, want_s):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()) + 1e-5
    if qtype is None:
        for cfg in (GREEDY, SAMPLED):
            assert list(session(lm, "on").generate(PROMPT, cfg)) == list(session(ref, "off").generate(PROMPT, cfg))


def test_moe_hybrids_with_dense_experts_keep_the_torch_step(tmp_path):
    from tests.support.tiny import write_checkpoint
    lm = models.load(write_checkpoint("qwen3_next", str(tmp_path / "next")))
    assert not hybrid_step.supports(lm.model)  # (its experts are not GGUF blocks)
    assert not isinstance(session(lm, "auto")._step_fn, hybrid_step.HybridStep)


@pytest.mark.slow
@pytest.mark.parametrize("kind,int8", [("qwen3_5_moe", False), ("qwen3_5_moe", True), ("qwen3_next", True)])
def test_routed_experts_in_blocks_take_the_step(tmp_path, monkeypatch, kind, int8):
    """A Qwen3.5-MoE / Qwen3-Next Q8_0 GGUF (llama.cpp's converter): the whole step against the
    torch step on the same per-linear kernels (experts_decode for its experts), both on the same
    inputs; the routing, the shared expert and its gate in the step."""
    from models.architectures import qwen3_5
    from tests.support.hybrid import q8_0_gguf
    # (every layer routed: llama.cpp's converter maps no dense MLP in a Qwen3-Next)
    over = {"mlp_only_layers": []} if kind == "qwen3_next" else {}
    lm, ref = (q8_0_gguf(tmp_path, kind, ("--no-mtp",), **over) for _ in range(2))
    for m in (lm, ref):
        models.use_int8_inputs(m.model, int8)
    assert any(hasattr(layer.mlp, "shared_expert") for layer in lm.model.model.layers)
    on = session(lm, "on")
    assert isinstance(on._step_fn, hybrid_step.HybridStep)
    monkeypatch.setattr(qwen3_5.HybridForCausalLM, "offers_cpu_step", lambda self: False)
    per_linear = session(ref, "auto")
    assert "per-linear kernels" in per_linear.decode_path
    (got, got_s), (want, want_s) = steps(on), steps(per_linear)
    # (the step's fp16 KV cache against fp32 there: ~6e-5 of the largest logit on fp32 inputs, which
    # int8 roundings carry to ~5e-3)
    tol = 0.02 if int8 else 1e-3
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    for a, b in zip(got_s, want_s):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()) + 1e-5


def test_olmo_on_int8_inputs_is_the_per_linear_path(tmp_path, monkeypatch):
    """OLMo-Hybrid's Q8_0 blocks on int8 inputs: the whole step against the torch step on the same
    per-linear kernels (the path before the whole step served it), both rounding their inputs."""
    from models.architectures import olmo_hybrid
    lm, ref = (tiny(tmp_path, Q.Q8_0, kind="olmo_hybrid") for _ in range(2))
    for m in (lm, ref):
        models.use_int8_inputs(m.model, True)
    on = session(lm, "on")
    monkeypatch.setattr(olmo_hybrid.OlmoHybridForCausalLM, "offers_cpu_step", lambda self: False)
    per_linear = session(ref, "auto")
    assert isinstance(on._step_fn, hybrid_step.HybridStep) and "per-linear kernels" in per_linear.decode_path
    (got, got_s), (want, want_s) = steps(on), steps(per_linear)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    for a, b in zip(got_s, want_s):  # (the step's fp16 KV cache against fp32 there, through int8 roundings)
        assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max()) + 1e-5
