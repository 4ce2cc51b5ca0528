"""The C++ CPU decode step (models/kernels/cpu/step.py) against the torch step it replaces."""
import os

import pytest
import torch

import models
from engine.config import ConfigError, SamplingConfig
from engine.session import DecodeSession
from models.kernels.cpu import step as cpu_step
from tests.support.blocks import lfm2_in_blocks

GREEDY = SamplingConfig(temperature=0, max_new_tokens=40)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=77, max_new_tokens=40)


def session(lm, kernel, max_context=256):
    return DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32,
                         cpu_kernel=kernel)


def step_logits(lm, kernel, prompt, tokens):
    s = session(lm, kernel)
    s.prefill(prompt)
    return torch.stack([s.step(t)[-1] for t in tokens])


def across_the_switch(lm, kernel):
    """Logits of 13 steps from 250 to 262 live slots (step.cpp's kLoopSlots is 256)."""
    s = session(lm, kernel, max_context=400)
    s.prefill(torch.randint(3, 300, (249,), generator=torch.Generator().manual_seed(3)).tolist())
    return torch.stack([s.step(t)[-1] for t in range(10, 23)])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cpp_step_matches_the_torch_step(tiny_dirs, kind):
    """fp32 weights: the same logits to float summation order, step after step (the KV the C++
    step writes is read back by the next steps), GQA, Qwen2's q/k/v biases, Qwen3's per-head q/k
    norms and head size apart from hidden / heads, a tied head."""
    lm = models.load(tiny_dirs[kind][0])
    assert cpu_step.supports(lm.model)
    s = session(lm, "on")
    assert isinstance(s._step_fn, cpu_step.CpuStep) and s.decode_path.startswith("C++ step (cpu_kernel); built for ")
    assert session(lm, "off").decode_path == "torch (eager)"
    prompt, tokens = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    got, want = step_logits(lm, "on", prompt, tokens), step_logits(lm, "off", prompt, tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5
    for cfg in (GREEDY, SAMPLED):
        assert list(session(lm, "on").generate(prompt, cfg)) == list(session(lm, "off").generate(prompt, cfg))


def test_cpp_step_across_the_long_context_switch(tiny_dirs):
    """The attention's two forms (loops up to step.cpp's kLoopSlots = 256 live slots, batched
    GEMMs above): steps from 250 to 262 live slots match the torch step on both sides."""
    lm = models.load(tiny_dirs["qwen2"][0])
    got, want = across_the_switch(lm, "on"), across_the_switch(lm, "off")
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5


def test_cpp_step_on_the_embedded_quantized_model(smollm2_q4_model):
    """The embedded model's 4-bit linears and Q8 head: the C++ step rounds activations to bf16
    before each int4 matmul as the torch step does, so the two agree to that rounding."""
    lm = smollm2_q4_model
    prompt = lm.tokenizer.encode("The capital of France is", add_special_tokens=False).ids
    s_on, s_off = session(lm, "on", 512), session(lm, "off", 512)
    a, b = s_on.prefill(prompt)[-1], s_off.prefill(prompt)[-1]
    for _ in range(24):  # each along its own greedy path while they agree
        t = int(b.argmax())
        assert int(a.argmax()) == t or float(b.topk(2).values.diff().abs()) < 0.5
        a, b = s_on.step(t)[-1], s_off.step(t)[-1]
        assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max())


@pytest.mark.parametrize("kind,qtype", [("llama", "Q4_0"), ("qwen2", "Q4_1")])
def test_cpp_step_on_tiny_4bit_ggufs(tmp_path, kind, qtype):
    """4-bit linears with Qwen2's q/k/v biases, q/k/v too small to fuse (three linears), an
    untied Q8_0 head: the C++ step against the torch step on the same quantized file, two loads
    (a C++ step sets its kernels on the model's modules: on one shared model the torch side would
    run them too, and a broken kernel would pass)."""
    from gguf import GGMLQuantizationType
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf
    path = write_gguf(kind, str(tmp_path / f"{kind}.gguf"), hf_model(kind), getattr(GGMLQuantizationType, qtype))
    lm, reference = models.load(path, quantized=True), models.load(path, quantized=True)
    assert cpu_step.supports(lm.model)
    prompt, tokens = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    got, want = step_logits(lm, "on", prompt, tokens), step_logits(reference, "off", prompt, tokens)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


def lfm2_session(lm, kernel, whole=True, max_context=256):
    """A session of an LFM2 on the whole C++ step (whole) or on the torch step with the library's
    per-linear kernels (the path LFM2 took before the C++ step knew its conv layers)."""
    from models.architectures import lfm2
    with pytest.MonkeyPatch.context() as mp:
        if not whole:
            mp.setattr(lfm2.Lfm2ForCausalLM, "offers_cpu_step", lambda self: False)
        return session(lm, kernel, max_context)


def lfm2_steps(s, prompt, tokens):
    s.prefill(prompt)
    logits = torch.stack([s.step(t)[-1] for t in tokens])
    windows = [t.clone() for t in s.state.fixed_tensors()]
    return logits, windows


def test_cpp_step_runs_lfm2s_conv_layers(tmp_path):
    """LFM2 (conv layers with biases around a GQA layer with q/k norms, a tied head), fp32: the
    whole C++ step against the torch step, logits step after step and the conv windows it leaves
    in the state (the next prefill continues from them), greedy and sampled replies."""
    from tests.support.tiny import write_checkpoint
    lm = models.load(write_checkpoint("lfm2", str(tmp_path / "lfm2")))
    assert cpu_step.supports(lm.model) and lm.model.config.conv_bias
    on, off = session(lm, "on"), session(lm, "off")
    assert isinstance(on._step_fn, cpu_step.CpuStep) and off.decode_path == "torch (eager)"
    prompt, tokens = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    (got, got_w), (want, want_w) = lfm2_steps(on, prompt, tokens), lfm2_steps(off, prompt, tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5
    assert len(got_w) == 3 and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got_w, want_w))
    for cfg in (GREEDY, SAMPLED):
        assert list(session(lm, "on").generate(prompt, cfg)) == list(session(lm, "off").generate(prompt, cfg))


@pytest.mark.parametrize("qtype,int8", [("Q4_0", False), ("Q8_0", False), ("Q4_0", True), ("Q8_0", True)])
def test_cpp_step_on_lfm2_in_blocks(tmp_path, qtype, int8):
    """LFM2's linears in GGUF blocks, fp32 or int8 inputs (cpu_int8): the whole C++ step against
    the torch step on the same per-linear kernels, two loads of one model (the step sets its
    kernels on the modules). The C++ step keeps its KV cache in fp16 here (4-bit weights), so the
    bound is that of the dense 4-bit files."""
    from gguf import GGMLQuantizationType
    qt = getattr(GGMLQuantizationType, qtype)
    lm, reference = lfm2_in_blocks(tmp_path, qt), lfm2_in_blocks(tmp_path, qt)
    for m in (lm, reference):
        models.use_int8_inputs(m.model, int8)
    assert cpu_step.supports(lm.model)
    on, per_linear = lfm2_session(lm, "on"), lfm2_session(reference, "auto", whole=False)
    assert isinstance(on._step_fn, cpu_step.CpuStep) and per_linear._step_fn is reference.model
    assert reference.model.cpu_block_kernels and on.state.kv(1)[0].dtype == torch.float16
    prompt, tokens = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    (got, got_w), (want, want_w) = lfm2_steps(on, prompt, tokens), lfm2_steps(per_linear, prompt, tokens)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    # the first conv layer reads the same inputs through the same kernels on both sides: the same
    # window; the later ones read a stream that passed the fp16 cache (and, with int8 inputs, its
    # roundings)
    assert torch.equal(got_w[0], want_w[0])
    assert all(float((a - b).abs().max()) <= 0.02 * float(b.abs().max()) for a, b in zip(got_w, want_w))


def sharp_qwen2_gguf(tmp_path, **over) -> str:
    """A tiny Qwen2 as Q4_1 GGUF with q and k scaled up: sharper attention, so an error in it
    moves the logits visibly."""
    from gguf import GGMLQuantizationType
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf
    hf = hf_model("qwen2", **over)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return write_gguf("qwen2", str(tmp_path / "q.gguf"), hf, GGMLQuantizationType.Q4_1)


def test_4bit_models_keep_an_fp16_kv_cache_across_the_long_context_switch(tmp_path):
    """With 4-bit weights the C++ step keeps the KV cache in fp16 (fp32 weights: fp32, the exact
    reference; the torch step: fp32); the attention over it (attend_long: blocks of 256 slots)
    on both sides of the first block boundary, against the torch step over an fp32 cache."""
    path = sharp_qwen2_gguf(tmp_path)
    lm = models.load(path, quantized=True)
    assert session(lm, "on").state.kv(0)[0].dtype == torch.float16
    assert session(lm, "off").state.kv(0)[0].dtype == torch.float32
    assert session(models.load(path), "on").state.kv(0)[0].dtype == torch.float32
    got, want = across_the_switch(lm, "on"), across_the_switch(lm, "off")
    # fp16 keys and values: 0.4 % of the largest logit here; an unscaled score above 256 slots: 8-16 %
    assert float((got - want).abs().max()) <= 0.015 * float(want.abs().max())


def test_cpp_step_over_four_blocks_of_slots(tmp_path):
    """900 live slots (four of attend_long's 256-slot blocks) through the whole step, against the
    torch step over an fp32 cache. (Too coarse to see the merge's rescaling on this model: an
    unrescaled merge stayed within the bound; test_cpu_attention_matches_an_exact_reference does.)"""
    lm = models.load(sharp_qwen2_gguf(tmp_path, max_position_embeddings=1024), quantized=True)
    prompt = torch.randint(3, 300, (900,), generator=torch.Generator().manual_seed(5)).tolist()

    def logits(kernel):
        s = session(lm, kernel, max_context=1024)
        s.prefill(prompt)
        return torch.stack([s.step(t)[-1] for t in (11, 12, 13, 14)])

    got, want = logits("on"), logits("off")
    assert float((got - want).abs().max()) <= 0.015 * float(want.abs().max())


@pytest.mark.parametrize("D,H,KVH,live", [(64, 9, 3, 1000), (16, 4, 2, 300), (128, 8, 2, 777), (64, 14, 2, 40)])
def test_cpu_attention_matches_an_exact_reference(D, H, KVH, live):
    """The step's attention alone (the op decode_attention runs the code the step runs), over fp16
    and fp32 caches of several 256-slot blocks whose keys differ in scale block to block (so each
    block's max differs, and a merge that did not rescale to the largest would be far off),
    against float64 softmax(q k^T / sqrt(D)) v over the same cached values."""
    cpu_step.load()
    g = torch.Generator().manual_seed(D + live)
    k = torch.randn(KVH, live + 7, D, generator=g)
    for b in range(0, live, 256):
        k[:, b:b + 256] *= 0.5 + b / 256
    v = torch.randn(KVH, live + 7, D, generator=g)
    q = torch.randn(H, D, generator=g) * 2
    for dtype in (torch.float16, torch.float32):
        kc, vc = k.to(dtype), v.to(dtype)
        got = torch.ops.chat_cpu.decode_attention(q, kc, vc, live, D ** -0.5)
        kk, vv = kc[:, :live].double(), vc[:, :live].double()
        scores = q.double().view(KVH, H // KVH, D) @ kk.transpose(1, 2) * D ** -0.5
        want = (torch.softmax(scores, -1) @ vv).view(H, D)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), float((got.double() - want).abs().max())


@pytest.fixture(scope="module")
def smollm2_q4_model():
    return models.load("smollm2", quantized=True)


def test_reused_session_equals_a_cold_one(tiny_dirs):
    """Rewinds and resets under the C++ step: a reused session's greedy tokens equal a fresh one's."""
    lm = models.load(tiny_dirs["llama"][0])
    s = session(lm, "on")
    base = list(range(3, 60))
    prompts = [base, base[:20] + [8, 9], base + [11], base]
    reused = [list(s.generate(p, GREEDY)) for p in prompts]
    cold = [list(session(lm, "on").generate(p, GREEDY)) for p in prompts]
    assert reused == cold and reused[0] == reused[3]


def test_models_without_a_kernel_keep_the_torch_step(tmp_path):
    from tests.support.tiny import write_checkpoint
    lm = models.load(write_checkpoint("qwen3_next", str(tmp_path / "hybrid")))  # a MoE hybrid: no C++ step
    assert lm.model.cpu_decode_step(torch.float32) is None  # no whole step; fp32 weights: no blocks either
    assert session(lm, "auto")._step_fn is lm.model and not lm.model.cpu_block_kernels
    with pytest.raises(ConfigError, match="no CPU decode kernel"):
        session(lm, "on")


def test_a_failed_build_is_a_note_in_auto_and_an_error_in_on(tiny_dirs, tmp_path, monkeypatch):
    lm = models.load(tiny_dirs["llama"][0])
    monkeypatch.setattr(cpu_step, "CACHE_DIR", str(tmp_path / "chat"))  # nothing cached there: it must build
    monkeypatch.setattr(cpu_step, "COMPILER", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_step, "_loaded", None)
    s = session(lm, "auto")
    assert s._step_fn is lm.model and "no C++ compiler" in s.cpu_kernel_note
    assert s.decode_path.startswith("torch (eager); CPU decode kernel unavailable (no C++ compiler")
    with pytest.raises(ConfigError, match="cpu_kernel: on, but the CPU decode kernel is unavailable"):
        session(lm, "on")
    assert not any(tmp_path.joinpath("chat").iterdir())  # no half-written library left behind


def test_the_library_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_step, "CACHE_DIR", str(tmp_path / "chat"))
    path = cpu_step.library_path()
    assert path.startswith(str(tmp_path)) and not cpu_step.is_built()
    monkeypatch.setattr(cpu_step, "_flags", lambda: ["-O1"])  # other flags: another library
    assert cpu_step.library_path() != path


@pytest.mark.slow
def test_a_corrupt_cached_library_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_step, "CACHE_DIR", str(tmp_path / "chat"))
    monkeypatch.setattr(cpu_step, "_loaded", None)
    path = cpu_step.library_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a library")
    loaded = []

    def load_library(p):  # the first load fails as a truncated file does; the rebuilt one is an ELF
        with open(p, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise OSError(f"{p}: invalid ELF header")
        loaded.append(p)  # (not loaded for real: this process has the library already)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    cpu_step.load()
    assert loaded == [path] and cpu_step._loaded == path


def test_an_unwritable_cache_is_a_note(tiny_dirs, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_step, "CACHE_DIR", str(blocker / "chat"))  # a file where a folder should be
    monkeypatch.setattr(cpu_step, "_loaded", None)
    s = session(models.load(tiny_dirs["llama"][0]), "auto")
    assert "not writable" in s.cpu_kernel_note


def test_the_q8_head_sums_in_fp32_under_the_cpp_step(smollm2_q4_model):
    """The embedded model's Q8_0 LM head: once a session decodes with the C++ step, the head's
    product runs in fp32 (q8_linear), equal to the dequantized product to fp32 rounding; torch's
    int4 kernel over its two 4-bit planes rounds the sums to bf16, 10^4 times further off."""
    lm = smollm2_q4_model
    s = session(lm, "on", 512)
    head = lm.model.lm_head
    assert head.fp32_kernel is not None
    x = torch.randn(2, head.in_features, generator=torch.Generator().manual_seed(3))
    n, k = head.codes.shape
    w = (head.codes.double().view(n, k // 32, 32) * head.scale.double()[..., None]).view(n, k)
    ref = x.double() @ w.t()

    def rel(y):
        return float((y.double() - ref).norm() / ref.norm())
    assert rel(head(x)) < 1e-6
    assert rel(head.hi(x).float() + head.lo(x).float()) > 1e-4
    logits = s.prefill(lm.tokenizer.encode("The capital of France is", add_special_tokens=False).ids)
    assert logits.dtype == torch.float32 and bool((logits.to(torch.bfloat16).float() != logits).any())


def test_rms_norm_rows_is_f_rms_norm():
    """The library's rms_norm_rows (a hybrid's norms of a few rows, under kernels.cpu_block_kernels)
    against F.rms_norm over the last dimension, any leading shape and a strided view: fp32
    summation order only."""
    cpu_step.load()
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1024), (3, 576), (1, 16, 128), (2, 6, 7)]:
        x = torch.randn(shape, generator=g) * 3
        w = torch.randn(shape[-1], generator=g)
        for eps in (1e-6, 1e-5 / 128):
            want = torch.nn.functional.rms_norm(x, (shape[-1],), w, eps)
            got = torch.ops.chat_cpu.rms_norm_rows(x, w, eps)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    x = torch.randn(1, 8, 64, generator=g)
    view = x[:, 2:6]  # (not contiguous)
    w = torch.ones(64)
    assert torch.allclose(torch.ops.chat_cpu.rms_norm_rows(view, w, 1e-6),
                          torch.nn.functional.rms_norm(view, (64,), w, 1e-6), rtol=1e-6, atol=1e-6)


def test_per_linear_kernels_take_the_norms_and_the_whole_step_does_not(tmp_path):
    """cpu_block_kernels (hybrids, MoE: the torch step on the library's per-linear kernels) also
    sets the norms' rms_norm_rows; the whole C++ step (dense models) leaves the torch model's norms
    as they are, so its prefill is unchanged; cpu_kernel off takes them off again."""
    from gguf import GGMLQuantizationType as Q

    from models import kernels
    from models.architectures.layers import RMSNorm
    from tests.support.blocks import tiny_gguf
    lm = models.load(tiny_gguf(tmp_path, "llama", Q.Q4_0), quantized=True)
    norms = [m for m in lm.model.modules() if isinstance(m, RMSNorm)]
    session(lm, "on")
    assert all(m.cpu_kernel is None for m in norms)
    assert kernels.cpu_block_kernels(lm.model, torch.float32)
    assert all(m.cpu_kernel is not None for m in norms)
    x = torch.randn(1, norms[0].weight.shape[0])
    want = torch.nn.functional.rms_norm(x, (x.shape[-1],), norms[0].weight, norms[0].eps)
    assert torch.allclose(norms[0](x), want, rtol=1e-6, atol=1e-6)
    session(lm, "off")
    assert all(m.cpu_kernel is None for m in norms)
