"""CUDA, LFM2 and OLMo-Hybrid: graphs on vs off give identical tokens across generations on one
reused session (a rewind in the middle), and the Triton kernels keep the logits close to the
torch forms (tests/test_gpu.py does the same for the dense and Qwen3.5 models)."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession

pytestmark = pytest.mark.gpu
KINDS = ["lfm2", "olmo_hybrid"]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from tiny import hf_model, write_checkpoint
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind)),
                              "cuda", torch.bfloat16) for kind in KINDS}


def generations(lm, graph, prompts, cfg):
    s = DecodeSession(lm.model, max_context=256, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph=graph)
    assert (s.graph is not None) == (graph == "on")
    return [list(s.generate(p, cfg)) for p in prompts]


@pytest.mark.parametrize("kind", KINDS)
def test_graphs_on_off_identical(gpu_models, kind):
    lm = gpu_models[kind]
    base = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [base, base[:25] + [7, 8, 9], base]
    for cfg in (SamplingConfig(temperature=0, max_new_tokens=24),
                SamplingConfig(temperature=0.8, seed=5, max_new_tokens=24)):
        on = generations(lm, "on", prompts, cfg)
        assert on == generations(lm, "off", prompts, cfg)
        assert on[0] == on[2]


@pytest.mark.parametrize("kind", KINDS)
def test_fused_kernels_keep_the_model_close_to_the_torch_forms(gpu_models, monkeypatch, kind):
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    lm = gpu_models[kind]

    def step_logits():
        s = DecodeSession(lm.model, max_context=96, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        first = s.prefill(list(range(3, 40)))[-1]
        steps = [s.step(t)[-1] for t in (5, 6, 7, 8)]
        later = s.prefill(list(range(50, 62)), all_logits=True)
        return torch.cat([torch.stack([first] + steps), later])

    fused = step_logits()
    monkeypatch.setattr(cuda_base, "ENABLED", False)
    plain = step_logits()
    assert float((fused - plain).abs().max()) <= 0.05 * float(plain.abs().max()) + 0.05


def test_lfm2_session_start_compiles_every_kernel_a_conversation_runs(tmp_path):
    """As tests/test_gpu.py's test of the same name, with the short-conv kernel: after the session's
    start-up precompile no prompt length, later turn or decode step compiles another kernel.
    Shapes no other test uses (hidden 96: head size 32)."""
    from models.kernels.cuda import base as cuda_base, shortconv as cuda_shortconv
    from test_gpu import _compiled_kernels
    from tiny import write_checkpoint
    if not cuda_base.ENABLED or not hasattr(cuda_base.triton, "AsyncCompileMode"):
        pytest.skip("needs Triton >= 3.4")

    def compiled():
        k = cuda_shortconv._short_conv_step_kernel
        return _compiled_kernels() + sum(len(caches[0]) for caches in k.device_caches.values())

    lm = models.load(write_checkpoint("lfm2", str(tmp_path), hidden_size=96, intermediate_size=240,
                                      num_attention_heads=3, num_key_value_heads=1), "cuda", torch.bfloat16)
    before = compiled()
    s = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"), dtype=torch.bfloat16, cuda_graph="on")
    started = compiled()
    assert started > before
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 16, 64, 65, 130)]
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    tokens = [list(s.generate(p, cfg)) for p in prompts]
    list(s.generate(prompts[-1] + tokens[-1] + [5, 6, 7], cfg))
    assert compiled() == started
