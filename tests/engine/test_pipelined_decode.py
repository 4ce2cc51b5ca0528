"""The pipelined greedy decode (engine/session.py: the generation loop's `ahead` hook) queues each
step before the host reads the token it feeds. It must give the step-by-step loop's tokens, finish
reasons and state (length, written slots, cached ids) at every way a reply ends: a stop id, the
token count, the context, the reader closing the generator; and the next turn's reuse must then be
the same. On CUDA with graphs, where it runs by default (`gpu`), and on the CPU's torch step, where
the tests switch it on (`_overlaps`: it overlaps nothing there, but the loop's bookkeeping is the
same)."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession
from engine.state import StateManager

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"]
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}


@pytest.fixture(scope="module", params=DEVICES)
def lms(request, tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    device = request.param
    loaded = {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind)),
                                device, DTYPES[device]) for kind in ("llama", "qwen3", "qwen3_5")}
    return device, loaded


@pytest.fixture
def here(lms, monkeypatch):
    """The device's models, with the pipelined loop allowed there (the CPU: switched on)."""
    device, loaded = lms
    if device == "cpu":
        monkeypatch.setattr(DecodeSession, "_overlaps", lambda self: True)
    return loaded


def session(lm, max_context=160):
    device = next(lm.model.parameters()).device
    if device.type == "cuda":
        return DecodeSession(lm.model, max_context=max_context, device=device, dtype=torch.bfloat16, cuda_graph="on")
    return DecodeSession(lm.model, max_context=max_context, device=device, dtype=torch.float32, cpu_kernel="off")


def run(s, prompt, cfg, stop_ids=(), close_after=None):
    gen = s.generate(prompt, cfg, stop_ids=stop_ids)
    out = []
    for t in gen:
        out.append(t)
        if close_after is not None and len(out) == close_after:
            gen.close()
            break
    st = s.state
    assert all(type(i) is int for i in s._ids)  # (a tensor left in place of an id compares equal to it)
    return out, s.last_stats.finish_reason, st.length, st.written, list(s._ids[:st.written])


def both(monkeypatch, lm, turns, max_context=160):
    """Each turn (prompt, cfg, stop_ids, close_after) on one session, pipelined and step by step;
    returns both transcripts and how many turns took the pipelined loop."""
    calls = []
    real = DecodeSession._pipelines

    def spy(self, *a, **k):
        took = real(self, *a, **k)
        calls.extend([1] if took else [])
        return took

    monkeypatch.setattr(DecodeSession, "_pipelines", spy)
    unfed = []
    real_unfeed = StateManager.unfeed
    monkeypatch.setattr(StateManager, "unfeed", lambda self, n, *a: (unfed.append(n), real_unfeed(self, n, *a))[1])
    out = {}
    for pipelined in (True, False):
        monkeypatch.setattr(DecodeSession, "PIPELINE_GREEDY", pipelined)
        s = session(lm, max_context)
        out[pipelined] = [run(s, p(s) if callable(p) else p, cfg, stops, close) for p, cfg, stops, close in turns]
        if not pipelined:
            assert not unfed  # (the step-by-step loop never unfeeds)
        else:
            unfeeds, unfed[:] = len(unfed), []
    return out[True], out[False], len(calls), unfeeds


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_pipelined_greedy_equals_the_step_by_step_loop(monkeypatch, here, kind):
    lm = here[kind]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (30,), generator=g).tolist()
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    # the 12th token of a free run is the stop id of the next turns
    probe, *_ = run(session(lm), prompt, greedy)
    stop = probe[11]
    turns = [
        (prompt, greedy, (), None),                                         # the count ends it
        (prompt, greedy, (probe[0],), None),  # a whole-prompt reuse, the earlier reply's slots written; its first token stops it
        (prompt, greedy, (stop,), None),                                    # the same reuse; a stop id ends it
        (lambda s: s.cached + [9], SamplingConfig(temperature=0, max_new_tokens=1), (), None),
        (lambda s: s.cached + [7], greedy, (), 3),                          # the reader closes it
        (lambda s: s.cached + [8, 9], SamplingConfig(temperature=0, max_new_tokens=500), (), None),  # the context
        (prompt + [5], greedy, (stop,), None),                              # a rewind, a new token
    ]
    piped, plain, calls, unfeeds = both(monkeypatch, lm, turns)
    assert calls == len(turns)  # every turn took the pipelined loop (the other run: none)
    assert [t[1] for t in piped][:6] == ["length", "stop", "stop", "length", "interrupted", "context"]
    for a, b in zip(piped, plain):
        assert a == b
    assert piped[1][0] == [probe[0]] and piped[1][3] > piped[1][2]  # the slots above stayed written
    assert piped[2][0] == probe[:len(piped[2][0])] and piped[2][0][-1] == stop
    assert unfeeds >= 1  # (the closed turn's step ahead, at least)


def test_pipelined_greedy_is_not_taken_where_it_cannot_be_undone_or_drawn(monkeypatch, here):
    """Recurrent state (its step ahead could not be unfed), sampled draws and penalties take the
    step-by-step loop; their tokens are unchanged by the setting."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 300, (20,), generator=g).tolist()
    sampled = SamplingConfig(temperature=0.8, seed=2, max_new_tokens=12)
    penalised = SamplingConfig(temperature=0, repetition_penalty=1.3, max_new_tokens=12)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    piped, plain, calls, _ = both(monkeypatch, here["qwen3_5"], [(prompt, greedy, (), None)])
    assert calls == 0 and piped == plain
    piped, plain, calls, _ = both(monkeypatch, here["llama"], [(prompt, sampled, (), None), (prompt, penalised, (), None)])
    assert calls == 0 and piped == plain


def test_a_generator_closed_late_leaves_the_next_generation_alone(here):
    """A reader that drops a pipelined reply unclosed and starts another: when the first is
    collected at last, its step ahead is not unfed from the second's state."""
    s = session(here["llama"])
    prompt = list(range(3, 33))
    greedy = SamplingConfig(temperature=0, max_new_tokens=20)
    first = s.generate(prompt, greedy, stop_ids=())
    next(first)
    # one new token, one reply token, no step: the length its step ahead left (31) again
    second = run(s, prompt + [4], SamplingConfig(temperature=0, max_new_tokens=1))
    assert second[2] == len(prompt) + 1
    first.close()  # now: the older generator's cleanup runs
    assert (s.state.length, s.state.written, s._ids[:s.state.written]) == second[2:]
