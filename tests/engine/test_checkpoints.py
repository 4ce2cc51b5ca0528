"""Turn-boundary checkpoints: prefix reuse, /undo, /retry and interrupts without a full recompute."""
import pytest

from chat.turn import TurnResult
from engine.session import ReuseMismatch
from tests.support.checkpoints import WORDS, check_property, check_undo_and_retry, cold_tokens, controller

KINDS = ["llama", "qwen3_5", "lfm2", "olmo_hybrid", "qwen3_5_moe", "qwen3_moe"]
HYBRIDS = [k for k in KINDS if k not in ("llama", "qwen3_moe")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    return {k: write_checkpoint(k, str(tmp_path_factory.mktemp(k)), model=hf_model(k)) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_property_every_generation_equals_a_cold_session(ckpts, kind, temperature):
    check_property(controller(ckpts[kind], temperature=temperature, seed="3"), 12)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_hybrid_turn_four_prefills_only_new_tokens(ckpts, kind):
    c = controller(ckpts[kind], temperature="0")
    assert c.session.state.has_fixed_state
    for word in WORDS[:3]:
        list(c.send(word, TurnResult([])))
    c.undo()  # the recurrent state of turn 3 is gone; the checkpoint after turn 2 is not
    r3 = TurnResult([])
    list(c.send(WORDS[2], r3))
    before = list(c.session.cached)
    r = TurnResult([])
    list(c.send(WORDS[3], r))
    shared = next(i for i, (a, b) in enumerate(zip(before + [-1], r.prompt_ids)) if a != b)
    # everything the template re-rendered identically: from the live state, or where the shared
    # prefix ends inside the reply (re-tokenized differently), from the checkpoint at the prompt's end
    reached = shared if shared == len(before) else len(r3.prompt_ids)
    assert r.stats.reused_tokens == reached
    assert r.stats.prefilled_tokens == len(r.prompt_ids) - reached
    # nothing of turn 3's prompt or older is prefilled again: only the reply's re-rendered tail and turn 4
    assert shared >= len(r3.prompt_ids)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_hybrid_undo_and_retry_restore_checkpoints(ckpts, kind):
    check_undo_and_retry(controller(ckpts[kind], temperature="0"))


def test_checkpoint_bytes_shown(ckpts):
    c = controller(ckpts["qwen3_5"])
    assert c.session.state.checkpoint_nbytes > 0


def test_verify_reuse_passes_then_catches_a_corrupted_state(ckpts):
    c = controller(ckpts["qwen3_5"], temperature="0", verify_reuse="true")
    list(c.send("alpha", TurnResult([])))
    list(c.send("beta", TurnResult([])))  # reuse verified against a cold prefill
    c.session.state.fixed_tensors()[1].add_(1.0)  # corrupt the live recurrent state
    with pytest.raises(ReuseMismatch, match="cold prefill"):
        list(c.send("gamma", TurnResult([])))


@pytest.mark.parametrize("kind", HYBRIDS)
def test_hybrid_interrupt_rolls_back_to_a_checkpoint_not_a_reset(ckpts, kind):
    c = controller(ckpts[kind], temperature="0", max_new_tokens="20")
    list(c.send("alpha", TurnResult([])))
    after_turn1 = c.session.state.length
    gen = c.send("beta", TurnResult([]))
    next(gen)
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt)
    assert 0 < c.session.state.length <= after_turn1  # restored from a checkpoint, not reset to zero
    r = TurnResult([])
    list(c.send("beta", r))
    assert r.stats.reused_tokens > 0
    assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, r.stats.seed)


def test_forward_broken_midway_falls_back_to_a_checkpoint(ckpts, monkeypatch):
    from models.architectures import gated_delta
    c = controller(ckpts["qwen3_5"], temperature="0")
    list(c.send("alpha", TurnResult([])))
    after_turn1 = c.session.state.length
    real = gated_delta.chunked

    def broken(q, k, v, g, beta, state, chunk=64, fused=False):
        state.add_(1.0)  # half-written recurrent state, then the forward dies
        raise KeyboardInterrupt

    monkeypatch.setattr(gated_delta, "chunked", broken)
    with pytest.raises(KeyboardInterrupt):
        list(c.send("beta gamma delta", TurnResult([])))
    monkeypatch.setattr(gated_delta, "chunked", real)
    assert 0 < c.session.state.length <= after_turn1  # a checkpoint, not zero
    r = TurnResult([])
    list(c.send("beta gamma delta", r))
    assert r.stats.reused_tokens > 0
    assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, r.stats.seed)
