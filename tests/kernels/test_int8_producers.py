"""The launches that make a runs GEMV's int8 input alongside their own output (qruns.FUSED_INT8):
the SwiGLU pair's runs GEMV (its down's input), the attention merge (o_proj's) and the Gated
DeltaNet step (out_proj's). Each must write quantize_input's words of its output bit for bit (so
a model computes the same bits with the fusion on and off), leave its output as it was, and
leave the counters it meets through at zero.

Kernel tests on CUDA (`gpu`) and under Triton's interpreter (TRITON_INTERPRET=1), where programs
run one after another; the model tests on CUDA: a tiny Q4_K llama, Q5_0 qwen2 and GPTQ qwen3_5,
their logits with the fusion on and off, in a CUDA graph and eagerly.
"""
import importlib.util
import os

import pytest
import torch

from tests.support.quant import weight


def _words(row):
    """The int8 words a launch returned its row with (NormedRow.made), and the row."""
    from models.kernels.cuda.linear import NormedRow
    from models.kernels.cuda import qruns
    assert isinstance(row, NormedRow) and row._h is not None and qruns.INT8_RUNS in row.forms
    return row.forms[qruns.INT8_RUNS], row._h


@pytest.mark.parametrize("kind,n,k,group,swiglu", [("Q4KR", 128, 512, 32, True), ("Q50R", 192, 576, 32, True),
                                                  ("INT4", 96, 1024, 128, False), ("Q51R", 64, 96, 32, True)])
def test_a_runs_gemv_makes_its_outputs_int8_words(device, kind, n, k, group, swiglu):
    """On every tile whose rows divide a run (1 to 16 rows a program, so 2 to 32 programs meet on
    a run): the output as without, its words quantize_input's, the counters back at zero, twice
    in a row; a tile of 64 rows, which no run divides, returns the output alone."""
    from models.kernels.cuda import qruns
    qw, _ = weight(kind, n, k, 1, device, group)
    n_out = n // 2 if swiglu else n
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        for config in (None, (1, 1, False), (2, 2, True), (4, 1, True), (8, 4, True), (16, 1, False)):
            for _ in range(2):
                x = torch.randn(1, k, generator=g).to(device, dtype)
                x[0, :32] *= 1e3  # (runs of other scales)
                plain = qruns.gemv(x, qw, swiglu=swiglu, int8=True, config=config)
                words, y = _words(qruns.gemv(x, qw, swiglu=swiglu, int8=True, config=config, int8_out=True))
                assert y.shape == (1, n_out) and torch.equal(y, plain), (config, dtype)
                assert torch.equal(words, qruns.quantize_input(plain)), (config, dtype)
                assert int(qruns.counters(x.device).abs().sum()) == 0
        out = qruns.gemv(x, qw, swiglu=swiglu, int8=True, config=(64, 1, False), int8_out=True)
        assert isinstance(out, torch.Tensor) and torch.equal(out, qruns.gemv(x, qw, swiglu=swiglu, int8=True))


@pytest.mark.parametrize("H,KVH,D", [(4, 2, 64), (6, 2, 128)])
def test_the_attention_merge_makes_its_outputs_int8_words(device, H, KVH, D):
    """Plain and gated (Qwen3.5's): the output's bits as without, and quantize_input's words of it."""
    from models.kernels.cuda import attention as cuda_attention, qruns
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    S = 256
    kc, vc = (torch.randn(KVH, S, D, generator=g) * 3).to(device, dtype), torch.randn(KVH, S, D, generator=g).to(device, dtype)
    q = torch.randn(H, 1, D, generator=g).to(device, dtype)
    gate = torch.randn(1, H * 2 * D, generator=g).to(device, dtype)
    for pos in (0, 77, S - 1):
        p = torch.tensor([pos], device=device)
        for gated in (False, True):
            extra = (gate[:, D:], 2 * D) if gated else ()
            plain = cuda_attention.decode(q, kc, vc, p, *extra)
            words, out = _words(cuda_attention.decode(q, kc, vc, p, *extra, int8_out=True))
            assert torch.equal(out, plain), (pos, gated)
            assert torch.equal(words, qruns.quantize_input(plain)), (pos, gated)


@pytest.mark.parametrize("split", [True, False])
def test_the_delta_step_makes_its_outputs_int8_words(device, split):
    """Split over value columns (the last program of a head writes the head and its words) and one
    program a head: the output and the states as without, quantize_input's words, the counters at zero."""
    from models.kernels.cuda import delta as cuda_delta, qruns
    from tests.support.hybrid import delta_layer_and_states
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer, states = delta_layer_and_states(device, dtype, nk=2, nv=6, dk=64, dv=128, olmo=False)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    sync = cuda_delta.counters(layer.nv, device) if split else None
    outs = []
    for int8_out in (False, True):
        st = {k: v.clone() for k, v in states.items()}
        with torch.inference_mode():
            outs.append((cuda_delta.decode(layer.project_in(x.clone()), st["conv"], layer.conv1d.weight, st["recurrent"],
                                           layer.neg_A, layer.dt_bias32, layer.norm.weight, layer.norm.eps, layer.nk,
                                           layer.nv, layer.dk, layer.dv, sync=sync, int8_out=int8_out), st))
    (plain, st0), (row, st1) = outs
    words, out = _words(row)
    assert torch.equal(out, plain) and all(torch.equal(st0[k], st1[k]) for k in st0)
    assert torch.equal(words, qruns.quantize_input(plain))
    if split:
        assert int(sync.abs().sum()) == 0


def test_reads_int8_asks_for_words_only_where_a_runs_gemv_reads_them(monkeypatch):
    """reads_int8: a QuantLinear of a runs layout (AWQ groups of whole runs) in a 16-bit model, its
    producer among FUSED_INT8; not an fp32 model, not qplanar.A16's inputs as given, not groups
    that are not whole runs (INT4P's), not a bf16 Linear, not a producer left out."""
    from models.kernels.cuda import qplanar, qruns
    from models.plan import bind_forms
    from tests.support.quant import int4_linear
    runs_int4, planar_int4 = int4_linear(8, 256, 128, 0, "cpu"), int4_linear(8, 240, 48, 0, "cpu")
    monkeypatch.setattr(qplanar, "A16", False)
    monkeypatch.setattr(qruns, "FUSED_INT8", frozenset(("merge", "delta")))
    assert not qruns.reads_int8(runs_int4, torch.bfloat16, "merge")  # (its CUDA forms not bound: torch's run)
    assert bind_forms(torch.nn.ModuleList([runs_int4, planar_int4])) == 2
    assert qruns.reads_int8(runs_int4, torch.bfloat16, "merge") and qruns.reads_int8(runs_int4, torch.float16, "delta")
    assert not qruns.reads_int8(runs_int4, torch.bfloat16, "pair")
    assert not qruns.reads_int8(runs_int4, torch.float32, "merge")
    assert not qruns.reads_int8(planar_int4, torch.bfloat16, "merge")
    assert not qruns.reads_int8(torch.nn.Linear(256, 8), torch.bfloat16, "merge")
    monkeypatch.setattr(qplanar, "A16", True)
    assert not qruns.reads_int8(runs_int4, torch.bfloat16, "merge")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's interpreter)")
def test_producers_whose_programs_split_a_run_return_the_row_alone():
    """No words where a program would not own whole runs: a pair of 48 outputs (a run split over
    two tiles' worth of programs at its end), a head of 16 values; the output as without."""
    pytest.importorskip("triton")
    from models.kernels.cuda import attention as cuda_attention, qruns
    cpu = torch.device("cpu")
    qw, _ = weight("Q4KR", 96, 512, 1, cpu)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(2))
    out = qruns.gemv(x, qw, swiglu=True, int8=True, int8_out=True)
    assert isinstance(out, torch.Tensor) and torch.equal(out, qruns.gemv(x, qw, swiglu=True, int8=True))
    g = torch.Generator().manual_seed(3)
    kc, vc, q = torch.randn(2, 64, 16, generator=g), torch.randn(2, 64, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    p = torch.tensor([40])
    got = cuda_attention.decode(q, kc, vc, p, int8_out=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, cuda_attention.decode(q, kc, vc, p))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's interpreter)")
def test_a_made_row_is_its_row_to_every_gemv_and_its_words_to_the_runs_gemv():
    """qruns.carrying(row, words) (a NormedRow.made): the bf16-path GEMV, qlinear.py's (Q6_K blocks), qplanar.py's
    (Q6KP) and the torch forms compute on the row; the runs GEMV on int8 inputs reads the words it
    carries (words of another row give that row's product: not quantized again)."""
    pytest.importorskip("triton")
    from models.quant.layers import QuantLinear
    from models.kernels.cuda import linear, qlinear, qplanar, qruns
    from tests.support.quant import gguf_repack, gguf_weight
    g = torch.Generator().manual_seed(9)
    row = torch.randn(1, 256, generator=g)
    made = qruns.carrying(row, qruns.quantize_input(2 * row))
    w = torch.randn(24, 256, generator=g)
    assert torch.equal(linear.gemv(made, w), linear.gemv(row, w))
    q6, _ = gguf_weight("Q6_K", 24, 256, 1, "cpu")
    assert torch.equal(qlinear.gemv(made, q6), qlinear.gemv(row, q6))
    q6p = gguf_repack("Q6_K")(q6)
    assert torch.equal(qplanar.gemv(made, q6p), qplanar.gemv(row, q6p))
    assert QuantLinear.plain(made) is row
    qw, _ = weight("Q4KR", 24, 256, 1, "cpu")
    assert torch.equal(qruns.gemv(made, qw, int8=True), qruns.gemv(2 * row, qw, int8=True))
    assert not torch.equal(qruns.gemv(made, qw, int8=True), qruns.gemv(row, qw, int8=True))
    assert torch.equal(qruns.gemv(made, qw, int8=False), qruns.gemv(row, qw, int8=False))


def _load(tmp_path, case):
    """A tiny bf16 model on CUDA whose linears are all runs (KernelConfig.runs_min_weights 0)."""
    import models
    from models.plan import KernelConfig
    if case[0] == "gguf":
        from tests.support.blocks import tiny_gguf
        path = tiny_gguf(tmp_path, case[1], case[2])
        return models.load(path, torch.device("cuda"), torch.bfloat16, quantized=True,
                           kernels=KernelConfig(runs_min_weights=0))
    from tests.support.tiny_hf_quant import write_quantized
    qdir, _ = write_quantized(case[1], str(tmp_path), case[2])
    return models.load(qdir, torch.device("cuda"), torch.bfloat16, quantized=True,
                       kernels=KernelConfig(runs_min_weights=0))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama-Q4_K", "qwen2-Q5_0", "qwen3_5-gptq_v2"])
def test_a_model_computes_the_same_bits_with_the_int8_made_by_its_producers(tmp_path, monkeypatch, case):
    """Logits of a prefill and eight decode steps (graph on, then eager), each producer alone, the
    default set and all of them against none: equal bits; and each setting's eager step launches
    as many fewer quantize_input kernels as its producers made words, each producer making alone
    what it makes with the others. Not vacuous: words are made in every model, by the pair and the
    merge in the llama and qwen2 ones, by the delta step in the GPTQ qwen3_5 one (whose b and a rows
    stay bf16: its projections fuse in two groups, test_delta_projections.py; before, they did not
    fuse and the step's kernel did not run, bench/RESULTS.md set AN3)."""
    from gguf import GGMLQuantizationType as Q

    from engine.session import DecodeSession
    from models.kernels.cuda import attention as cuda_attention, base as cuda_base, delta as cuda_delta, qruns
    kind, fmt = case.split("-", 1)
    lm = _load(tmp_path, ("gguf", kind, getattr(Q, fmt)) if fmt.startswith("Q") else ("hf", kind, fmt))
    prompt, steps = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    launched = []
    for mod in (qruns, cuda_attention, cuda_delta):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, *a, _real=cuda_base.launch, **kw:
                            (launched.append((kernel, kw.get("Q8", False))), _real(kernel, grid, *a, **kw))[1])
    maker = {"pair": qruns._runs_gemv_kernel, "merge": cuda_attention._merge_kernel,
             "delta": cuda_delta._delta_step_kernel}
    settings = [(), *((p,) for p in qruns.PRODUCERS), tuple(sorted(qruns.FUSED_INT8)), qruns.PRODUCERS]
    logits, counts = {}, {}
    for fused in settings:
        monkeypatch.setattr(qruns, "FUSED_INT8", frozenset(fused))
        for graph in ("on", "off"):
            s = DecodeSession(lm.model, max_context=128, device=torch.device("cuda"), dtype=torch.bfloat16,
                              cuda_graph=graph)
            s.prefill(prompt)
            launched.clear()
            logits[fused, graph] = torch.stack([s.step(t)[-1].float().clone() for t in steps])
            if graph == "off":
                counts[fused] = (sum(k is qruns._quantize_kernel for k, _ in launched),
                                 {p: sum(q for k, q in launched if k is maker[p]) for p in qruns.PRODUCERS})
    for fused in settings:
        for graph in ("on", "off"):
            assert torch.equal(logits[fused, graph], logits[(), "off"]), (fused, graph)
        quantized, made = counts[fused]
        assert quantized == counts[()][0] - sum(made.values()), (fused, counts)
        assert all(made[p] == 0 for p in qruns.PRODUCERS if p not in fused), (fused, counts)
    assert all(counts[(p,)][1][p] == counts[qruns.PRODUCERS][1][p] for p in qruns.PRODUCERS), counts
    made = counts[qruns.PRODUCERS][1]
    assert sum(made.values()) > 0, counts
    if kind != "qwen3_5":  # (no delta layers; their SwiGLU pairs and merges both make words)
        assert made["pair"] > 0 and made["merge"] > 0 and made["delta"] == 0, counts
    else:
        assert made["delta"] > 0, counts


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton (not interpreted)")
def test_the_producers_compile_for_hopper_without_a_gpu():
    """The merge and delta kernels with their int8 words, and the runs GEMV's counted epilogue
    (its acq_rel atomic), compile to sm_90 binaries (Triton's own ptxas, no device)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import attention as cuda_attention, delta as cuda_delta, qruns
    cases = [(cuda_attention._merge_kernel,
              dict(m_in="*fp32", l_in="*fp32", acc_in="*fp32", gate="*bf16", out="*bf16", q8="*i32"),
              dict(GATE_STRIDE=256, HAS_GATE=gated, D=128, NSPLIT=8, Q8=True, KQ=16 * 128 // 4, PDL=True,
                   INTERPRETED=False)) for gated in (False, True)]
    cases += [(cuda_delta._delta_step_kernel,
               dict(act="*fp32", proj="*bf16", rec="*fp32", neg_A="*fp32", dt_bias="*fp32", norm_w="*bf16",
                    out="*bf16", part="*fp32", ssq="*fp32", sync="*i32", q8="*i32", z_off="i32", b_off="i32",
                    a_off="i32", eps="fp32", q_scale="fp32", beta_scale="fp32"),
               dict(KEY_DIM=2048, R=2, DK=128, DV=128, BV=bv, Q8=True, KQ=48 * 128 // 4, TILED=tiled, PDL=True,
                    INTERPRETED=False))
              for bv in (32, 128) for tiled in (False, True)]
    sig = dict(x="*i32", w="*i32", aux="*i32", aux2="*i16", bias="*bf16", out="*bf16", N="i32", stride_w="i32",
               stride_a="i32", stride_z="i32", q8="*i32", sync="*i32")
    cases += [(qruns._runs_gemv_kernel, sig,
               dict(G=32, RUNS=160, BN=bn, C=32, STEPS=5, EVEN=True, FMT=1, A8=True, HAS_BIAS=False, SWIGLU=True,
                    PREFETCH=True, Q8=True, PDL=True, INTERPRETED=False))
              for bn in (2, 4)]
    for fn, sig, const in cases:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
