"""Mamba2 hybrids (Nemotron-H, Granite 4.0-H): parity with transformers, the prefill forms, state
resets (the seed's re-zero regression on a real family, with its non-vacuity check), and the
turn-boundary checkpoints under /undo and /retry."""
import pytest
import torch

import models
from engine import state as state_mod
from engine.config import SamplingConfig
from engine.session import DecodeSession
from models.architectures import mamba2
from tests.support.parity import (LENGTHS, TOL, check_decode, check_prefill, check_prefill_forms, check_second_turn,
                    check_split_prefill, hf_logits, load_with_hf, rand_ids, session)

KINDS = ["nemotron_h", "granitemoehybrid"]


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


def test_granite_without_positional_encoding_matches_transformers(tmp_path):
    """Granite 4.0-H's released configs attend without RoPE (position_embedding_type "nope")."""
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("granitemoehybrid", seed=1, position_embedding_type="nope")
    lm = models.load(write_checkpoint("granitemoehybrid", str(tmp_path), model=hf))
    assert not lm.model.config.rope
    s, seq = session(lm), rand_ids(40, 2)
    assert (s.prefill(seq, all_logits=True) - hf_logits(hf, seq)).abs().max() <= TOL
    for _ in range(4):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
        assert (s.step(seq[-1])[-1] - hf_logits(hf, seq)[-1]).abs().max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_split_prefill_equals_one_prefill(hybrids, kind):
    check_split_prefill(hybrids[kind][0])


@pytest.mark.parametrize("kind", KINDS)
def test_model_prefill_forms_agree(hybrids, kind, monkeypatch):
    check_prefill_forms(hybrids[kind][0], mamba2, monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_second_turn_appended_equals_cold_run(hybrids, kind):
    lm, _ = hybrids[kind]
    check_second_turn(lm)


def two_generations(lm):
    """The seed's regression on this family: two generations of one prompt on one session with no
    checkpoints, so the second must come back through reset(), the path of the original bug.
    Returns each generation's tokens and the logits of every forward it ran (a tiny random model's
    sampled tokens can hide a changed state; its logits cannot)."""
    s = DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32, checkpoint_mib=0)
    cfg = SamplingConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5, max_new_tokens=24)
    prompt = rand_ids(20, 8)
    out = []
    for _ in range(2):
        seen = []
        hook = lm.model.register_forward_hook(lambda m, args, logits: seen.append(logits.clone()))
        try:
            out.append((list(s.generate(prompt, cfg)), torch.cat(seen)))
        finally:
            hook.remove()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_reset_rezeroes_mamba_state_on_reused_session(hybrids, kind):
    (tokens1, logits1), (tokens2, logits2) = two_generations(hybrids[kind][0])
    assert tokens1 == tokens2 and torch.equal(logits1, logits2)


@pytest.mark.parametrize("kind", KINDS)
def test_regression_test_fails_without_the_rezero(hybrids, kind, monkeypatch):
    monkeypatch.setattr(state_mod, "_REZERO_FIXED_STATE", False)
    (_, logits1), (_, logits2) = two_generations(hybrids[kind][0])
    assert logits1.shape != logits2.shape or (logits1 - logits2).abs().max() > 1e-3


def test_unsupported_layer_types_are_one_line_errors():
    from models.formats.checkpoints import CheckpointError
    from models.loader import build_model
    from tests.support.tiny import hf_config
    cfg = hf_config("nemotron_h").to_dict()
    cfg["layers_block_type"] = ["linear_attention", "moe", "full_attention", "linear_attention"]
    with pytest.raises(CheckpointError, match=r"layer type 'moe' is not supported .*routed experts 'E' are not"):
        build_model(cfg)
    cfg = hf_config("granitemoehybrid").to_dict()
    cfg["position_embedding_type"] = "alibi"
    with pytest.raises(CheckpointError, match=r"position_embedding_type 'alibi' \(supported: rope, nope\)"):
        build_model(cfg)


