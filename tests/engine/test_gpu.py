"""CUDA: graphs on vs off give identical tokens across generations on one reused session, and the
Triton kernels keep the logits close to the torch forms: the dense, Qwen3.5, LFM2 and OLMo-Hybrid
models; each kernel against its torch form; the session's start-up compiles every kernel."""
import pytest
import torch
import torch.nn.functional as F

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


# --- the Triton decode kernels (models/kernels/cuda/base.py) against their torch forms ----------------

def test_fused_kernels_match_torch_forms():
    """RoPE + KV write and add + RMSNorm, for one token (decode) and for several (prefill)."""
    from models.kernels.cuda import base as cuda_base
    from models.architectures.layers import Rope
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, KVH, D, S = 9, 3, 64, 32
    rope = Rope(D, 10000.0)
    rope.reset_buffers(dev)
    for first, T in ((13, 1), (9, 5)):
        qkv = torch.randn(T, (H + 2 * KVH) * D, device=dev, dtype=bf)
        pos = torch.arange(first, first + T, device=dev)
        cos, sin = rope.cos_sin(pos, bf)
        kc, vc = torch.randn(KVH, S, D, device=dev, dtype=bf), torch.randn(KVH, S, D, device=dev, dtype=bf)
        kc0, vc0 = kc.clone(), vc.clone()
        q = cuda_base.qk_rope_kv_write(qkv, cos, sin, pos, kc, vc, H, KVH)
        assert q.shape == (H, T, D)
        heads = qkv.view(T, H + 2 * KVH, D).transpose(0, 1).float()
        ref = rope.apply(heads[:H + KVH], cos.float(), sin.float())
        assert torch.allclose(q.float(), ref[:H], atol=2e-2, rtol=1e-2)
        live = slice(first, first + T)
        assert torch.allclose(kc[:, live].float(), ref[H:], atol=2e-2, rtol=1e-2)
        assert torch.equal(vc[:, live], heads[H + KVH:].to(bf))
        untouched = torch.ones(S, dtype=torch.bool)
        untouched[live] = False
        assert torch.equal(kc[:, untouched], kc0[:, untouched]) and torch.equal(vc[:, untouched], vc0[:, untouched])

    for T in (1, 7):
        x, y = (torch.randn(T, 576, device=dev, dtype=bf) for _ in range(2))
        w = torch.randn(576, device=dev, dtype=bf)
        s, n = cuda_base.add_rms_norm(x, y, w, 1e-5)
        assert torch.equal(s, x + y)
        assert torch.allclose(n.float(), F.rms_norm((x + y).float(), (576,), w.float(), 1e-5), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("T,H,dk,dv,Hk", [(200, 4, 128, 128, 4), (64, 3, 64, 32, 3), (1000, 2, 128, 64, 2),
                                          (300, 4, 128, 128, 2)])
def test_chunk_scan_kernel_matches_the_torch_scan(T, H, dk, dv, Hk):
    """The chunked gated delta rule with its terms and its scan in Triton kernels (cuda_scan)
    against the torch loop and the naive recurrence: outputs and the final state, from a non-zero
    state, over a partial last chunk; with Hk < H, the key heads unrepeated and v with a feature
    stride of T (as a torch conv's transposed output leaves it)."""
    from models.architectures import gated_delta
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    q, k, v, gate, beta, s0 = gated_delta.example_inputs(T, H, dk, dv, torch.device("cuda"))
    if Hk < H:
        q, k = q[:, ::H // Hk].repeat_interleave(H // Hk, 1), k[:, ::H // Hk].repeat_interleave(H // Hk, 1)
        v = v.reshape(T, H * dv).t().contiguous().t().reshape(T, H, dv)
    s_loop, s_fused, s_naive = s0.clone(), s0.clone(), s0.clone()
    loop = gated_delta.chunked(q, k, v, gate, beta, s_loop)
    qf, kf = (q[:, ::H // Hk], k[:, ::H // Hk]) if Hk < H else (q, k)  # (the repeated heads' sources)
    fused = gated_delta.chunked(qf, kf, v, gate, beta, s_fused, fused=True)
    naive = gated_delta.recurrent_naive(q, k, v, gate, beta, s_naive)
    assert torch.allclose(fused, loop, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s_fused, s_loop, atol=1e-4, rtol=1e-4)
    assert torch.allclose(fused, naive, atol=2e-3, rtol=2e-3)
    assert torch.allclose(s_fused, s_naive, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("K,N", [(576, 960), (1536, 576), (896, 1000), (1024, 49152), (5120, 640), (6000, 2050),
                                 (2048, 16384)])
def test_gemv_kernel_matches_linear(K, N):
    """The one-token Triton GEMV (one whole prefetched K step, streamed K steps, uneven steps and
    rows, the long steps of long rows, a SwiGLU pair over the one-step bound) and its SwiGLU form."""
    from models.kernels.cuda import base as cuda_base, linear as cuda_linear
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(1, K, device=dev, dtype=bf, generator=g)
    w = torch.randn(N, K, device=dev, dtype=bf, generator=g) * 0.05
    b = torch.randn(N, device=dev, dtype=bf, generator=g)
    ref = F.linear(x.float(), w.float(), b.float())
    assert torch.allclose(cuda_linear.gemv(x, w, b).float(), ref, atol=2e-2, rtol=1e-2)
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    assert torch.allclose(cuda_linear.gemv(x, w, swiglu=True).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    # times a scale in the epilogue (Granite's residual multiplier): the bits of the product after it
    for scale in (0.22, 1.0, 3.0):
        assert torch.equal(cuda_linear.gemv(x, w, b, scale=scale), cuda_linear.gemv(x, w, b) * scale)
        r, nw = x.flip(-1), torch.rand(K, device=dev, generator=g) + 0.5  # a NormedRow input too
        want = cuda_linear.gemv(cuda_linear.NormedRow(x, r, nw, 1e-6), w) * scale
        assert torch.equal(cuda_linear.gemv(cuda_linear.NormedRow(x, r, nw, 1e-6), w, scale=scale), want)


@pytest.mark.parametrize("res,K,N", [(True, 576, 1536), (False, 576, 1536), (True, 5120, 2048)])
def test_gemv_norm_prologue_matches_add_norm_then_linear(res, K, N):
    """A deferred add + RMSNorm (NormedRow) computed in the GEMV's prologue: the stream written
    equals x + res bit for bit, the output matches norm-then-linear, plain and SwiGLU."""
    from models.kernels.cuda import base as cuda_base, linear as cuda_linear
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(4)
    x = torch.randn(1, K, device=dev, dtype=bf, generator=g)
    r = torch.randn(1, K, device=dev, dtype=bf, generator=g) if res else None
    nw = torch.rand(K, device=dev, generator=g) + 0.5
    w = torch.randn(N, K, device=dev, dtype=bf, generator=g) * (1.2 / K ** 0.5)  # outputs ~1 at any K
    s = x + r if res else x
    h = F.rms_norm(s.float(), (K,), nw, 1e-5).to(bf).float()
    row = cuda_linear.NormedRow(x, r, nw, 1e-5)
    assert torch.allclose(cuda_linear.gemv(row, w).float(), F.linear(h, w.float()), atol=2e-2, rtol=1e-2)
    assert torch.equal(row.stream, s)
    row = cuda_linear.NormedRow(x, r, nw, 1e-5)
    gate, up = F.linear(h, w.float()).chunk(2, dim=-1)
    assert torch.allclose(cuda_linear.gemv(row, w, swiglu=True).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    assert torch.equal(row.stream, s)
    assert torch.allclose(cuda_linear.NormedRow(x, r, nw, 1e-5).materialize().float(), h, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("T", [1, 3, 37])
def test_qk_norm_partial_rope_kernel_matches_torch_forms(T):
    """Qwen3.5's gated attention: q heads 2D apart (each followed by its gate), zero-centred q/k
    norms, RoPE over the first quarter of each head; one token (decode's form), and a prefill's
    tokens in one partial block of 16 and in several."""
    from models.kernels.cuda import base as cuda_base
    from models.architectures.layers import Rope
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, KVH, D, R, S = 8, 2, 256, 64, 64
    qkv = torch.randn(T, H * 2 * D + 2 * KVH * D, device=dev, dtype=bf)
    rope = Rope(D, 1e7, rotary_dim=R)
    rope.reset_buffers(dev)
    pos = torch.arange(21, 21 + T, device=dev)
    cos, sin = rope.cos_sin(pos, bf)
    kc, vc = torch.zeros(KVH, S, D, device=dev, dtype=bf), torch.zeros(KVH, S, D, device=dev, dtype=bf)
    qw, kw = torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5
    q = cuda_base.qk_rope_kv_write(qkv, cos, sin, pos, kc, vc, H, KVH, q_stride=2 * D, norm_weights=(qw, kw), eps=1e-6)
    x = qkv.float()
    qh = F.rms_norm(x[:, :H * 2 * D].view(T, H, 2 * D)[..., :D], (D,), qw, 1e-6)
    kh = F.rms_norm(x[:, H * 2 * D:H * 2 * D + KVH * D].view(T, KVH, D), (D,), kw, 1e-6)
    want_q = rope.apply(qh.transpose(0, 1), cos.float(), sin.float())
    want_k = rope.apply(kh.transpose(0, 1), cos.float(), sin.float())
    assert torch.allclose(q.float(), want_q, atol=3e-2, rtol=1e-2)
    assert torch.allclose(kc[:, 21:21 + T].float(), want_k, atol=3e-2, rtol=1e-2)
    assert torch.equal(vc[:, 21:21 + T], qkv[:, H * 2 * D + KVH * D:].view(T, KVH, D).transpose(0, 1))
    assert int(kc[:, :21].count_nonzero()) == 0 and int(vc[:, 21 + T:].count_nonzero()) == 0


@pytest.mark.parametrize("H,KVH,D,T", [(32, 4, 128, 2048), (16, 2, 256, 37), (8, 8, 64, 300), (6, 2, 96, 129)])
def test_prefill_flash_call_equals_sdpa(H, KVH, D, T, monkeypatch):
    """attend_cached's prefill from position 0 with the Triton kernel off (and on GPUs before
    sm_90) calls flash's kernel itself: the same bits as SDPA restricted to its flash backend
    (GQA read grouped), q in the [T, H, D] memory qk_rope_kv_write leaves it in; and the slower
    forms' fp32 result to bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from models.architectures import layers
    from models.architectures.layers import attend_cached
    monkeypatch.setattr(layers, "TRITON_PREFILL_ATTENTION", False)
    g = torch.Generator(device="cuda").manual_seed(H * D + T)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
    kc, vc = (torch.randn(KVH, T + 20, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = attend_cached(q, kc, vc, T, None)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = F.scaled_dot_product_attention(q[None], kc[None, :, :T], vc[None, :, :T], is_causal=True,
                                             enable_gqa=KVH != H)[0].transpose(0, 1).reshape(T, -1)
    assert torch.equal(out, ref)
    rep = H // KVH
    exact = F.scaled_dot_product_attention(q[None].float(), kc[None, :, :T].float().repeat_interleave(rep, 1),
                                           vc[None, :, :T].float().repeat_interleave(rep, 1), is_causal=True)
    assert torch.allclose(out.float(), exact[0].transpose(0, 1).reshape(T, -1), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("H,KVH,D,start,T", [(32, 4, 128, 0, 2048), (24, 4, 256, 0, 700), (16, 2, 256, 3000, 201),
                                             (14, 2, 64, 0, 129), (6, 2, 96, 77, 65), (8, 8, 64, 1, 2),
                                             (32, 4, 128, 9000, 1000)])
def test_triton_prefill_attention_is_closer_to_fp32_than_torchs(H, KVH, D, start, T):
    """attend_cached's prefill (from position 0 or over a cached prefix) by the Triton kernel on
    sm_90+: within bf16 rounding of the fp32 masked form and no further from it than the form it
    replaced (flash from position 0, the masked kernel over a prefix) by more than a rounding; a
    continued prefill gives the bits of a cold prefill of the whole text (the kernel's contract);
    slots past the live ones (NaN here) are never read."""
    from models.architectures import layers
    from models.kernels.cuda import prefill_attention
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("the Triton prefill attention serves sm_90 and newer")
    g = torch.Generator(device="cuda").manual_seed(H * D + T + start)
    qa = torch.randn(start + T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
    q = qa[:, start:]
    kc, vc = (torch.randn(KVH, start + T + 40, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kc[:, start + T:], vc[:, start + T:] = float("nan"), float("nan")
    mask = layers.causal_mask(torch.arange(start, start + T, device="cuda"), start + T, torch.bfloat16) if start else None
    n = start + T
    rep = H // KVH
    exact = F.scaled_dot_product_attention(
        q[None].float(), kc[None, :, :n].float().repeat_interleave(rep, 1), vc[None, :, :n].float().repeat_interleave(rep, 1),
        attn_mask=None if mask is None else mask.float(), is_causal=mask is None)[0].transpose(0, 1).reshape(T, -1)
    assert layers._triton_prefill_takes(q, kc, vc)
    out = layers.attend_cached(q, kc, vc, n, mask)
    assert torch.equal(out, prefill_attention.causal(q, kc, vc, start))
    layers.TRITON_PREFILL_ATTENTION = False
    try:
        before = layers.attend_cached(q, kc, vc, n, mask)
    finally:
        layers.TRITON_PREFILL_ATTENTION = True
    err, err_before = ((o.float() - exact).abs().max().item() for o in (out, before))
    print(f"max |error| against fp32: triton {err:.3g}, torch's {err_before:.3g}")
    assert err <= max(2 * err_before, 4e-3)
    if start:
        assert torch.equal(prefill_attention.causal(qa, kc, vc, 0)[start:], out)


@pytest.mark.parametrize("H,KVH,D,S", [(9, 3, 64, 8192), (14, 2, 64, 600), (8, 2, 256, 300)])
def test_decode_attention_kernel_matches_torch_form(H, KVH, D, S):
    """Live slots only (stale slots past the position hold garbage that must not leak in), at
    positions that leave slices empty, fill one block exactly, and span many slices. Compared
    with the torch form in fp32: its bf16 form rounds the scores before the softmax (the kernel
    keeps them fp32), so on sharp softmaxes it is the less exact of the two."""
    from models.kernels.cuda import attention as cuda_attention, base as cuda_base
    from models.architectures.layers import decode_attention
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)
    kc = torch.randn(KVH, S, D, device=dev, dtype=bf, generator=g) * 3
    vc = torch.randn(KVH, S, D, device=dev, dtype=bf, generator=g)
    q = torch.randn(H, 1, D, device=dev, dtype=bf, generator=g)
    gate = torch.randn(1, H * 2 * D, device=dev, dtype=bf, generator=g)
    for pos in sorted({0, 1, 63, 64, 200, S // 2 + 7, S - 1}):
        p = torch.tensor([pos], device=dev)
        ref = decode_attention(q.float(), kc[:, :pos + 1].float(), vc[:, :pos + 1].float(), None)
        out = cuda_attention.decode(q, kc, vc, p)
        assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (pos, float((out.float() - ref).abs().max()))
        assert torch.equal(out, cuda_attention.decode(q, kc, vc, p))  # the same bits every run
        gated = cuda_attention.decode(q, kc, vc, p, gate[:, D:], 2 * D)
        want = ref * torch.sigmoid(gate.view(H, 2 * D)[:, D:].reshape(1, -1).float())
        assert torch.allclose(gated.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("nk,nv", [(2, 2), (2, 6)])
def test_gated_delta_decode_kernels_match_the_torch_layer(nk, nv, monkeypatch):
    """The two-kernel DeltaNet step against GatedDeltaNet's torch form, over several tokens from
    the same states: outputs, the conv window and the fp32 recurrent state."""
    from models.kernels.cuda import base as cuda_base
    from tests.support.hybrid import delta_layer_and_states
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    layer, states = delta_layer_and_states(dev, bf, nk=nk, nv=nv, dk=128, dv=64, olmo=False)
    xs = torch.randn(5, 1, 256, device=dev, dtype=bf)

    def run():
        st = {k: v.clone() for k, v in states.items()}
        with torch.inference_mode():
            return [layer(x, st).float() for x in xs], st

    fused, st_f = run()
    kernels.switch(triton=False)
    plain, st_p = run()
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, atol=2e-2, rtol=3e-2), float((a - b).abs().max())
    assert torch.equal(st_f["conv"], st_p["conv"])
    assert torch.allclose(st_f["recurrent"], st_p["recurrent"], atol=1e-2, rtol=1e-2)


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


@pytest.mark.parametrize("N", [1000, 40000])  # the norm in the GEMV's prologue; a separate launch (> 32 MB)
def test_lm_head_hands_fp32_logits_on_cuda(N):
    """The final norm + LM head on the Triton path: fp32 out, sums never rounded to bf16."""
    from models.kernels.cuda.linear import NormedRow
    from models.architectures.layers import Linear, head_logits
    K = 1024
    g = torch.Generator(device="cuda").manual_seed(N)
    head = Linear(K, N, bias=False).cuda().to(torch.bfloat16)
    head.weight.data.normal_(0, 0.05, generator=g)
    x, res = (torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    stream = (x.float() + res.float()).to(torch.bfloat16).double()
    h = F.rms_norm(stream, (K,), norm_w.double(), 1e-6)
    ref = h @ head.weight.double().t()
    row = NormedRow(x, res, norm_w, 1e-6, torch.float32)
    out = head_logits(head, row)
    assert out.dtype == torch.float32
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 1e-5, rel
    assert torch.equal(row.stream, stream.to(torch.bfloat16))
    plain = head_logits(head, h.float())  # an fp32 tensor row: the GEMV reads it as it is
    assert plain.dtype == torch.float32 and float((plain.double() - ref).norm() / ref.norm()) < 1e-5


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
