"""The captured decode step (engine/graphs.py) and the kernels a CUDA session runs, on the dense,
Qwen3.5, LFM2 and OLMo-Hybrid models: graphs on vs off give identical tokens across generations
on one reused session, and across the key-slot buckets; the kernels' compiled launchers give
Triton's own launch's bits; a capture leaves the live state as it was; the Triton kernels keep the
logits close to the torch forms, in fp32; the session's start-up compiles every kernel a
conversation runs. (Each kernel against its torch form: tests/kernels.)"""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession
from models import kernels

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    out = {}
    for kind in ("llama", "qwen3", "qwen3_5", "lfm2", "olmo_hybrid"):
        path = write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind))
        out[kind] = models.load(path, "cuda", torch.bfloat16)
    return out


def generations(lm, graph, prompts, cfg):
    s = DecodeSession(lm.model, max_context=256, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph=graph)
    assert (s.graph is not None) == (graph == "on")
    return [list(s.generate(p, cfg)) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "lfm2", "olmo_hybrid"])
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


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "lfm2", "olmo_hybrid"])
def test_fast_launch_identical(gpu_models, monkeypatch, kind):
    """Launches through the compiled kernels' C launchers (kernels/cuda/launcher.py) give the
    logits Triton's own launch gives, bit for bit: a prefill, eager decode steps and a later
    turn's prefill, where every kernel of the model launches many times."""
    from models.kernels.cuda import base as cuda_base, launcher
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    lm = gpu_models[kind]
    prompt = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(2)).tolist()

    def run():
        s = DecodeSession(lm.model, max_context=128, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        out = [s.prefill(prompt, all_logits=True)]
        out += [s.step(t) for t in (5, 6, 7, 8, 9)]
        out.append(s.prefill(list(range(50, 71)), all_logits=True))
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in out]).cpu()

    monkeypatch.setattr(launcher, "ENABLED", False)
    slow = run()
    monkeypatch.setattr(launcher, "ENABLED", True)
    run()  # (a kernel's first launch under a key goes through Triton's call)
    before = launcher.cached()
    fast = run()
    assert before > 0 and launcher.cached() == before  # no launch of the last run was its key's first
    assert torch.equal(fast, slow)


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


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "lfm2", "olmo_hybrid"])
def test_fused_kernels_keep_the_model_close_to_the_torch_forms(gpu_models, monkeypatch, kind):
    """The model in bf16 with the Triton kernels, against the same checkpoint in fp32 on the CPU:
    within 5% of the largest logit (+ 0.05), or no farther than the torch forms in bf16 are (the
    tiny OLMo-Hybrid's torch forms in bf16 were 0.22 from fp32, the kernels 0.16: they round less)."""
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    lm = gpu_models[kind]
    prompt = list(range(3, 40))

    def step_logits(model, device, dtype):
        s = DecodeSession(model, max_context=96, device=torch.device(device), dtype=dtype, cuda_graph="off")
        first = s.prefill(prompt)[-1]  # the prefill's kernels (RoPE + KV write, add + norm, conv, scan)
        steps = [s.step(t)[-1] for t in (5, 6, 7, 8)]
        # a later turn's prefill: from position 41, masked attention over the cached slots
        later = s.prefill(list(range(50, 62)), all_logits=True)
        return torch.cat([torch.stack([first] + steps), later]).float().cpu()

    ref = step_logits(models.load(lm.source).model, "cpu", torch.float32)
    fused = step_logits(lm.model, "cuda", torch.bfloat16)
    kernels.switch(triton=False)
    plain = step_logits(lm.model, "cuda", torch.bfloat16)
    err, err_plain = float((fused - ref).abs().max()), float((plain - ref).abs().max())
    assert err <= max(0.05 * float(ref.abs().max()) + 0.05, err_plain), (err, err_plain)


def test_triton_decode_needs_one_graph_and_matches_eager_over_long_positions(gpu_models):
    """The Triton attention reads the live length itself: one graph for every position."""
    for kind in ("llama", "qwen3_5"):
        lm = gpu_models[kind]
        prompt = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
        cfg = SamplingConfig(temperature=0, max_new_tokens=150)

        def run(graph):
            s = DecodeSession(lm.model, max_context=1024, device=torch.device("cuda"), dtype=torch.bfloat16,
                              cuda_graph=graph)
            if graph == "on":  # (max_context is the tiny model's 512 positions)
                assert list(s.graph.graphs) == [s.max_context]
            return [list(s.generate(prompt, cfg)) for _ in range(2)]

        on, off = run("on"), run("off")
        assert on == off and on[0] == on[1]


def test_graphs_on_off_identical_across_kv_buckets(gpu_models, monkeypatch):
    """Without Triton (CHAT_TRITON=0) the decode step reads a bucket of key slots that grows with
    the position; crossing from one bucket's graph to the next keeps graphs on = off."""
    import engine.graphs
    monkeypatch.setattr(engine.graphs, "SMALLEST_BUCKET", 64)
    kernels.switch(triton=False)
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


def _compiled_kernels() -> int:
    """How many compiled variants Triton holds in memory for the kernels of models/fused_*.py."""
    from models.kernels.cuda import (attention as cuda_attention, base as cuda_base, conv as cuda_conv,
                                     delta as cuda_delta, grouped as cuda_grouped, linear as cuda_linear,
                                     moe as cuda_moe, scan as cuda_scan)
    kernels = [cuda_linear._gemv_kernel, cuda_base._qk_rope_kv_kernel, cuda_base._add_rms_norm_kernel,
               cuda_grouped._gate_up_kernel, cuda_grouped._down_kernel, cuda_base._silu_mul_kernel,
               cuda_conv._causal_conv_kernel, cuda_delta._conv_step_kernel, cuda_delta._delta_step_kernel,
               cuda_attention._split_kernel, cuda_attention._merge_kernel, cuda_scan._chunk_scan_kernel,
               cuda_scan._chunk_prep_kernel, cuda_moe._route_kernel, cuda_moe._gate_up_kernel,
               cuda_moe._down_kernel, cuda_moe._down_wide_kernel, cuda_moe._combine_kernel, cuda_moe._count_kernel,
               cuda_moe._scan_kernel, cuda_moe._place_kernel, cuda_moe._combine_add_norm_kernel,
               cuda_scan._solve_kernel, cuda_scan._gated_norm_kernel]
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


def _start_compiles_what_a_conversation_runs(lm, compiled, dtype=torch.bfloat16):
    """A graph session on lm, whose start compiles kernels (compiled() grows), then a conversation
    of several prompt lengths, decode steps and a later turn (a masked prefill) that compiles
    none. Returns (prompts, their replies, the later turn's reply, the sampling config)."""
    before = compiled()
    s = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"), dtype=dtype, cuda_graph="on")
    started = compiled()
    assert started > before
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 16, 64, 65, 130)]
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    tokens = [list(s.generate(p, cfg)) for p in prompts]
    later = list(s.generate(prompts[-1] + tokens[-1] + [5, 6, 7], cfg))
    assert compiled() == started
    return prompts, tokens, later, cfg


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_moe-fp16",
                                  "qwen3_moe-grouped"])
def test_session_start_compiles_every_kernel_a_conversation_runs(tmp_path, monkeypatch, kind):
    """The session compiles (side by side) the kernels of prefill and decode when it starts: no
    prompt length, later turn or decode step compiles another; and the throwaway forwards that
    compile them leave no trace (the same tokens as a session started without them). Shapes
    no other test uses, so no earlier test compiled these kernels. In fp16 an MoE's prefill takes
    the experts' loop form, which reads the routed ids on the host (the skipped routing launch of
    the throwaway forward must leave ids there). "-grouped": sizes that grouped.py's GEMMs take (H
    and I multiples of 64), so the combine joins the next norm, the last row's alone, at top 3 (a
    top k that is not a multiple of 4: views at the last token's rows would change their alignment
    with the prompt's length)."""
    kind, dtype = (kind[:-5], torch.float16) if kind.endswith("-fp16") else (kind, torch.bfloat16)
    grouped = kind.endswith("-grouped")
    kind = kind.removesuffix("-grouped")
    from models.kernels.cuda import base as cuda_base
    from tests.support.tiny import write_checkpoint
    if not cuda_base.ENABLED or not hasattr(cuda_base.triton, "AsyncCompileMode"):
        pytest.skip("needs Triton >= 3.4")
    over = dict(hidden_size=96, intermediate_size=160, head_dim=32)
    if kind in ("qwen3_5", "qwen3_5_moe"):
        over.update(linear_key_head_dim=16, linear_value_head_dim=16)  # the scan kernel's sizes
    if kind == "qwen3_5_moe":  # the MoE kernels' sizes (constants of their compiles), apart for each model:
        over.update(moe_intermediate_size=48, shared_expert_intermediate_size=80)
    if kind == "qwen3_moe":  # its other kernels are the llama case's, compiled there
        over.update(moe_intermediate_size=56)
    if grouped:
        over.update(hidden_size=192, moe_intermediate_size=64)
    lm = models.load(write_checkpoint(kind, str(tmp_path), **over), "cuda", dtype)
    prompts, tokens, later, cfg = _start_compiles_what_a_conversation_runs(lm, _compiled_kernels, dtype)
    kernels.switch(precompile=False)  # a session started without them
    fresh = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"), dtype=dtype, cuda_graph="on")
    assert [list(fresh.generate(p, cfg)) for p in prompts] == tokens
    assert list(fresh.generate(prompts[-1] + tokens[-1] + [5, 6, 7], cfg)) == later


def test_model_logits_are_fp32_on_cuda(gpu_models):
    for lm in gpu_models.values():
        s = DecodeSession(lm.model, max_context=64, device=torch.device("cuda"), dtype=torch.bfloat16)
        for logits in (s.prefill(list(range(3, 20))), s.step(5)):
            assert logits.dtype == torch.float32
            assert bool((logits.to(torch.bfloat16).float() != logits).any())


def test_lfm2_session_start_compiles_every_kernel_a_conversation_runs(tmp_path):
    """As test_session_start_compiles_every_kernel_a_conversation_runs, with the short-conv
    kernel: after the session's start-up precompile no prompt length, later turn or decode step
    compiles another kernel.
    Shapes no other test uses (hidden 96: head size 32)."""
    from models.kernels.cuda import base as cuda_base, shortconv as cuda_shortconv
    from tests.support.tiny import write_checkpoint
    if not cuda_base.ENABLED or not hasattr(cuda_base.triton, "AsyncCompileMode"):
        pytest.skip("needs Triton >= 3.4")

    def compiled():
        k = cuda_shortconv._short_conv_step_kernel
        return _compiled_kernels() + sum(len(caches[0]) for caches in k.device_caches.values())

    lm = models.load(write_checkpoint("lfm2", str(tmp_path), hidden_size=96, intermediate_size=240,
                                      num_attention_heads=3, num_key_value_heads=1), "cuda", torch.bfloat16)
    _start_compiles_what_a_conversation_runs(lm, compiled)
