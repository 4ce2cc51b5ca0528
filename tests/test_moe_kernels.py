"""The MoE MLP's forms against each other (models/architectures/moe.py): the per-expert loop (the
oracle, as transformers computes it), grouped GEMMs over tokens sorted by expert (prefill), the
gather of the chosen experts (CPU decode), and the Triton decode kernels (models/kernels/cuda/
moe.py) run by Triton's interpreter on the CPU where Triton is importable (PYTHONPATH); on the
device, tests/test_moe_gpu.py compares the compiled kernels."""
import importlib.util

import pytest
import torch

from interpreted import run_interpreted
from models.architectures import moe


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
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from models.architectures import layers
from models.kernels.cuda import moe as kernels
from test_moe_kernels import layer
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
from test_moe_kernels import forms
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
