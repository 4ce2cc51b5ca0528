"""Sampling: pure, seedable, and each filter does what its name says."""
import torch

from engine.config import SamplingConfig
from engine.sampling import Sampler, apply_penalties, filter_logits


def cfg(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    base.update(kw)
    return SamplingConfig(**base)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert int(Sampler(cfg(temperature=0), 3, torch.device("cpu"), [], 0)(logits)) == 1


def test_seeded_draws_repeat():
    logits = torch.randn(100)
    draw = lambda seed: [int(Sampler(cfg(), 100, torch.device("cpu"), [], seed)(logits)) for _ in range(1)]  # noqa
    s1 = Sampler(cfg(), 100, torch.device("cpu"), [], 7)
    s2 = Sampler(cfg(), 100, torch.device("cpu"), [], 7)
    assert [int(s1(logits)) for _ in range(20)] == [int(s2(logits)) for _ in range(20)]
    assert draw(1) == draw(1)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda c: (filter_logits(logits, c) > -1e30).tolist()  # noqa
    assert keep(cfg(top_k=2)) == [True, True, False, False]
    assert keep(cfg(top_p=0.8)) == [True, True, False, False]
    assert keep(cfg(top_p=0.81)) == [True, True, True, False]
    assert keep(cfg(min_p=0.5)) == [True, True, False, False]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0])
    counts = torch.tensor([2.0, 1.0, 0.0])
    out = apply_penalties(logits, cfg(repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5), counts)
    assert torch.allclose(out, torch.tensor([2.0 / 2 - 0.2 - 0.5, -2.0 * 2 - 0.1 - 0.5, 1.0]))


def test_penalty_window_slides():
    s = Sampler(cfg(repetition_penalty=1.5, penalty_last_n=2), 5, torch.device("cpu"), [1, 2, 3], 0)
    assert s._counts.tolist() == [0, 0, 1, 1, 0]
    s.accept(4)
    assert s._counts.tolist() == [0, 0, 0, 1, 1]
