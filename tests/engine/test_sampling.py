"""Sampling: pure, seedable, and each filter does what its name says. Version 2 (the counter-based
sampler) against version 1's filters as the oracle; version 1 pinned bit for bit."""
import math

import pytest
import torch

from engine.config import SamplingConfig
from engine.sampling import Sampler, _sorted_top, candidates, draw, make_sampler, pick, splitmix64, uniform
from engine.sampling_v1 import SamplerV1, apply_penalties, filter_logits

CPU = torch.device("cpu")
LOGITS = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 2
FILTERED = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=5)
PLAIN = SamplingConfig(temperature=1.1, top_k=0, top_p=1.0, min_p=0.0, seed=5)


def cfg(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    base.update(kw)
    return SamplingConfig(**base)


def draws(sampler, n=20):
    out = []
    for _ in range(n):
        t = int(sampler(LOGITS))
        sampler.accept(t)
        out.append(t)
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_greedy_is_argmax(version):
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert int(make_sampler(version, cfg(temperature=0), 3, CPU, [], 0)(logits)) == 1


@pytest.mark.parametrize("penalized", [False, True])
def test_greedy_ties_go_to_the_lowest_id(penalized):
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0, 3.0])
    c = cfg(temperature=0, repetition_penalty=1.5 if penalized else 1.0)
    assert Sampler(c, [0], 0)(logits) == 1  # token 0's penalty changes nothing at the top


@pytest.mark.parametrize("version", [1, 2])
def test_seeded_draws_repeat(version):
    s1, s2 = (make_sampler(version, cfg(), 100, CPU, [], 7) for _ in range(2))
    logits = torch.randn(100)
    assert [int(s1(logits)) for _ in range(20)] == [int(s2(logits)) for _ in range(20)]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda c: (filter_logits(logits, c) > -1e30).tolist()  # noqa
    assert keep(cfg(top_k=2)) == [True, True, False, False]
    assert keep(cfg(top_p=0.8)) == [True, True, False, False]
    assert keep(cfg(top_p=0.81)) == [True, True, True, False]
    assert keep(cfg(min_p=0.5)) == [True, True, False, False]
    # version 2 keeps the same sets
    ids = lambda c: sorted(candidates(logits.double(), c)[0].tolist())  # noqa
    assert ids(cfg(top_k=2)) == ids(cfg(top_p=0.8)) == ids(cfg(min_p=0.5)) == [0, 1]
    assert ids(cfg(top_p=0.81)) == [0, 1, 2]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0])
    counts = torch.tensor([2.0, 1.0, 0.0])
    c = cfg(repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5)
    out = apply_penalties(logits, c, counts)
    assert torch.allclose(out, torch.tensor([2.0 / 2 - 0.2 - 0.5, -2.0 * 2 - 0.1 - 0.5, 1.0]))
    assert torch.allclose(Sampler(c, [0, 0, 1], 0).processed(logits), out.double())


def test_penalty_window_slides():
    s = SamplerV1(cfg(repetition_penalty=1.5, penalty_last_n=2), 5, CPU, [1, 2, 3], 0)
    assert s._counts().tolist() == [0, 0, 1, 1, 0]
    s.accept(4)
    assert s._counts().tolist() == [0, 0, 0, 1, 1]
    s2 = Sampler(cfg(repetition_penalty=1.5, penalty_last_n=2), [1, 2, 3], 0)
    assert s2.window.counts == {2: 1, 3: 1}
    s2.accept(4)
    assert s2.window.counts == {3: 1, 4: 1}
    s2.accept(4)
    assert s2.window.counts == {4: 2}
    every = Sampler(cfg(repetition_penalty=1.5, penalty_last_n=-1), [1, 2, 2], 0)
    assert every.window.counts == {1: 1, 2: 2}
    off = Sampler(cfg(repetition_penalty=1.5, penalty_last_n=0), [1, 2, 2], 0)
    assert not off.window.active and off.window.counts == {}


def test_version_1_is_unchanged_bit_for_bit():
    """Draws of the torch.Generator sampler as it was before version 2 existed (the recordings it
    made replay with it)."""
    assert draws(SamplerV1(FILTERED, 50, CPU, [1, 2, 3], 11)) == \
        [30, 46, 26, 25, 49, 26, 25, 25, 25, 6, 46, 26, 30, 28, 30, 17, 41, 26, 30, 49]
    assert draws(SamplerV1(PLAIN, 50, CPU, [1, 2, 3], 11)) == \
        [28, 48, 26, 38, 49, 17, 25, 25, 25, 6, 21, 26, 30, 46, 49, 15, 28, 26, 30, 43]


def test_version_2_is_pinned():
    """Any change to the hash, the order of the steps or the draw changes these: that is a new
    sampler version, not an edit of this one."""
    assert splitmix64(0) == 0xE220A8397B1DCDAF and splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    got = [uniform(s, t, i).hex() for s, t, i in [(0, 0, 0), (1234, 0, 0), (1234, 1, 0), (1234, 0, 1),
                                                  (2**63 - 1, 7, 1000)]]
    assert got == ['0x1.1c13ade1c7e5cp-3', '0x1.4adb4849c656ap-2', '0x1.318f3d801901bp-1',
                   '0x1.69c4f40b0d2eep-1', '0x1.734821a738d72p-2']
    assert draws(Sampler(FILTERED, [1, 2, 3], 11, turn=2)) == \
        [25, 26, 47, 6, 30, 25, 47, 25, 25, 6, 41, 30, 41, 25, 30, 26, 25, 30, 25, 49]
    assert draws(Sampler(PLAIN, [1, 2, 3], 11, turn=2)) == \
        [26, 17, 48, 28, 30, 6, 48, 26, 26, 20, 41, 25, 26, 41, 30, 47, 41, 30, 41, 24]


def test_uniform_is_uniform_and_keyed_by_every_word():
    us = [uniform(99, 0, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us)
    bins = [0] * 10
    for u in us:
        bins[int(u * 10)] += 1
    chi2 = sum((b - 2000) ** 2 / 2000 for b in bins)
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001
    assert len({uniform(s, t, i) for s in range(5) for t in range(5) for i in range(5)}) == 125


def test_draws_are_keyed_by_turn_and_index_not_by_history():
    a = Sampler(PLAIN, [], 11, turn=0)
    b = Sampler(PLAIN, [], 11, turn=1)
    assert draws(a) != draws(b)
    # the index, not the draws before it, keys a draw: a sampler that skipped ahead agrees
    c = Sampler(PLAIN, [], 11, turn=0)
    c.index = 7
    assert c(LOGITS) == draws(Sampler(PLAIN, [], 11, turn=0), 8)[7]


def test_version_2_candidates_are_version_1_filters():
    """On logits without ties, the tokens version 2 keeps are those version 1's masks keep."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        vocab = int(torch.randint(5, 400, (1,), generator=g))
        logits = torch.randn(vocab, generator=g) * float(torch.rand(1, generator=g) * 5 + 0.1)
        c = cfg(temperature=float(torch.rand(1, generator=g) + 0.2), top_k=int(torch.randint(0, 50, (1,), generator=g)),
                top_p=float(torch.rand(1, generator=g) * 0.9 + 0.1), min_p=float(torch.rand(1, generator=g) * 0.3))
        want = set((filter_logits(logits, c) > -1e30).nonzero()[:, 0].tolist())
        ids, e, running = candidates(logits.double() / c.temperature, c)
        assert set(ids.tolist()) == want, (vocab, c)
        assert torch.all(e[:-1] >= e[1:]) and torch.allclose(running, torch.cumsum(e, 0))


def test_draw_order_is_probability_then_id_and_the_prefix_sort_is_the_full_sort():
    ids, e, _ = candidates(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.5], dtype=torch.float64), cfg())
    assert ids.tolist() == [1, 2, 4, 3, 0, 5]
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 64, 100, 999, 1000, 5000):
        x = torch.randint(0, 40, (1000,), generator=g).double()  # many ties, at every boundary
        full = torch.sort(x, descending=True, stable=True).indices
        got = _sorted_top(x, m)
        assert torch.equal(got, full[:got.numel()]) and got.numel() >= min(m, 1000)
    # top-p over the whole vocabulary: the grown prefix gives what a full sort gives
    x = torch.randn(20000, generator=g, dtype=torch.float64) * 3
    ids, _, running = candidates(x, cfg(top_p=0.9))
    order = torch.sort(x, descending=True, stable=True).indices
    e = torch.exp(x[order] - x.max())
    before = torch.cumsum(e, 0) - e
    assert torch.equal(ids, order[: int((before < 0.9 * float(torch.cumsum(torch.exp(x - x.max()), 0)[-1])).sum())])


def test_the_inverse_cdf_picks_the_interval_of_the_uniform():
    running = torch.tensor([0.5, 0.5, 0.8, 1.0, 1.0], dtype=torch.float64)  # ids 1 and 4 have zero mass
    assert [pick(running, u) for u in (0.0, 0.49, 0.5, 0.79, 0.8, 0.999)] == [0, 0, 2, 2, 3, 3]
    assert pick(running, 1.0) == pick(running, 1.0 + 2 ** -52) == 3  # a target rounded up: the last with mass


def test_a_draw_sorts_only_as_far_as_it_needs_and_agrees_with_the_full_order():
    """Top-p over the whole vocabulary, and no filter at all: the draw equals the inverse CDF over
    the full sort, wherever the uniform falls."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20000, generator=g, dtype=torch.float64) * 3
    x[:200] += 12  # a peaked head, a long flat tail: small and large uniforms reach different depths
    order = torch.sort(x, descending=True, stable=True).indices
    running = torch.cumsum(torch.exp(x[order] - x.max()), 0)
    mass = float(torch.cumsum(torch.exp(x - x.max()), 0)[-1])  # id order
    for u in (0.0, 0.3, 0.9, 0.999, 0.99999, 1 - 2 ** -53):
        assert draw(x, cfg(), u) == int(order[pick(running, u * mass)]), u
        ids, _, r = candidates(x, cfg(top_p=0.9))
        assert draw(x, cfg(top_p=0.9), u) == int(ids[pick(r, u * float(r[-1]))]), u


@pytest.mark.slow
def test_draw_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    c = cfg(temperature=0.9, top_p=0.95)
    probs = filter_logits(logits, c).softmax(-1).tolist()
    n = 20000
    s = Sampler(c, [], 3)
    counts = [0] * 6
    for _ in range(n):
        counts[s(logits)] += 1
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)
    assert all(counts[i] == 0 for i, p in enumerate(probs) if p == 0)
    assert chi2 < 20.5  # 4 degrees of freedom, p = 0.0004


@pytest.mark.parametrize("version", [1, 2])
def test_log_probs_are_after_penalties_and_temperature(version):
    c = cfg(temperature=0.7, top_k=3, repetition_penalty=1.3)
    s = make_sampler(version, c, 50, CPU, [4, 5], 0)
    counts = torch.zeros(50)
    counts[[4, 5]] = 1
    want = torch.log_softmax(apply_penalties(LOGITS, c, counts).double() / 0.7, -1)
    got = s.log_probs(LOGITS, [4, 0, 49])  # whole vocabulary: a token top-k dropped has a finite value
    assert all(math.isfinite(v) for v in got)
    assert got == pytest.approx([float(want[i]) for i in (4, 0, 49)], abs=1e-5)
