"""CUDA: graphs on vs off give identical tokens across generations on one reused session."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from tiny import hf_model, write_checkpoint
    out = {}
    for kind in ("llama", "qwen3_5"):
        path = write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind))
        out[kind] = models.load(path, "cuda", torch.bfloat16)
    return out


def generations(lm, graph, prompts, cfg):
    s = DecodeSession(lm.model, max_context=256, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph=graph)
    assert (s.graph is not None) == (graph == "on")
    return [list(s.generate(p, cfg)) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_graphs_on_off_identical(gpu_models, kind):
    lm = gpu_models[kind]
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 300, (40,), generator=g).tolist()
    prompts = [base, base[:25] + [7, 8, 9], base]  # a rewind (or reset) in the middle
    for cfg in (SamplingConfig(temperature=0, max_new_tokens=24),
                SamplingConfig(temperature=0.8, seed=5, max_new_tokens=24)):
        on = generations(lm, "on", prompts, cfg)
        off = generations(lm, "off", prompts, cfg)
        assert on == off
        assert on[0] == on[2]


def test_capture_leaves_no_trace_in_live_state(gpu_models):
    lm = gpu_models["qwen3_5"]
    s = DecodeSession(lm.model, max_context=128, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph="on")
    assert s.state.length == 0 and all(int(t.count_nonzero()) == 0 for t in s.state.fixed_tensors())
    list(s.generate(list(range(3, 40)), SamplingConfig(temperature=0, max_new_tokens=5)))
    before = [t.clone() for t in s.state.fixed_tensors()], s.state.length
    s.graph.capture()  # an explicit re-capture mid-conversation
    assert s.state.length == before[1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], s.state.fixed_tensors()))
