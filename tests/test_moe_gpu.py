"""CUDA: the MoE decode kernels (models/kernels/cuda/moe.py) and the grouped-GEMM prefill against
their torch forms at the benchmark shapes and odd ones, and tiny MoE models whose decode step runs
them inside the CUDA graph: graphs on and off give identical tokens, close to the torch forms."""
import functools

import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession
from models.architectures import moe

pytestmark = pytest.mark.gpu


def kernels():
    from models.kernels.cuda import base as cuda_base, moe as cuda_moe
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    return cuda_moe


def bf16_layer(E, H, I, k, shared, norm, seed=0):
    """(Drawn on the CPU: a 35B-A3B-like layer's 0.8 G weights take seconds there, so the grouped
    cases share one layer a shape. Drawn on the device instead, the new values took the fused
    router GEMV of test_expert_kernels_match_the_torch_layer[60-1000-...] 2 bf16 steps from the
    unfused one, past its bound of one: bench/RESULTS.md set U.)"""
    torch.manual_seed(seed)
    m = moe.SparseMoe(H, E, k, I, norm, shared)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    return m.to("cuda", torch.bfloat16).eval()


# (experts, hidden, expert size, top k, shared expert size, renormalise): Qwen3.5-35B-A3B,
# Qwen3-30B-A3B, and odd sizes
SHAPES = [(256, 2048, 512, 8, 512, True), (128, 2048, 768, 8, 0, True), (60, 1000, 200, 5, 100, False)]


@pytest.mark.parametrize("E", [8, 60, 128, 256])
def test_route_kernel_matches_softmax_topk(E):
    cuda_moe = kernels()
    g = torch.Generator(device="cuda").manual_seed(E)
    for _ in range(20):
        # fp32 logits: no ties (bf16 ones tie often among 256, where the two may keep either)
        logits = torch.randn(1, E, device="cuda", generator=g)
        for norm in (True, False):
            idx, w = cuda_moe.route(logits, 8 if E >= 8 else 2, norm)
            ref_w, ref_idx = logits.float().softmax(-1).topk(idx.shape[-1], dim=-1)
            if norm:
                ref_w = ref_w / ref_w.sum(-1, keepdim=True)
            assert torch.equal(idx, ref_idx)  # both in descending order of weight
            assert torch.allclose(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,E,k", [(2048, 128, 8), (333, 256, 8), (50, 60, 5), (1, 6, 2)])
def test_prefill_routing_and_sort(T, E, k):
    """The grouped prefill's routing (decode's kernel, a program a token: each row's result is what
    decode gives that row alone) and its sort (the stable argsort's order, exactly)."""
    cuda_moe = kernels()
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16)
    idx, w = cuda_moe.route(logits, k, True)
    for t in {0, T // 2, T - 1}:
        one_idx, one_w = cuda_moe.route(logits[t:t + 1], k, True)
        assert torch.equal(one_idx, idx[t:t + 1]) and torch.equal(one_w, w[t:t + 1])
    x = torch.randn(T, 2048, device="cuda", generator=g).to(torch.bfloat16)
    xs, inv, offs = cuda_moe.sort_pairs(x, idx, E)
    order = idx.reshape(-1).argsort(stable=True)
    assert torch.equal(xs, x[order // k])
    assert torch.equal(inv[order], torch.arange(T * k, device="cuda"))
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert torch.equal(offs.long(), counts.cumsum(0))
    src, inv2, starts, offs2 = cuda_moe.sort_pairs(x, idx, E, copy=False)
    assert torch.equal(src.long(), order // k) and torch.equal(inv2, inv) and torch.equal(offs2, offs)
    assert torch.equal(starts.long(), offs.long() - counts)


@pytest.mark.parametrize("E,H,I,k,shared,norm", SHAPES)
def test_expert_kernels_match_the_torch_layer(E, H, I, k, shared, norm, monkeypatch):
    cuda_moe = kernels()
    from models.kernels.cuda import base as cuda_base
    m = bf16_layer(E, H, I, k, shared, norm)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused = m(x).float()
        models.fuse(m)  # the router's rows and the shared gate's row in one GEMV; the shared expert's
        assert hasattr(m, "router_rows") == bool(shared)  # gate/up: one more expert where I matches
        # the fused GEMV rounds the same sums in another order: within one bf16 step of the largest output
        assert float((m(x).float() - fused).abs().max()) <= 2 ** -7 * float(fused.abs().max())
        monkeypatch.setattr(cuda_base, "ENABLED", False)
        idx, w = m.gate(x)  # torch's routing (the kernel's breaks ties to the lower id)
        plain = m(x).float()
        monkeypatch.setattr(cuda_base, "ENABLED", True)
        args = (m.shared_expert(x), m.shared_expert_gate(x)) if shared else (None, None)
        direct = cuda_moe.experts(x, m.experts.gate_up_proj, m.experts.down_proj, idx, w, *args).float()
    scale = float(plain.abs().max())
    assert float((direct - plain).abs().max()) <= 0.02 * scale  # the same experts, chosen by torch
    with torch.no_grad():  # the whole layer routes by itself: comparable where no two probabilities tie at k
        probs = torch.nn.functional.linear(x, m.gate.weight).float().softmax(-1).sort(descending=True).values
    if probs[0, k - 1] != probs[0, k]:
        assert float((fused - plain).abs().max()) <= 0.02 * scale


@functools.cache
def _grouped_layer(E, I):  # (one layer per shape for the cases below: none of them changes it)
    return bf16_layer(E, 2048, I, 8, 512, True)


@pytest.mark.parametrize("T", [2, 65, 2048])
@pytest.mark.parametrize("E,I", [(256, 512), (128, 768)])
@pytest.mark.parametrize("triton_gemms", [True, False])
def test_grouped_prefill_matches_the_loop_in_bf16(T, E, I, triton_gemms, monkeypatch):
    """The grouped prefill by grouped.py's GEMMs (the default) and by torch._grouped_mm over the
    sorted copy of the rows, against the per-expert loop."""
    from models.kernels.cuda import grouped as cuda_grouped
    monkeypatch.setattr(moe, "TRITON_GROUPED", triton_gemms)
    m = _grouped_layer(E, I)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    assert moe.grouped_serves(x, I) and cuda_grouped.fits(2048, I)
    with torch.no_grad():
        idx, w = m.gate(x)
        grouped = m.experts.grouped(x, idx, w).float()
        moe.EXPERTS_FORM = "loop"
        try:
            loop = m.experts(x, idx, w).float()
        finally:
            moe.EXPERTS_FORM = "grouped"
    assert float((grouped - loop).abs().max()) <= 0.02 * float(loop.abs().max())
    assert torch.equal(grouped, m.experts.grouped(x, idx, w).float())  # no atomics: the same bits


@pytest.mark.parametrize("T", [65, 2048])
@pytest.mark.parametrize("E,I", [(256, 512), (128, 768)])
def test_half_tiles_give_the_bits_of_whole_tiles(T, E, I, monkeypatch):
    """grouped.py's half tiles (an expert's last tile of at most BLOCK_M / 2 rows) multiply as the
    whole tile does: the same h and ys, bit for bit, with grouped.HALF_TILES off; and some tile
    here is a half tile (the 2k prefill: about half the experts spill a few rows into one)."""
    cuda_moe = kernels()
    from models.kernels.cuda import grouped as cuda_grouped
    m = _grouped_layer(E, I)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        idx, w = m.gate(x)
        src, inv, starts, offs = cuda_moe.sort_pairs(x, idx, E, copy=False)
        last = (offs - starts) % cuda_grouped.GATE_UP_CONFIG[0]
        assert bool(((last > 0) & (last <= cuda_grouped.GATE_UP_CONFIG[0] // 2)).any())
        h = cuda_grouped.gate_up(x, src, starts, offs, m.experts.gate_up_proj)
        ys = cuda_grouped.down(h, starts, offs, m.experts.down_proj)
        monkeypatch.setattr(cuda_grouped, "HALF_TILES", False)
        assert torch.equal(h, cuda_grouped.gate_up(x, src, starts, offs, m.experts.gate_up_proj))
        assert torch.equal(ys, cuda_grouped.down(h, starts, offs, m.experts.down_proj))


@pytest.mark.parametrize("T", [2, 65, 700])
def test_prefill_with_the_shared_expert_in_the_combine(T):
    """A fused layer's prefill (SparseMoe.forward: the router's and the shared gate's logits from
    one GEMM, the gated shared output added in combine) against its parts: the routed experts'
    grouped form on the same routing (test_grouped_prefill_matches_the_loop_in_bf16 checks it
    against the loop) plus sigmoid(the shared gate's logit) * the shared expert, in fp32.
    (Routing the fp32 layer separately would choose other experts at near ties.)"""
    cuda_moe = kernels()
    m = bf16_layer(256, 2048, 512, 8, 512, True, seed=2)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        models.fuse(m)
        assert hasattr(m, "router_rows") and m.grouped_on_cuda(x)
        got = m(x).float()
        assert torch.equal(got, m(x).float())  # no atomics: the same bits
        logits = torch.nn.functional.linear(x, m.router_rows)
        idx, w = cuda_moe.route(logits, 8, True, 256)
        want = m.experts.grouped(x, idx, w).float() + torch.sigmoid(logits[:, 256:257].float()) * m.shared_expert(x).float()
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max()), float((got - want).abs().max())


@pytest.mark.parametrize("T", [2, 65, 700])
@pytest.mark.parametrize("shared", [False, True])
def test_combine_joined_with_the_next_add_norm_gives_the_two_launches_bits(T, shared):
    """cuda_moe.combine_add_rms_norm against combine and then base.add_rms_norm, at the MoE
    shapes' hidden size, with and without a shared expert, normed rows in bf16 and in fp32 (the
    final norm's)."""
    cuda_moe = kernels()
    from models.kernels.cuda import base as cuda_base
    H, k = 2048, 8
    g = torch.Generator(device="cuda").manual_seed(T)
    ys = torch.randn(T * k, H, device="cuda", generator=g).bfloat16()
    inv = torch.randperm(T * k, device="cuda", generator=g)
    w = torch.rand(T, k, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    extra = (torch.randn(T, H, device="cuda", generator=g).bfloat16(),
             torch.randn(T, 264, device="cuda", generator=g).bfloat16()[:, 256:257]) if shared else ()
    for nw in (torch.rand(H, device="cuda", generator=g) + 0.5, (torch.rand(H, device="cuda", generator=g) + 0.5).bfloat16()):
        for out in (None, torch.float32):
            want = cuda_base.add_rms_norm(x, cuda_moe.combine(ys, inv, w, *extra), nw, 1e-6, out_dtype=out)
            got = cuda_moe.combine_add_rms_norm(ys, inv, w, x, nw, 1e-6, *extra, out_dtype=out)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def wide_moe_models(tmp_path_factory):
    """The tiny MoE models at hidden 128 and expert size 64: multiples of grouped.py's BLOCK_K, so
    their prefill takes its GEMMs and the combine joined with the next norm (moe.branch)."""
    from tiny import hf_model, write_checkpoint
    sizes = dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)),
                                               model=hf_model(kind, **sizes)), "cuda", torch.bfloat16)
            for kind in ("qwen3_5_moe", "qwen3_moe")}


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_the_combine_joined_with_the_next_norm_changes_no_bit(wide_moe_models, monkeypatch, kind):
    """A prefill (and the steps after it) with each MoE layer's combine in the next add_norm's
    launch, against the combine as its own launch (moe.FUSED_COMBINE off): the same logits bit
    for bit, and the joined launch taken."""
    cuda_moe = kernels()
    lm = wide_moe_models[kind]
    calls = []
    real = cuda_moe.combine_add_rms_norm
    monkeypatch.setattr(cuda_moe, "combine_add_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run():
        s = DecodeSession(lm.model, max_context=160, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        first = s.prefill(list(range(3, 90)))[-1]
        later = s.prefill(list(range(5, 40)))[-1]  # a later turn's prefill, over the cached prefix
        return torch.stack([first, later] + [s.step(t)[-1] for t in (5, 6, 7)])

    fused = run()
    assert calls
    n = len(calls)
    monkeypatch.setattr(moe, "FUSED_COMBINE", False)
    plain = run()
    assert len(calls) == n
    assert torch.equal(fused, plain)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from tiny import hf_model, write_checkpoint
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind)),
                              "cuda", torch.bfloat16)
            for kind in ("qwen3_5_moe", "qwen3_moe")}


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_moe_graphs_on_off_identical(moe_models, kind):
    lm = moe_models[kind]
    base = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [base, base[:25] + [7, 8, 9], base]

    def run(graph, cfg):
        s = DecodeSession(lm.model, max_context=256, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph=graph)
        assert (s.graph is not None) == (graph == "on")
        return [list(s.generate(p, cfg)) for p in prompts]

    for cfg in (SamplingConfig(temperature=0, max_new_tokens=24),
                SamplingConfig(temperature=0.8, seed=5, max_new_tokens=24)):
        on = run("on", cfg)
        assert on == run("off", cfg) and on[0] == on[2]


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_moe_kernels_keep_the_model_close_to_the_torch_forms(moe_models, monkeypatch, kind):
    kernels()
    from models.kernels.cuda import base as cuda_base
    lm = moe_models[kind]

    def step_logits():
        s = DecodeSession(lm.model, max_context=96, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        first = s.prefill(list(range(3, 40)))[-1]
        return torch.stack([first] + [s.step(t)[-1] for t in (5, 6, 7, 8)])

    fused = step_logits()
    monkeypatch.setattr(cuda_base, "ENABLED", False)
    plain = step_logits()
    assert float((fused - plain).abs().max()) <= 0.05 * float(plain.abs().max()) + 0.05


def test_decode_step_reads_no_value_on_the_host(moe_models):
    """The MoE step is capturable: a CUDA graph of one decode step records without a sync."""
    lm = moe_models["qwen3_5_moe"]
    s = DecodeSession(lm.model, max_context=64, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph="on")
    assert s.graph is not None
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    layer = lm.model.model.layers[0].mlp
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("gate_type,down_type,shared", [("Q4_K", "Q4_K", 256), ("Q4_K", "Q6_K", 256),
                                                        ("Q4_K", "Q4_K", 0), ("Q5_K", "Q6_K", 256),
                                                        ("Q4_K", "Q8_0", 256)])
def test_k_quant_experts_decode_on_the_device_as_their_torch_form(gate_type, down_type, shared, monkeypatch):
    """A layer whose routed experts come from a GGUF in K-quants (quant.PlanarExperts, as the
    loader builds them on CUDA: Q4_K_M's Q4_K and Q6_K halves, Q5_K_M's Q5_K; a Q8_0 half dense):
    one token through the routing and qplanar.py's expert GEMVs (kernels/cuda/moe.py's down launch
    for a dense half), with no host sync, against the torch form on the same weights (the same
    experts chosen)."""
    kernels()
    from models.quant import layers as quant
    from models.kernels.cuda import base as cuda_base
    from test_qplanar import PLANAR_LAYOUTS, gguf_experts
    E, H, I, k = 8, 256, 256, 3
    m = bf16_layer(E, H, I, k, shared, True, seed=1)
    m.experts = quant.PlanarExperts.from_gguf(gguf_experts(E, I, H, down_type, gate_type=gate_type), torch.device("cuda"),
                                              torch.bfloat16)
    assert set(m.experts.planar_halves) == {h for h, t in (("gate_up", gate_type), ("down", down_type))
                                            if t in PLANAR_LAYOUTS}
    models.fuse(m)
    assert moe.decode_serves(m.experts)
    g = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(20):  # an input with no tie at k (both forms then choose the same experts)
        x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            probs = torch.nn.functional.linear(x, m.gate.weight).float().softmax(-1).sort(descending=True).values
        if probs[0, k - 1] != probs[0, k]:
            break
    with torch.no_grad():
        fused = m(x).float()  # (the kernels compiled; then again, with no host sync allowed: the same bits)
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = m(x).float()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(fused, again)
        monkeypatch.setattr(cuda_base, "ENABLED", False)
        plain = m(x).float()
    assert float((fused - plain).abs().max()) <= 0.02 * float(plain.abs().max())
