"""DecodeSession: reuse across calls, rewind == fresh, context limits, interruption."""
import pytest
import torch

import models
from engine import reference
from engine.config import SamplingConfig
from engine.session import ContextOverflow, DecodeSession

GREEDY = SamplingConfig(temperature=0, max_new_tokens=10)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=1234, max_new_tokens=10)


@pytest.fixture(scope="module")
def lm(tiny_dirs):
    return models.load(tiny_dirs["llama"][0])


def new(lm, max_context=128):
    return DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32)


def ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED])
def test_same_prompt_twice_same_tokens(lm, cfg):
    s = new(lm)
    a = list(s.generate(ids(20), cfg))
    b = list(s.generate(ids(20), cfg))
    assert a == b
    # the whole prompt came back from its turn-boundary checkpoint, next-token logits included
    assert s.last_stats.reused_tokens == 20 and s.last_stats.prefilled_tokens == 0


def test_rewind_then_generate_equals_fresh(lm):
    s = new(lm)
    list(s.generate(ids(30, 1), GREEDY))
    prompt = ids(30, 1)[:12] + ids(4, 2)
    assert list(s.generate(prompt, GREEDY)) == list(new(lm).generate(prompt, GREEDY))
    assert s.last_stats.reused_tokens == 12


def test_extension_prefills_only_new_tokens(lm):
    s = new(lm)
    first = ids(15, 3)
    reply = list(s.generate(first, GREEDY))
    second = first + reply + ids(6, 4)
    out = list(s.generate(second, GREEDY))
    assert s.last_stats.reused_tokens == len(first) + len(reply) - 1  # the last reply token was never fed
    assert out == reference.greedy(lm.model, second, len(out))


def test_context_overflow_refused_before_state_changes(lm):
    s = new(lm, max_context=32)
    list(s.generate(ids(10), GREEDY))
    before = (s.state.length, list(s.cached))
    with pytest.raises(ContextOverflow):
        s.generate(ids(40), GREEDY)
    assert (s.state.length, s.cached) == before


def test_generation_stops_when_context_full(lm):
    s = new(lm, max_context=24)
    out = list(s.generate(ids(20), SamplingConfig(temperature=0, max_new_tokens=100)))
    assert s.last_stats.finish_reason == "context"
    assert s.state.length == 24 and len(out) == 5


def test_interrupted_generation_keeps_state_consistent(lm):
    s = new(lm)
    gen = s.generate(ids(20), GREEDY)
    next(gen), next(gen)
    gen.close()
    assert s.state.length == len(s.cached)
    assert list(s.generate(ids(20), GREEDY)) == list(new(lm).generate(ids(20), GREEDY))


def test_stop_ids_end_generation(lm):
    s = new(lm)
    first = list(s.generate(ids(20), GREEDY))
    stop = first[3]
    out = list(s.generate(ids(20), GREEDY, stop_ids=(stop,)))
    assert out == first[:first.index(stop) + 1] and s.last_stats.finish_reason == "stop"


def test_decode_kv_buckets():
    from engine.graphs import decode_kv_len, kv_buckets
    assert kv_buckets(8192) == [512, 1024, 2048, 4096, 8192]
    assert kv_buckets(1000) == [512, 1000] and kv_buckets(392) == [392]
    assert kv_buckets(8192, single=True) == [8192]
    b = kv_buckets(8192)
    assert [decode_kv_len(p, b) for p in (0, 511, 512, 4095, 4096, 8191)] == [512, 512, 1024, 4096, 8192, 8192]


@pytest.mark.slow
def test_compiled_cpu_step_matches_eager_and_repeats_itself(lm):
    """`compile: on` on the CPU: the step is compiled at start by a scratch forward that leaves
    nothing behind; its logits equal the eager step's to fp32 summation order; greedy runs on
    the reused session repeat token for token."""
    s = DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32, compile="on")
    assert s.state.length == 0 and s.cached == []
    eager = new(lm)
    p = ids(20)
    want = [eager.prefill(p)] + [eager.step(t) for t in (5, 6, 7)]
    got = [s.prefill(p)] + [s.step(t) for t in (5, 6, 7)]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), float((a - b).abs().max())
    s.reset()
    runs = [list(s.generate(ids(20, seed=3), GREEDY)) for _ in range(2)]
    assert runs[0] == runs[1] == list(eager.generate(ids(20, seed=3), GREEDY))


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED])
def test_teacher_forced_on_its_own_tokens_departs_nowhere(lm, cfg):
    free = list(new(lm).generate(ids(20), cfg, turn=2))
    s = new(lm)
    assert list(s.generate(ids(20), cfg, turn=2, forced=free)) == free
    assert s.last_stats.departures == [] and s.last_stats.finish_reason == "length"


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED])
def test_teacher_forced_feeds_the_forced_tokens_and_notes_each_departure(lm, cfg):
    """The forced ids are fed whatever the sampler chose; the first departure is the changed token
    (with the sampler's choice and both log-probs), and what follows is what a free run from the
    forced prefix would choose."""
    prompt = ids(20)
    free = list(new(lm).generate(prompt, cfg))
    forced = free[:3] + [(free[3] + 1) % 300] + free[4:]
    s = new(lm)
    assert list(s.generate(prompt, cfg, forced=forced)) == forced
    first = s.last_stats.departures[0]
    assert (first.index, first.chosen, first.forced) == (3, free[3], forced[3])
    probe = new(lm)
    from engine.sampling import make_sampler
    sampler = make_sampler(2, cfg, lm.model.config.vocab_size, torch.device("cpu"), prompt, cfg.seed, 0)
    logits = probe.prefill(prompt)[-1]
    for t in free[:3]:
        sampler(logits)
        sampler.accept(t)
        logits = probe.step(t)[-1]
    assert sampler(logits) == free[3]
    assert [first.logp_chosen, first.logp_forced] == pytest.approx(sampler.log_probs(logits, [free[3], forced[3]]))
    # after the change the context differs: later departures compare with a run forced the same way
    again = new(lm)
    list(again.generate(prompt, cfg, forced=forced))
    assert again.last_stats.departures == s.last_stats.departures


def test_teacher_forced_ids_that_end_early_are_a_departure_and_stop_rules_apply(lm):
    free = list(new(lm).generate(ids(20), GREEDY))
    s = new(lm)
    assert list(s.generate(ids(20), GREEDY, forced=free[:4])) == free[:4]
    assert s.last_stats.finish_reason == "forced"
    d = s.last_stats.departures
    assert len(d) == 1 and (d[0].index, d[0].chosen, d[0].forced, d[0].logp_forced) == (4, free[4], None, None)
    # a stop id among the forced ones ends the generation there
    out = list(s.generate(ids(20), GREEDY, stop_ids=(free[2],), forced=free))
    assert out == free[:3] and s.last_stats.finish_reason == "stop"


def test_the_turn_keys_sampled_draws(lm):
    a = list(new(lm).generate(ids(20), SAMPLED, turn=0))
    assert list(new(lm).generate(ids(20), SAMPLED, turn=0)) == a
    assert list(new(lm).generate(ids(20), SAMPLED, turn=1)) != a
    assert list(new(lm).generate(ids(20), GREEDY, turn=1)) == list(new(lm).generate(ids(20), GREEDY, turn=0))


def test_the_step_factory_gives_one_form_per_setting(lm):
    """engine/steps.py: off is the model itself, on the CPU auto the C++ step where this model has
    one (its own fp16 KV cache over 4-bit weights: none here, an fp32 model), compile: on a
    compiled form, and the settings that cannot hold are one-line errors."""
    from engine import steps
    from engine.config import ConfigError
    cpu = torch.device("cpu")
    off = steps.choose(lm.model, cpu, torch.float32, cpu_kernel="off")
    assert off.fn is lm.model and not off.compiled and off.kv_dtype is None and off.verify is None and not off.note
    auto = steps.choose(lm.model, cpu, torch.float32, cpu_kernel="auto")
    assert auto.fn is not lm.model and auto.verify is not None and auto.kv_dtype == torch.float32
    compiled = steps.choose(lm.model, cpu, torch.float32, compile="on")
    assert compiled.compiled and compiled.fn is not lm.model
    for kwargs in (dict(compile="on", cpu_kernel="on"), dict(cpu_kernel="on", device=torch.device("cuda"))):
        device = kwargs.pop("device", cpu)
        with pytest.raises(ConfigError, match="cpu_kernel: 'on' is the CPU's decode step"):
            steps.choose(lm.model, device, torch.float32, **kwargs)
    steps.choose(lm.model, cpu, torch.float32, cpu_kernel="off")  # (detaches what auto attached)
