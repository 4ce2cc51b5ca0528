"""The Mamba2 Triton kernels (models/kernels/cuda/ssd.py) against the torch forms they replace:
the decode step (conv, scan step, gated norm) against Mamba2Mixer's torch forward, and the
chunked prefill's fused scan against the torch loop and the naive oracle, from non-zero states.

They run on CUDA (`gpu` marker, tests/run_gpu.sh) and, where TRITON_INTERPRET=1 and Triton is
importable, on the CPU under Triton's interpreter (slow: tiny sizes), as they were developed."""
import importlib.util
import os

import pytest
import torch
from torch import nn

from models.architectures import mamba2
from models import kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu),
           pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton"))]


def mixer(device, dtype, groups=2, heads=8, head_dim=16, state=16, seed=0):
    torch.manual_seed(seed)
    m = mamba2.Mamba2Mixer(64, heads, head_dim, state, groups, 4, 1e-5, dt_limit=(0.01, 5.0))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 1.0))
    m = m.to(device=device, dtype=dtype)
    m.reset_buffers(device)
    return m


def states(m, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    conv = (torch.randn(m.conv_dim, m.K - 1, generator=g)).to(device, dtype)
    ssm = (torch.randn(m.H, m.P, m.N, generator=g) * 0.5).to(device)
    return {"conv": conv, "ssm": ssm}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 2])
def test_decode_kernels_match_the_torch_step(device, groups):
    from models.kernels.cuda import ssd
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)) if device == "cuda" else ((torch.float32, 1e-4),):
        m = mixer(device, dtype, groups)
        m.out_proj = nn.Identity()  # compare what reaches out_proj
        st_ref, st = states(m, device, dtype), states(m, device, dtype)
        for t in range(5):  # five steps: the conv window shifts and the state carries between them
            h = torch.randn(1, 64, generator=torch.Generator().manual_seed(10 + t)).to(device, dtype)
            before = kernels.switch(triton=False)
            try:
                ref = m(h, st_ref)  # the torch form
            finally:
                kernels.switch(**before)
            out = ssd.decode(m.in_proj(h).contiguous(), st["conv"], m.conv1d.weight, m.conv1d.bias, st["ssm"], m.A,
                             m.dt_bias32, m.D32, m.norm.weight, m.norm.eps, m.dt_limit, m.H, m.P, m.N, m.G)
            assert out.dtype == dtype and out.shape == ref.shape
            assert (out.float() - ref.float()).abs().max() <= tol * max(1.0, ref.float().abs().max())
            assert torch.equal(st["conv"], st_ref["conv"])
            assert (st["ssm"] - st_ref["ssm"]).abs().max() <= tol * max(1.0, st_ref["ssm"].abs().max())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_chunk_scan_matches_the_loop_and_the_oracle(device):
    sizes = [(1, 16), (17, 16), (40, 16)] if device == "cpu" else [(1, 64), (63, 64), (64, 64), (65, 64), (700, 64)]
    H, P, N, G = (2, 16, 16, 1) if device == "cpu" else (48, 64, 128, 1)
    for T, chunk in sizes:
        x, dt, A, B, C, D, s0 = (t.to(device) for t in mamba2.example_inputs(T, H, P, N, G, seed=T))
        s_loop, s_fused, s_naive = s0.clone(), s0.clone(), s0.clone()
        loop = mamba2.chunked(x, dt, A, B, C, D, s_loop, chunk)
        fused = mamba2.chunked(x, dt, A, B, C, D, s_fused, chunk, fused=True)
        naive = mamba2.naive(x, dt, A, B, C, D, s_naive)
        assert (fused - loop).abs().max() <= 1e-4 and (s_fused - s_loop).abs().max() <= 1e-5, T
        assert (fused - naive).abs().max() <= 1e-3 and (s_fused - s_naive).abs().max() <= 1e-4, T


def _compiled_ssd_kernels() -> int:
    from models.kernels.cuda import base, conv, linear, moe, ssd
    kernels = [ssd._conv_step_kernel, ssd._ssm_step_kernel, ssd._group_norm_kernel, ssd._chunk_scan_kernel,
               moe._route_kernel, moe._gate_up_kernel, moe._down_kernel, moe._down_wide_kernel, moe._combine_kernel,
               moe._count_kernel, moe._scan_kernel, moe._place_kernel, conv._causal_conv_kernel,
               base._silu_mul_kernel, linear._gemv_kernel]
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


@pytest.fixture(scope="module")
def gpu_granite(tmp_path_factory):
    import models
    from tests.support.tiny import write_checkpoint
    path = write_checkpoint("granitemoehybrid", str(tmp_path_factory.mktemp("granite")), hidden_size=96,
                            mamba_d_head=32, mamba_n_heads=6)  # sizes no other test compiles
    return path, models.load(path, "cuda", torch.bfloat16), models.load(path)


@pytest.mark.gpu
def test_mamba2_session_start_compiles_every_kernel_and_graph_on_equals_off(gpu_granite, monkeypatch):
    """On the H200 in bf16: the session's start compiles the Mamba2 kernels (no prompt length or
    later turn compiles another), the kernels serve (decode and prefill), the CUDA graph replays
    what the eager step computes (the same tokens, twice on one session), and the first logits
    stay within bf16 rounding of the CPU's fp32 model."""
    from engine.config import SamplingConfig
    from engine.session import DecodeSession
    from models.kernels.cuda import base as cuda_base, ssd
    _, lm, lm_cpu = gpu_granite
    if not cuda_base.ENABLED or not cuda_base.can_precompile():
        pytest.skip("needs Triton >= 3.4 (the session's precompile)")
    before = _compiled_ssd_kernels()
    on = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"), dtype=torch.bfloat16, cuda_graph="on")
    started = _compiled_ssd_kernels()
    assert started > before
    calls = []
    from models.kernels.cuda import moe
    for mod, name in ((ssd, "decode"), (ssd, "chunk_scan"), (moe, "experts"), (moe, "route")):
        real, key = getattr(mod, name), f"{mod.__name__.rsplit('.', 1)[1]}.{name}"
        # (route's one-token calls apart: a prefill routes through it too)
        monkeypatch.setattr(mod, name, lambda *a, real=real, key=key, **k: calls.append(
            key + ("/prefill" if key == "moe.route" and a[0].shape[0] > 1 else "")) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 64, 65, 130)]
    cfg = SamplingConfig(temperature=0, max_new_tokens=12)
    tokens = [list(on.generate(p, cfg)) for p in prompts]
    assert tokens == [list(on.generate(p, cfg)) for p in prompts]  # the reused session: reset, restore
    assert "ssd.chunk_scan" in calls  # prefill ran the fused scan (decode steps replay the graph)
    assert _compiled_ssd_kernels() == started
    off = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"), dtype=torch.bfloat16,
                        cuda_graph="off")
    calls.clear()
    assert [list(off.generate(p, cfg)) for p in prompts] == tokens
    assert {"ssd.decode", "moe.experts", "moe.route"} <= set(calls)  # the eager step ran the decode kernels
    cpu = DecodeSession(lm_cpu.model, max_context=512, device=torch.device("cpu"), dtype=torch.float32)
    first_gpu = DecodeSession(lm.model, max_context=512, device=torch.device("cuda"),
                              dtype=torch.bfloat16).prefill(prompts[2]).float().cpu()
    first_cpu = cpu.prefill(prompts[2])
    assert (first_gpu - first_cpu).abs().max() <= 0.05 * max(1.0, first_cpu.abs().max())


@pytest.mark.gpu
def test_residual_multiplier_and_shared_mlp_in_the_expert_launches(tmp_path, monkeypatch):
    """Granite's residual multiplier (0.5 here) in the out projections' GEMV epilogue and, with the
    routed and shared MLPs' sum, in the experts' down launch (layers.scaled_linear,
    RoutedExperts.forward), against torch's products after them (layers.FUSED_SCALE off): the same
    logits bit for bit over a prefill, a later turn's prefill and decode steps; the fused forms ran.
    The shared MLP as more experts (SHARED_AS_EXPERTS, its sum in fp32, rounded once) stays as
    close to the CPU's fp32 model as the bf16 forward is held to (the session-start test's bound),
    and takes two launches fewer a layer. (The shared MLP twice the experts' width, as in
    Granite-4.0-H-Tiny, so that it splits into experts.)"""
    import models
    from engine.session import DecodeSession
    from models.architectures import granitemoehybrid, layers
    from models.kernels.cuda import linear, moe
    from tests.support.tiny import write_checkpoint
    path = write_checkpoint("granitemoehybrid", str(tmp_path), hidden_size=96, mamba_d_head=32, mamba_n_heads=6,
                            shared_intermediate_size=64)  # (the experts: 32 wide)
    lm, lm_cpu = models.load(path, "cuda", torch.bfloat16), models.load(path)
    calls = []
    for mod, name in ((linear, "gemv"), (moe, "experts")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: calls.append(
            (name if k.get("scale") not in (None, 1.0) else "") + ("/parts" if k.get("shared_down") is not None
                                                                      else "")) or real(*a, **k))

    def run(model=lm.model, device="cuda", dtype=torch.bfloat16):
        s = DecodeSession(model, max_context=256, device=torch.device(device), dtype=dtype, cuda_graph="off")
        rows = [s.prefill(list(range(3, 70)))[-1], s.prefill(list(range(5, 30)))[-1]]
        return torch.stack(rows + [s.step(t)[-1] for t in (5, 6, 7, 8)]).float().cpu()

    parts = run()
    assert {"gemv", "experts/parts"} <= set(calls)
    n_parts = len(calls)
    monkeypatch.setattr(granitemoehybrid, "SHARED_AS_EXPERTS", False)
    calls.clear()
    fused = run()
    assert {"gemv", "experts"} <= set(calls) and "experts/parts" not in calls
    assert len(calls) > n_parts  # (the shared MLP's two GEMVs a layer)
    calls.clear()
    monkeypatch.setattr(layers, "FUSED_SCALE", False)
    apart = run()
    assert not set(calls) - {""}
    assert torch.equal(fused, apart)
    assert torch.equal(parts[:2], apart[:2])  # (prefill: the torch forms either way)
    ref = run(lm_cpu.model, "cpu", torch.float32)
    bound = 0.05 * max(1.0, float(ref.abs().max()))
    errs = [float((got - ref).abs().max()) for got in (parts, apart)]
    assert max(errs) <= bound, (errs, bound)


@pytest.mark.gpu
def test_granite_norm_before_the_mlps_runs_in_the_router_gemv(gpu_granite, monkeypatch):
    """Granite's norm before its MLPs, deferred (granitemoehybrid.DEFER_MLP_NORM): a one-token step
    computes it in the router GEMV's prologue, which writes the normed row the experts read, so
    no add_rms_norm launches for it (only the attention layers' norms and the final one keep
    theirs); the logits of a prefill and decode steps stay as close to the CPU's fp32 model as
    with the norm in its own launch (the session-start test's bound)."""
    from engine.session import DecodeSession
    from models.architectures import granitemoehybrid
    from models.kernels.cuda import base as cuda_base, linear
    _, lm, lm_cpu = gpu_granite
    norms, prologues = [], []
    real_norm, real_row = cuda_base.add_rms_norm, linear.gemv_and_row
    monkeypatch.setattr(cuda_base, "add_rms_norm", lambda *a, **k: norms.append(1) or real_norm(*a, **k))
    monkeypatch.setattr(linear, "gemv_and_row", lambda x, w: prologues.append(isinstance(x, linear.NormedRow))
                        or real_row(x, w))

    def run(model=lm.model, device="cuda", dtype=torch.bfloat16):
        s = DecodeSession(model, max_context=256, device=torch.device(device), dtype=dtype, cuda_graph="off")
        rows = [s.prefill(list(range(3, 40)))[-1]]
        norms.clear()
        prologues.clear()
        return torch.stack(rows + [s.step(t)[-1] for t in (5, 6, 7)]).float().cpu()

    deferred = run()
    steps = (len(norms), prologues.count(True), len(prologues))
    monkeypatch.setattr(granitemoehybrid, "DEFER_MLP_NORM", False)
    apart = run()
    n_layers = len(lm.model.model.layers)
    assert steps[1] == steps[2] == 3 * n_layers  # every router's GEMV normed its row, three steps
    assert len(norms) == steps[0] + 3 * n_layers  # the launches the prologue saved
    ref = run(lm_cpu.model, "cpu", torch.float32)
    bound = 0.05 * max(1.0, float(ref.abs().max()))
    errs = [float((got - ref).abs().max()) for got in (deferred, apart)]
    assert max(errs) <= bound, (errs, bound)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or INTERPRETED, reason="needs Triton (not interpreted)")
def test_kernels_compile_for_hopper_without_a_gpu():
    """Each kernel compiles to an sm_90 binary at the granite-4.0-h-tiny sizes (Triton's own ptxas,
    no device needed): catches what the interpreter does not run (the compiled scan loop, PDL)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import grouped, linear, moe, scan, ssd
    cases = [
        # (the Gated DeltaNet prefill's triangular solve, compiled here with the others)
        (scan._solve_kernel, dict(system="*fp32", v_beta="*fp32", k_cum="*fp32", u="*fp32", w="*fp32"),
         dict(C=64, DK=128, DV=128, BN=32, PREC="tf32x3")),
        (ssd._chunk_scan_kernel, dict(out="*fp32", c_dec="*fp32", chunk_states="*fp32", chunk_decay="*fp32",
                                      state="*fp32", n="i32"),
         dict(C=64, P=64, N=128, BP=32, PREC="tf32x3", INTERPRETED=False)),
        (ssd._ssm_step_kernel, dict(act="*fp32", proj="*bf16", ssm="*fp32", A="*fp32", dt_bias="*fp32", D="*fp32",
                                    gated="*fp32", dt_off="i32", dt_lo="fp32", dt_hi="fp32"),
         dict(INNER=3072, G=1, R=48, P=64, N=128, PDL=True)),
        (ssd._conv_step_kernel, dict(x="*bf16", state="*bf16", weight="*bf16", bias="*bf16", out="*fp32", C="i32"),
         dict(KM1=3, KP=4, BLOCK=256, HAS_BIAS=True, PDL=True)),
        (ssd._group_norm_kernel, dict(gated="*fp32", weight="*bf16", out="*bf16", eps="fp32"),
         dict(GS=3072, BLOCK=4096, PDL=True)),
        (moe._route_kernel, dict(logits="*bf16", idx_out="*i64", w_out="*fp32", E="i32", stride="i32"),
         dict(TOP_K=6, BLOCK_E=64, BLOCK_K=8, NORM=True, PDL=True)),
        # the grouped prefill's sort by expert
        (moe._count_kernel, dict(idx="*i64", hist="*i32", P="i32", E="i32"), dict(SUB=64, BLOCK_E=64, PDL=True)),
        (moe._scan_kernel, dict(hist="*i32", base="*i32", starts="*i32", offs="*i32", nsub="i32", E="i32"),
         dict(BLOCK_S=128, BLOCK_C=32, PDL=True)),
        (moe._place_kernel, dict(x="*bf16", idx="*i64", base="*i32", starts="*i32", xs="*bf16", inv="*i64", P="i32",
                                 E="i32", stride_x="i32"), dict(H=1536, TOP_K=6, SUB=64, BLOCK_H=128, PDL=True)),
        (moe._gate_up_kernel, dict(x="*bf16", w="*bf16", idx="*i64", h="*fp32", shared_w="*bf16", stride_e="i32"),
         dict(I=512, H=1536, TOP_K=6, SF=1024, BLOCK_N=4, BLOCK_K=512, UNROLL=1, PDL=True)),
        (moe._down_kernel, dict(h="*fp32", w="*bf16", idx="*i64", weights="*fp32", shared="*bf16", shared_w="*bf16",
                                shared_gate="*bf16", out="*bf16", stride_e="i32", scale="fp32"),
         dict(I=512, H=1536, TOP_K=6, SHARED=0, SF=512, BLOCK_N=8, BLOCK_K=256, UNROLL=1, PDL=True)),
        # Granite's: the shared MLP's output added to the routed sum, then the residual multiplier; its
        # weights as two more experts (shared size 1024), the sum times the multiplier
        *((moe._down_wide_kernel, dict(h="*fp32", w="*bf16", idx="*i64", weights="*fp32", shared="*bf16",
                                       shared_w="*bf16", shared_gate="*fp32", out="*bf16", stride_e="i32",
                                       scale="fp32"),
           dict(I=512, H=1536, TOP_K=6, SHARED=mode, SF=1024, SLOTS=8, BLOCK_N=8, BLOCK_K=256, PDL=True))
          for mode in (3, 4)),
        (moe._down_kernel, dict(h="*fp32", w="*bf16", idx="*i64", weights="*fp32", shared="*bf16", shared_w="*bf16",
                                shared_gate="*bf16", out="*bf16", stride_e="i32", scale="fp32"),
         dict(I=512, H=1536, TOP_K=6, SHARED=4, SF=1024, BLOCK_N=8, BLOCK_K=256, UNROLL=1, PDL=True)),
        # the router's GEMV with the norm in its prologue, writing the normed row (linear.gemv_and_row)
        (linear._gemv_kernel, dict(x="*bf16", w="*bf16", bias="*bf16", out="*bf16", N="i32", K="i32", stride_w="i32",
                                   res="*bf16", norm_w="*fp32", sum_out="*bf16", eps="fp32", normed_out="*bf16",
                                   scale="fp32"),
         dict(HAS_BIAS=False, SWIGLU=False, NORM=True, HAS_RES=True, NORM_OUT=True, EVEN=True, SCALE=False,
              BLOCK_N=4, BLOCK_K=2048, PDL=True)),
        # the out projection times Granite's residual multiplier (layers.scaled_linear)
        (linear._gemv_kernel, dict(x="*bf16", w="*bf16", bias="*bf16", out="*bf16", N="i32", K="i32", stride_w="i32",
                                   res="*bf16", norm_w="*bf16", sum_out="*bf16", eps="fp32", normed_out="*bf16",
                                   scale="fp32"),
         dict(HAS_BIAS=False, SWIGLU=False, NORM=False, HAS_RES=False, NORM_OUT=False, EVEN=True, SCALE=True,
              BLOCK_N=4, BLOCK_K=2048, PDL=True)),
        # the grouped prefill's GEMMs, their half tiles included (grouped.py)
        (grouped._gate_up_kernel, dict(x="*bf16", src="*i32", starts="*i32", offs="*i32", w="*bf16", h="*bf16",
                                       E="i32", stride_x="i32", stride_we="i32"),
         dict(I=512, K=1536, BLOCK_E=64, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, HALF=True, PDL=True)),
        (grouped._down_kernel, dict(hs="*bf16", starts="*i32", offs="*i32", w="*bf16", ys="*bf16", E="i32",
                                    stride_we="i32"),
         dict(N=1536, K=512, BLOCK_E=64, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, HALF=True, PDL=True)),
    ]
    for fn, sig, const in cases:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
