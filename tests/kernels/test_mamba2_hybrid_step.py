"""The C++ decode step of the Mamba2 hybrids (models/kernels/cpu/mamba2_hybrid_step.py: Granite
4.0-H with its routed experts in GGUF blocks, Nemotron-H) against the torch step it replaces:
Q8_0 GGUFs of llama.cpp's converter on fp32 and int8 inputs against the torch step on the same
per-linear kernels (mamba2_decode, experts_decode), fp32 weights against the exact torch step;
logits step after step and the states left behind, greedy and sampled replies; Granite's
multipliers (embedding, residual, attention, logits) and RoPE or none. On the library's kernels
and the same KV cache the torch step computes the step's bits exactly."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from models.architectures import granitemoehybrid, nemotron_h
from models.kernels.cpu import mamba2_hybrid_step, step as cpu_step
from tests.support.hybrid import STEP_PROMPT as PROMPT, cpu_session as session, granite_q8_0, q8_0_gguf
from tests.support.hybrid import steps_after_prompt as steps

GREEDY = SamplingConfig(temperature=0, max_new_tokens=24)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=77, max_new_tokens=24)
FAMILY = {"granitemoehybrid": granitemoehybrid.GraniteHybridForCausalLM,
          "granitemoehybrid_e5": granitemoehybrid.GraniteHybridForCausalLM,
          "nemotron_h": nemotron_h.NemotronHForCausalLM}


def close(got, want, tol, atol=1e-5):
    (g, g_states), (w, w_states) = got, want
    assert float((g - w).abs().max()) <= tol * float(w.abs().max())
    assert len(g_states) == len(w_states)
    for a, b in zip(g_states, w_states):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()) + atol


def gguf(tmp_path, kind, over):
    return granite_q8_0(tmp_path, kind, **over) if kind.startswith("granite") else q8_0_gguf(tmp_path, kind)


CASES = [("granitemoehybrid", {"position_embedding_type": "rope"}, False),
         ("granitemoehybrid", {"position_embedding_type": "nope"}, True),
         ("granitemoehybrid_e5", {}, False), ("nemotron_h", {}, False), ("nemotron_h", {}, True)]
IDS = ["granite-rope", "granite-nope-int8", "granite-e5", "nemotron", "nemotron-int8"]


@pytest.mark.slow
@pytest.mark.parametrize("kind,over,int8", CASES, ids=IDS)
def test_a_q8_0_gguf_s_step_is_the_torch_step_bit_for_bit(tmp_path, monkeypatch, kind, over, int8):
    """The whole step against the torch step on the library's kernels (its per-linear products,
    norms, mamba2_decode, experts_decode and attention) and the same fp16 KV cache: on int8
    inputs (the same products) the same logits and states bit for bit; on fp32 inputs within the
    last bits (measured 3e-7 of the largest logit: the fp32 products' sums in another order)."""
    runs = []
    for whole in (True, False):
        lm = gguf(tmp_path, kind, over)
        models.use_int8_inputs(lm.model, int8)
        s = session(lm, "on")
        assert isinstance(s._step_fn, mamba2_hybrid_step.Mamba2HybridStep) and s.decode_path.startswith("C++ step")
        cpu_step.attach_block_kernels(lm.model, norms=True)  # (the prefill's norms as the torch step's)
        if not whole:
            monkeypatch.setattr(s, "_step_fn", lm.model)
        runs.append(steps(s))
    (got, got_s), (want, want_s) = runs
    if int8:
        assert torch.equal(got, want) and len(got_s) == len(want_s)
        assert all(torch.equal(a, b) for a, b in zip(got_s, want_s))
    else:
        close(runs[0], runs[1], 2e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind,over,int8", [c for c in CASES if not c[2]], ids=[i for c, i in zip(CASES, IDS) if not c[2]])
def test_the_step_is_the_per_linear_path_it_replaces(tmp_path, monkeypatch, kind, over, int8):
    """Against the path such a file took before (the torch step on the per-linear kernels, an fp32
    KV cache): within the fp16 cache's rounding."""
    lm, ref = gguf(tmp_path, kind, over), gguf(tmp_path, kind, over)
    kernels = lm.plan.kernels()
    assert "C++ step: Mamba2 mixer" in kernels
    assert kind == "nemotron_h" or "C++ step: chosen experts (experts_decode)" in kernels
    on = session(lm, "on")
    monkeypatch.setattr(FAMILY[kind], "offers_cpu_step", lambda self: False)
    per_linear = session(ref, "auto")
    assert "per-linear kernels" in per_linear.decode_path
    close(steps(on), steps(per_linear), 1e-3)


def test_fp32_weights_step_as_the_exact_torch_step(tmp_path):
    """Nemotron-H in fp32 (an HF directory): the step's logits and states within fp32 summation
    order of the torch step's, and the same greedy and sampled replies."""
    from tests.support.tiny import write_checkpoint
    d = write_checkpoint("nemotron_h", str(tmp_path / "nemotron"))
    lm, ref = models.load(d), models.load(d)
    assert mamba2_hybrid_step.supports(lm.model)
    on, off = session(lm, "on"), session(ref, "off")
    assert isinstance(on._step_fn, mamba2_hybrid_step.Mamba2HybridStep)
    close(steps(on), steps(off), 1e-4)
    for cfg in (GREEDY, SAMPLED):
        assert list(session(lm, "on").generate(PROMPT, cfg)) == list(session(ref, "off").generate(PROMPT, cfg))


def test_granite_with_dense_experts_keeps_the_torch_step(tmp_path):
    from tests.support.tiny import write_checkpoint
    lm = models.load(write_checkpoint("granitemoehybrid", str(tmp_path / "granite")))
    assert not mamba2_hybrid_step.supports(lm.model)  # (its experts are not GGUF blocks)
    s = session(lm, "auto")
    assert not isinstance(s._step_fn, mamba2_hybrid_step.Mamba2HybridStep)
    assert "C++ step: Mamba2 mixer" not in lm.plan.kernels()
