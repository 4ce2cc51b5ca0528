"""Regression test of the original bug: a reused session must re-zero fixed recurrent state.

A synthetic recurrent decoder's logits are a direct function of the conv state a forward finds:
logit[0] = sum(incoming window), and each forward pushes 1 + that sum into the window. From a zero
state the first logit is 0 and the logits strictly grow, so any state leaked from generation 1
into generation 2 shows up in the first logit. Non-vacuity: with the re-zero disabled through
engine.state's test-only switch, the same check fails (asserted below).
"""
import pytest
import torch
from torch import nn

from engine import state as state_mod
from engine.config import SamplingConfig
from engine.session import DecodeSession
from models.state_spec import FixedState

K = 3


class SyntheticRecurrentDecoder(nn.Module):
    class config:  # noqa: N801 - mirrors model.config
        vocab_size = 2

    max_position = 1 << 16

    def __init__(self):
        super().__init__()
        self.logits_seen: list[float] = []

    def state_spec(self):
        return [FixedState((("conv", (1, K), torch.float32),))]

    def forward(self, tokens, positions, state, all_logits=False):
        conv = state.fixed(0)["conv"]
        rows = []
        for _ in range(tokens.shape[0]):
            incoming = conv.sum()
            rows.append(torch.stack([incoming, torch.zeros(())]))
            self.logits_seen.append(float(incoming))
            conv.copy_(torch.cat([conv[:, 1:], (1 + incoming).reshape(1, 1)], dim=1))
        logits = torch.stack(rows)
        return logits if all_logits else logits[-1:]


def two_generations(device="cpu", session_factory=None):
    model = SyntheticRecurrentDecoder()
    s = (session_factory or (lambda m: DecodeSession(m, max_context=64, device=torch.device(device),
                                                     dtype=torch.float32)))(model)
    cfg = SamplingConfig(temperature=0, max_new_tokens=6)
    out = []
    for _ in range(2):
        model.logits_seen.clear()
        tokens = list(s.generate([1], cfg))  # one prompt token, then 5 decode steps
        out.append((tokens, list(model.logits_seen)))
    return out


def check(generations):
    (tok1, log1), (tok2, log2) = generations
    assert tok1 == tok2
    assert log1 == log2
    assert log1[0] == 0.0
    assert all(b > a for a, b in zip(log1, log1[1:])), log1


def test_reset_rezeroes_recurrent_state_on_reused_session():
    check(two_generations())


def test_regression_test_fails_without_the_rezero(monkeypatch):
    monkeypatch.setattr(state_mod, "_REZERO_FIXED_STATE", False)
    with pytest.raises(AssertionError):
        check(two_generations())


def test_pure_kv_models_have_no_fixed_state(tiny_dirs):
    import models
    lm = models.load(tiny_dirs["llama"][0])
    s = DecodeSession(lm.model, max_context=32, device=torch.device("cpu"), dtype=torch.float32)
    assert s.state.fixed_tensors() == [] and not s.state.has_fixed_state
