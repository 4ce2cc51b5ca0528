"""DecodeSession's CUDA construction order, run on the CPU: the kernel precompile's throwaway
forwards, then the graph, with only the device-specific pieces stubbed (the CUDA predicate, the
model's kernel-precompile context, the graph capture). A session that reads its graph before it
exists, or captures before the precompile reset its state, fails here, not only on a GPU."""
import contextlib

import pytest
import torch

import models
from engine import session as session_mod
from engine.config import SamplingConfig
from engine.session import DecodeSession

GREEDY = SamplingConfig(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def lm(tiny_dirs):
    return models.load(tiny_dirs["llama"][0])


def test_cuda_construction_order_precompile_then_graph(lm, monkeypatch):
    events = []

    class StubGraph:
        """Stands in for GraphedDecodeStep: it 'captures' at construction (and checks the state
        the precompile left), then replays the eager step at the bucket the session chose."""

        def __init__(self, step_fn, state, device, buckets):
            events.append(("graph", state.length))
            self.step_fn, self.state, self.device = step_fn, state, device

        def __call__(self, token, position):
            tokens = torch.tensor([token], device=self.device)
            positions = torch.tensor([position], device=self.device)
            return self.step_fn(tokens, positions, self.state)

    @contextlib.contextmanager
    def precompiling():
        events.append(("precompile", None))
        yield

    monkeypatch.setattr(session_mod, "on_cuda", lambda device: True)
    monkeypatch.setattr(session_mod, "GraphedDecodeStep", StubGraph)
    monkeypatch.setattr(lm.model, "kernel_precompile", lambda device, dtype: precompiling(), raising=False)

    s = DecodeSession(lm.model, max_context=64, device=torch.device("cpu"), dtype=torch.float32,
                      cuda_graph="auto", cpu_kernel="off")
    assert events == [("precompile", None), ("graph", 0)]  # the precompile's forwards were reset
    assert isinstance(s.graph, StubGraph) and s.cached == [] and s.state.length == 0

    prompt = list(range(5, 25))
    plain = DecodeSession(lm.model, max_context=64, device=torch.device("cpu"), dtype=torch.float32,
                          cpu_kernel="off")
    assert list(s.generate(prompt, GREEDY)) == list(plain.generate(prompt, GREEDY))
