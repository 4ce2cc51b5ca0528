"""Mamba2 hybrids' turn-boundary checkpoints: every generation under sends, /undo, /retry and
resets equals a cold session's (the property test of tests/engine/test_checkpoints.py), and /undo and
/retry restore checkpoints instead of re-prefilling."""
import pytest

from tests.support.checkpoints import check_property, check_undo_and_retry, controller

KINDS = ["nemotron_h", "granitemoehybrid"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    return {k: write_checkpoint(k, str(tmp_path_factory.mktemp(k)), model=hf_model(k)) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_property_every_generation_equals_a_cold_session(ckpts, kind):
    check_property(controller(ckpts[kind], temperature="0.8", seed="3"), 5)


@pytest.mark.parametrize("kind", KINDS)
def test_undo_and_retry_restore_checkpoints(ckpts, kind):
    c = controller(ckpts[kind], temperature="0")
    assert c.session.state.has_fixed_state
    check_undo_and_retry(c)
