"""The MoE MLP's forms against each other (models/architectures/moe.py): the per-expert loop (the
oracle, as transformers computes it), grouped GEMMs over tokens sorted by expert (prefill), the
gather of the chosen experts (CPU decode), and the Triton decode kernels (models/kernels/cuda/
moe.py) run by Triton's interpreter on the CPU where Triton is importable (PYTHONPATH).
On CUDA (gpu-marked): the compiled decode kernels and the grouped-GEMM prefill against their torch
forms at the benchmark shapes and odd ones, and tiny MoE models whose decode step runs them inside
the CUDA graph: graphs on and off give identical tokens, close to the torch forms."""
import importlib.util

import pytest
import torch

from models.architectures import moe
import functools
import models
from models.kernels import switch as switch_kernels
from engine.config import SamplingConfig
from engine.session import DecodeSession

from tests.support.interpreted import run_interpreted


def layer(E=8, H=64, I=32, k=3, shared=48, norm=True, seed=0):
    torch.manual_seed(seed)
    m = moe.SparseMoe(H, E, k, I, norm, shared)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.eval()


def forms(m, x, form):
    idx, w = m.gate(x)
    old = moe.EXPERTS_FORM
    moe.EXPERTS_FORM = form
    try:
        return m.experts(x, idx, w)
    finally:
        moe.EXPERTS_FORM = old


@pytest.mark.parametrize("T", [2, 31, 64, 65, 200])
def test_grouped_gemms_equal_the_per_expert_loop(T):
    m = layer(seed=T)
    x = torch.randn(T, 64)
    assert moe.grouped_serves(x, 32)
    assert (forms(m, x, "grouped") - forms(m, x, "loop")).abs().max() <= 1e-5


def test_grouped_gemms_with_experts_no_token_chose():
    """Two tokens, 16 experts, top 2: most experts have an empty row range."""
    m = layer(E=16, k=2, seed=3)
    x = torch.randn(2, 64)
    assert (forms(m, x, "grouped") - forms(m, x, "loop")).abs().max() <= 1e-5


def test_grouped_gemms_in_bf16_stay_close():
    m = layer(seed=4).to(torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    a, b = forms(m, x, "grouped").float(), forms(m, x, "loop").float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_decode_gather_equals_the_loop_on_one_token():
    m = layer(seed=5)
    x = torch.randn(1, 64)
    idx, w = m.gate(x)
    loop = torch.zeros_like(x)
    for slot, e in enumerate(idx[0].tolist()):
        gate, up = torch.nn.functional.linear(x, m.experts.gate_up_proj[e]).chunk(2, dim=-1)
        loop += w[0, slot] * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, m.experts.down_proj[e])
    assert (m.experts(x, idx, w) - loop).abs().max() <= 1e-5


INTERPRETED = r"""
import sys, torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from models.architectures import layers
from models.kernels.cuda import moe as kernels
from tests.kernels.test_moe_kernels import layer
for E, H, I, k, shared, norm in [(8, 64, 32, 3, 48, True), (6, 40, 24, 2, 0, False), (16, 72, 40, 5, 24, True),
                                  (8, 64, 32, 3, 32, True)]:
    m = layer(E, H, I, k, shared, norm, seed=E)
    x = torch.randn(1, H)
    logits = F.linear(x, m.gate.weight)
    idx, w = kernels.route(logits, k, norm)
    ref_idx, ref_w = m.gate(x)
    assert idx.tolist() == ref_idx.tolist(), (idx, ref_idx)
    assert (w - ref_w).abs().max() <= 1e-6
    # several K steps, rolled and unrolled, down expert by expert and in the wide form; else pick_config's
    blocks = {"config": ((16, 16, 8, 1), (16, 16, 8, 2)) if shared == 48 else ((16, 16, 8, 2), (4, 16, 2, 1, True))} \
        if E == 8 else {}
    ref = m(x)
    se = m.shared_expert if shared else None
    ways = [{}] if not shared else [
        {"shared": se(x), "shared_gate": m.shared_expert_gate(x)},  # its output added in the epilogue
        {"shared_gate": m.shared_expert_gate(x), "shared_down": se.down_proj.weight.data,  # one more expert
         "shared_gate_up": torch.cat([se.gate_proj.weight, se.up_proj.weight]).data}]
    for way in ways:
        if way.get("shared_gate_up") is not None and way["shared_gate_up"].shape[0] != 2 * I:
            continue  # (the kernel takes the shared expert as an expert only at the experts' size)
        out = kernels.experts(x, m.experts.gate_up_proj.data, m.experts.down_proj.data, idx, w, **way, **blocks)
        assert (out - ref).abs().max() <= 1e-5, float((out - ref).abs().max())
    # Granite's: an ungated shared output added to the rounded routed sum, then the residual
    # multiplier, each rounded as torch rounds it: the same bits as the two torch operations (in fp16:
    # the interpreter rounds fp32 to bf16 toward zero, the GPU and torch to nearest even)
    xb, gu, dn = x.half(), m.experts.gate_up_proj.data.half(), m.experts.down_proj.data.half()
    plain = torch.randn(1, H).half()
    routed = kernels.experts(xb, gu, dn, idx, w, **blocks)
    got = kernels.experts(xb, gu, dn, idx, w, plain, scale=0.22, **blocks)
    assert torch.equal(got, (routed + plain) * 0.22)
    # Granite's shared MLP (twice and once the experts' width) as that many more experts of both
    # launches, weight 1, the whole sum times the multiplier; and gated (Qwen3.5's form, two parts)
    for parts in (1, 2):
        mlp = layers.SwiGLU(H, parts * I)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        sgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).data
        routed = kernels.experts(x, m.experts.gate_up_proj.data, m.experts.down_proj.data, idx, w, **blocks)
        got = kernels.experts(x, m.experts.gate_up_proj.data, m.experts.down_proj.data, idx, w, shared_gate_up=sgu,
                              shared_down=mlp.down_proj.weight.data, scale=0.22, **blocks)
        assert (got - (routed + mlp(x)) * 0.22).abs().max() <= 1e-5
        logit = torch.randn(1, 1)
        got = kernels.experts(x, m.experts.gate_up_proj.data, m.experts.down_proj.data, idx, w, shared_gate=logit,
                              shared_gate_up=sgu, shared_down=mlp.down_proj.weight.data, **blocks)
        assert (got - (routed + torch.sigmoid(logit) * mlp(x))).abs().max() <= 1e-5
# the grouped prefill's kernels: the SwiGLU between its GEMMs and the weighted sum after them
from models.kernels.cuda import base
gu = torch.randn(37, 2 * 1500)
g, u = gu.chunk(2, dim=-1)
assert (base.silu_mul(gu) - F.silu(g) * u).abs().max() <= 1e-5
for T, k, H in [(19, 3, 1100), (5, 8, 64)]:
    ys = torch.randn(T * k, H)
    order = torch.randperm(T * k)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(T * k)
    w = torch.rand(T, k)
    y = torch.empty_like(ys)
    y[order] = ys
    assert (kernels.combine(ys, inv, w) - (y.view(T, k, -1) * w[..., None]).sum(1)).abs().max() <= 1e-5
    # with a shared expert's output and its gate's logits (a column of the fused router's logits)
    shared, logits = torch.randn(T, H), torch.randn(T, 9) * 3
    want = (y.view(T, k, -1) * w[..., None]).sum(1) + torch.sigmoid(logits[:, 8:]) * shared
    assert (kernels.combine(ys, inv, w, shared, logits[:, 8:]) - want).abs().max() <= 1e-5
    # the combine joined with the next residual add and RMSNorm: the bits of the two launches
    for dtype in (torch.float32, torch.bfloat16):
        ysd, xd, sh = ys.to(dtype), torch.randn(T, H).to(dtype), shared.to(dtype)
        nw, out = torch.rand(H) + 0.5, torch.float32 if dtype == torch.bfloat16 else None
        for extra in ((), (sh, logits[:, 8:])):
            want_s, want_n = base.add_rms_norm(xd, kernels.combine(ysd, inv, w, *extra), nw, 1e-6, out_dtype=out)
            got_s, got_n = kernels.combine_add_rms_norm(ysd, inv, w, xd, nw, 1e-6, *extra, out_dtype=out)
            assert torch.equal(got_s, want_s) and torch.equal(got_n, want_n)
            # the last token's rows alone (`first`: a prefill's last row), the same bits as its row of all
            last = kernels.combine(ysd, inv, w, *extra, first=T - 1)
            assert torch.equal(last, kernels.combine(ysd, inv, w, *extra)[-1:])
            last_s, last_n = kernels.combine_add_rms_norm(ysd, inv, w, xd[-1:], nw, 1e-6, *extra, out_dtype=out,
                                                          first=T - 1)
            assert torch.equal(last_s, want_s[-1:]) and torch.equal(last_n, want_n[-1:])
# the grouped prefill's routing (a program a token) and sort: the rows, their order and the
# experts' bounds exactly as the torch form's stable argsort; several sub-blocks (SORT_SUB pairs),
# several scan programs (E > SCAN_EXPERTS) and steps (more than 128 sub-blocks), column steps (H > 256),
# experts nobody chose
for T, k, E, H in [(1, 2, 8, 40), (31, 3, 16, 600), (200, 8, 200, 130), (1100, 8, 40, 24), (7, 6, 512, 16)]:
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g)
    idx, w = kernels.route(logits, k, True)
    ref_w, ref_idx = logits.softmax(-1).topk(k, dim=-1)
    assert torch.equal(idx, ref_idx) and (w - ref_w / ref_w.sum(-1, keepdim=True)).abs().max() <= 1e-6
    if T == 200:  # most experts unchosen: ids from a few
        idx = torch.randint(0, 5, (T, k), generator=g) * 37
    x = torch.randn(T + 3, H, generator=g)[:T]  # (rows of a larger tensor)
    xs, inv, offs = kernels.sort_pairs(x, idx, E)
    order = idx.reshape(-1).argsort(stable=True)
    assert torch.equal(xs, x[order // k])
    assert torch.equal(inv[order], torch.arange(T * k))
    assert torch.equal(offs.long(), torch.bincount(idx.reshape(-1), minlength=E).cumsum(0))
    # without the rows' copy: each sorted row's token, and where each expert's rows begin
    src, inv2, starts, offs2 = kernels.sort_pairs(x, idx, E, copy=False)
    assert torch.equal(src.long(), order // k) and torch.equal(inv2, inv) and torch.equal(offs2, offs)
    assert torch.equal(starts.long(), offs.long() - torch.bincount(idx.reshape(-1), minlength=E))
# grouped.py's GEMMs (x's rows read in place, SwiGLU in the epilogue) through the sort and combine,
# against the per-expert loop: row tiles cut mid-way, several per expert, experts nobody chose,
# column tiles past I (masked), several K steps
from models.kernels.cuda import grouped
from tests.kernels.test_moe_kernels import forms
for E, H, I, k, T, cfg in [(8, 64, 32, 3, 40, (16, 16, 16, 4, 1)), (6, 32, 48, 2, 70, (32, 32, 16, 4, 1)),
                            (16, 64, 32, 4, 3, (16, 32, 32, 4, 1)), (5, 32, 32, 2, 190, (64, 32, 16, 4, 1))]:
    m = layer(E, H, I, k, 0, True, seed=T)
    x = torch.randn(T + 2, H)[:T]
    idx, w = m.gate(x)
    src, inv, starts, offs = kernels.sort_pairs(x, idx, E, copy=False)
    h = grouped.gate_up(x, src, starts, offs, m.experts.gate_up_proj.data, cfg)
    ys = grouped.down(h, starts, offs, m.experts.down_proj.data, cfg)
    err = (kernels.combine(ys, inv, w) - forms(m, x, "loop")).abs().max()
    assert err <= 1e-4, (E, H, I, T, float(err))
    # an expert's last tile of at most BLOCK_M / 2 rows takes the half tile: the same rows
    last = (offs - starts) % cfg[0]
    if cfg[0] >= 32:
        assert bool(((last > 0) & (last <= cfg[0] // 2)).any())  # (some tile here is a half tile)
        grouped.HALF_TILES = False
        whole_h = grouped.gate_up(x, src, starts, offs, m.experts.gate_up_proj.data, cfg)
        whole_ys = grouped.down(h, starts, offs, m.experts.down_proj.data, cfg)
        grouped.HALF_TILES = True
        assert (whole_h - h).abs().max() <= 1e-5 and (whole_ys - ys).abs().max() <= 1e-5
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not importable here")
def test_triton_decode_kernels_under_the_interpreter_equal_the_torch_layer():
    run_interpreted(INTERPRETED)


@pytest.mark.parametrize("res,K,N", [(True, 256, 24), (False, 200, 9), (True, 2048, 129)])
def test_router_gemv_writes_the_normed_row(device, res, K, N):
    """linear.gemv_and_row on a NormedRow (an MoE layer's router GEMV on CUDA, whose experts
    read the normed row next): the row its prologue writes is add_rms_norm's up to the order its
    mean square is summed in, the stream is x + res, the logits are the linear map of that row,
    and a later materialize() returns that row (no add_rms_norm launch)."""
    from models.kernels.cuda import base as cuda_base, linear as cuda_linear
    if device.type != "cuda":
        pytest.skip("the dense GEMV runs on CUDA only (Triton's interpreter takes no runtime bound for its K loop)")
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(K)
    x = torch.randn(1, K, generator=g).to(device, dtype)
    r = torch.randn(1, K, generator=g).to(device, dtype) if res else None
    nw = (torch.rand(K, generator=g) + 0.5).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    row = cuda_linear.NormedRow(x, r, nw, 1e-6)
    logits, h = cuda_linear.gemv_and_row(row, w)
    s, ref = cuda_base.add_rms_norm(x, r if res else torch.zeros_like(x), nw, 1e-6)
    assert torch.equal(row.stream, s) and row.materialize() is h
    assert bool(((h.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs()).all())  # one bf16 rounding
    # (the GEMV multiplies the row before its bf16 rounding: 2^-9 of each product, and 2^-9 of its output)
    want = h.double() @ w.double().t()
    assert bool(((logits.double() - want).abs() <= 2 ** -8 * (h.double().abs() @ w.double().abs().t())
                 + 2 ** -8 * want.abs()).all())
    plain, again = cuda_linear.gemv_and_row(h, w)
    assert again is h and torch.equal(plain, cuda_linear.gemv(h, w))


def test_pick_config_takes_the_wide_down_only_up_to_its_bound():
    """The wide down form unrolls its loop over all of I: taken at the timed sizes, not above
    moe.WIDE_MAX_I (the expert-by-expert loop there)."""
    from models.kernels.cuda import moe
    assert moe.pick_config(2048, 768)[1][4] and moe.pick_config(2048, 512)[1][4]
    assert moe.pick_config(2048, moe.WIDE_MAX_I)[1][4]
    assert not moe.pick_config(4096, moe.WIDE_MAX_I + 128)[1][4]


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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,k,shared,norm", SHAPES)
def test_expert_kernels_match_the_torch_layer(E, H, I, k, shared, norm, monkeypatch):
    cuda_moe = kernels()
    m = bf16_layer(E, H, I, k, shared, norm)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused = m(x).float()
        models.fuse(m)  # the router's rows and the shared gate's row in one GEMV; the shared expert's
        assert hasattr(m, "router_rows") == bool(shared)  # gate/up: one more expert where I matches
        # the fused GEMV rounds the same sums in another order: within one bf16 step of the largest output
        assert float((m(x).float() - fused).abs().max()) <= 2 ** -7 * float(fused.abs().max())
        switch_kernels(triton=False)
        idx, w = m.gate(x)  # torch's routing (the kernel's breaks ties to the lower id)
        plain = m(x).float()
        switch_kernels(triton=True)
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    from tests.support.tiny import hf_model, write_checkpoint
    sizes = dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)),
                                               model=hf_model(kind, **sizes)), "cuda", torch.bfloat16)
            for kind in ("qwen3_5_moe", "qwen3_moe")}


@pytest.mark.gpu
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
    from tests.support.tiny import hf_model, write_checkpoint
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf_model(kind)),
                              "cuda", torch.bfloat16)
            for kind in ("qwen3_5_moe", "qwen3_moe")}


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_moe_kernels_keep_the_model_close_to_the_torch_forms(moe_models, monkeypatch, kind):
    kernels()
    lm = moe_models[kind]

    def step_logits():
        s = DecodeSession(lm.model, max_context=96, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        first = s.prefill(list(range(3, 40)))[-1]
        return torch.stack([first] + [s.step(t)[-1] for t in (5, 6, 7, 8)])

    fused = step_logits()
    switch_kernels(triton=False)
    plain = step_logits()
    assert float((fused - plain).abs().max()) <= 0.05 * float(plain.abs().max()) + 0.05


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    from tests.support.quant import PLANAR_LAYOUTS, gguf_experts
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
        switch_kernels(triton=False)
        plain = m(x).float()
    assert float((fused - plain).abs().max()) <= 0.02 * float(plain.abs().max())
