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


# --- the Triton decode kernels (models/fused_cuda.py) against their torch forms ----------------

def test_fused_kernels_match_torch_forms():
    from models import fused_cuda
    from models.layers import Rope
    if not fused_cuda.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, KVH, D, S = 9, 3, 64, 32
    qkv = torch.randn(1, (H + 2 * KVH) * D, device=dev, dtype=bf)
    rope = Rope(D, 10000.0)
    rope.reset_buffers(dev)
    pos = torch.tensor([13], device=dev)
    cos, sin = rope.cos_sin(pos, bf)
    kc, vc = torch.randn(KVH, S, D, device=dev, dtype=bf), torch.randn(KVH, S, D, device=dev, dtype=bf)
    kc0, vc0 = kc.clone(), vc.clone()
    q = fused_cuda.rope_kv_write(qkv, cos, sin, pos, kc, vc, H, KVH)
    heads = qkv.view(1, H + 2 * KVH, D).transpose(0, 1).float()
    ref = rope.apply(heads[:H + KVH], cos.float(), sin.float())
    assert torch.allclose(q.float(), ref[:H], atol=2e-2, rtol=1e-2)
    assert torch.allclose(kc[:, 13].float(), ref[H:, 0], atol=2e-2, rtol=1e-2)
    assert torch.equal(vc[:, 13], heads[H + KVH:, 0].to(bf))
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[13] = False
    assert torch.equal(kc[:, untouched], kc0[:, untouched]) and torch.equal(vc[:, untouched], vc0[:, untouched])

    x, y, w = (torch.randn(1, 576, device=dev, dtype=bf) for _ in range(3))
    s, n = fused_cuda.add_rms_norm(x, y, w[0], 1e-5)
    assert torch.equal(s, x + y)
    assert torch.allclose(n.float(), torch.nn.functional.rms_norm((x + y).float(), (576,), w[0].float(), 1e-5),
                          atol=3e-2, rtol=1e-2)

    gu = torch.randn(1, 2 * 1536, device=dev, dtype=bf)
    g, u = gu.float().chunk(2, dim=-1)
    assert torch.allclose(fused_cuda.silu_mul(gu).float(), torch.nn.functional.silu(g) * u, atol=3e-2, rtol=1e-2)


def test_fused_kernels_keep_the_model_close_to_the_torch_forms(gpu_models, monkeypatch):
    from models import fused_cuda
    if not fused_cuda.ENABLED:
        pytest.skip("Triton is not installed here")
    lm = gpu_models["llama"]
    prompt = list(range(3, 40))

    def step_logits():
        s = DecodeSession(lm.model, max_context=64, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        s.prefill(prompt)
        return torch.stack([s.step(t)[-1] for t in (5, 6, 7, 8)])

    fused = step_logits()
    monkeypatch.setattr(fused_cuda, "ENABLED", False)
    plain = step_logits()
    assert float((fused - plain).abs().max()) <= 0.05 * float(plain.abs().max()) + 0.05


def test_graphs_on_off_identical_across_kv_buckets(gpu_models, monkeypatch):
    """The decode step reads a bucket of key slots that grows with the position; crossing
    from one bucket's graph to the next keeps graphs on = off."""
    import engine.graphs
    monkeypatch.setattr(engine.graphs, "SMALLEST_BUCKET", 64)
    for kind in ("llama", "qwen3_5"):
        lm = gpu_models[kind]
        prompt = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
        cfg = SamplingConfig(temperature=0, max_new_tokens=60)  # positions 100..159: buckets 128, 256

        def run(graph):
            s = DecodeSession(lm.model, max_context=256, device=torch.device("cuda"), dtype=torch.bfloat16,
                              cuda_graph=graph)
            if graph == "on":
                assert sorted(s.graph.graphs) == [64, 128, 256]
            return [list(s.generate(prompt, cfg)) for _ in range(2)]

        on, off = run("on"), run("off")
        assert on == off and on[0] == on[1]
