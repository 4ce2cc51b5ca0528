"""models/kernels/cuda/qruns.py and models/quant/runs.py: the 4- and 5-bit runs (AWQ/GPTQ's INT4
as stored, GGUF Q4_K repacked as Q4KR, Q5_0 and Q5_1 as Q50R and Q51R) against the weights they encode, and their dequant-GEMV
against the dequantized product (of x~, the input rounded to int8 per 32-input run, where the GEMV
takes int8 inputs), on CUDA (`gpu`) and under Triton's interpreter on the CPU (TRITON_INTERPRET=1
with a Triton on PYTHONPATH; skipped otherwise).
Tolerance: |y - ref| <= 1e-5 * scale + (bf16 output: 2^-8 |ref|), scale = |x| @ |W|^T."""
import copy
import importlib.util
import os

import pytest
import torch

from tests.support.quant import gguf_weight, int4_linear, product_and_tolerance
from tests.support.quant import weight


@pytest.mark.parametrize("n,k", [(10, 512), (37, 256), (8, 1024)])
def test_q4kr_repack_keeps_every_weight(n, k):
    """Q4KR holds Q4_K's every weight (d sc q - dmin m exact in fp32, gguf-py's dequantization to
    the bit) in 4.625 bits a weight against Q4_K's 4.5, and any rows of it decode alone."""
    from models.quant import runs
    qw, ref = gguf_weight("Q4_K", n, k, 0, "cpu")
    pw = runs.repack_q4k(qw)
    assert pw.fmt == "Q4KR" and pw.group == 32 and pw.data.shape == (n, k // 2) and pw.data.dtype == torch.uint8
    assert torch.equal(runs.dequantize(pw), ref)
    assert torch.equal(runs.dequantize_rows(pw, 3, n), ref[3:])
    assert pw.nbytes() == n * (k // 2 + k // 256 * 4 + k // 32 * 2)


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("n,k", [(10, 512), (7, 96), (3, 32)])
def test_q5_repack_keeps_every_weight(fmt, n, k):
    """Q50R / Q51R hold Q5_0's / Q5_1's every weight (gguf-py's dequantization to the bit in fp32,
    fifth bits and extreme scales included) in the blocks' bytes; any rows of them decode alone."""
    from models.formats import gguf_blocks
    from models.quant import runs
    from models.quant.layers import QWeight
    qw, ref = gguf_weight(fmt, n, k, 0, "cpu")
    raw = qw.data.reshape(n, k // 32, -1)
    raw[0, 0, :2] = torch.tensor([65504.0], dtype=torch.float16).view(torch.uint8)  # the largest fp16 scale
    raw[1 % n, -1, :2] = torch.tensor([2.0 ** -24], dtype=torch.float16).view(torch.uint8)  # a subnormal
    high = 4 if fmt == "Q5_1" else 2  # (Q5_1: d, its minimum m, then the fifth bits)
    raw[-1, 0, high:high + 4] = 255  # every fifth bit
    qw = QWeight(fmt, raw.reshape(n, -1), n, k)
    ref = gguf_blocks.dequantize(qw.data, gguf_blocks.TYPES[fmt]).double().reshape(n, k)
    pw = runs.repack_q5(qw)
    assert pw.fmt == runs.FIVE_BIT[fmt] and pw.group == 32 and pw.data.shape == (n, k // 2)
    # (fp64 exact; gguf-py rounds Q5_1's d q + m once to fp32, as the kernels' FMA does)
    assert torch.equal(runs.dequantize(pw).float().double(), ref)
    assert torch.equal(runs.dequantize_rows(pw, n // 2, n).float().double(), ref[n // 2:])
    assert pw.nbytes() == qw.data.numel()
    with pytest.raises(ValueError, match="Q50R"):
        runs.repack_q5(QWeight("Q4_0", qw.data, n, k))


def test_q4kr_repack_refuses_rows_of_part_super_blocks():
    from models.quant import runs
    from models.quant.layers import QWeight
    with pytest.raises(ValueError, match="Q4KR"):
        runs.repack_q4k(QWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 2, 128))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_stored_int4_is_runs(group):
    """AWQ/GPTQ's stored INT4 needs no repack: runs.dequantize reads it as the linear does."""
    from models.quant import runs
    from models.kernels.cuda import qruns
    lin = int4_linear(12, 512, group, 1, "cpu")
    assert qruns.takes(lin.qweight())
    assert torch.equal(runs.dequantize(lin.qweight()), lin.dequantize(torch.float64))
    assert not qruns.takes(int4_linear(4, 64, 16, 1, "cpu").qweight())  # groups of 16: not whole runs


@pytest.mark.parametrize("k", [512, 1024, 96])
def test_quantize_input_is_the_reference(device, k):
    """quantize_input's buffer: the int8 codes in input order, then per run (dx, dx sum q) as fp32,
    for qplanar.quantized_reference(x, 32)'s x~ = q dx; a zero run stays zero and the largest input
    of a run is +-127 dx."""
    from models.kernels.cuda import qplanar, qruns
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, k, generator=g) * torch.logspace(-3, 3, k // 32).repeat_interleave(32)
    x[1, :32] = 0
    x[2, 5] = 1e4
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        buf = qruns.quantize_input(x.to(device, dtype)).cpu()
        assert buf.shape == (3, k // 32 * 10)
        q = buf[:, :k // 4].contiguous().view(torch.int8).double()  # [3, k]
        meta = buf[:, k // 4:].contiguous().view(torch.float32).double().reshape(3, k // 32, 2)
        xt = (q.reshape(3, k // 32, 32) * meta[..., :1]).reshape(3, k)
        ref = qplanar.quantized_reference(x.to(dtype), 32)
        assert torch.equal(xt, ref), (dtype, (xt != ref).nonzero()[:4].tolist(), float((xt - ref).abs().max()))
        xs = (q.reshape(3, k // 32, 32).sum(-1) * meta[..., 0]).float().double()
        assert torch.equal(meta[..., 1], xs), (dtype, (meta[..., 1] != xs).nonzero()[:4].tolist())
        assert float(q[1, :32].abs().sum()) == 0 and float(q[2, 5]) == 127


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("kind,n,k,group,swiglu,bias", [
    ("INT4", 37, 1024, 128, False, False), ("INT4", 40, 2048, 128, True, True), ("INT4", 22, 512, 64, False, True),
    ("INT4", 14, 96, 32, True, False), ("Q4KR", 37, 1024, 32, False, True), ("Q4KR", 40, 512, 32, True, False),
    ("Q4KR", 12, 768, 32, False, False), ("Q4KR", 21, 4864, 32, False, True), ("Q50R", 19, 896, 32, False, True),
    ("Q50R", 12, 576, 32, True, False), ("Q51R", 21, 1024, 32, False, False), ("Q51R", 10, 96, 32, True, True)])
def test_gemv_is_the_dequantized_product(device, kind, n, k, group, swiglu, bias, int8):
    """Against x @ W^T in fp64, or x~ @ W^T with int8 inputs, for every tile shape: rows a program
    from 2 to 8 (a last program of fewer rows), 1-4 warps (K whole steps or a last step part
    runs past the row: 96, 768 and 4,864 weights, the last a small model's down on the pick's 2
    rows and 4 warps), with and without the read ahead."""
    from models.kernels.cuda import qplanar, qruns
    qw, w = weight(kind, n, k, 1, device, group)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(device) if bias else None
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        xd = qplanar.quantized_reference(x, 32).to(device) if int8 else x.double()
        ref, tol = product_and_tolerance(xd, w, b, swiglu, dtype)
        for config in (None, (2, 1, False), (8, 4, True), (4, 2, True), (2, 4, True)):
            out = qruns.gemv(x, qw, b, swiglu=swiglu, out_dtype=dtype, int8=int8, config=config)
            err = (out.double() - ref).abs()
            assert bool((err <= tol).all()), (config, dtype, float((err - tol).max()))


@pytest.mark.parametrize("n,k,swiglu,want", [(896, 4864, False, (2, 4, True)), (2048, 8192, False, (2, 4, True)),
                                             (896, 1024, False, (2, 1, True)), (3000, 2560, False, (2, 2, True)),
                                             (5120, 17408, False, (4, 2, True)), (10240, 5120, False, (8, 1, True)),
                                             (4864, 896, True, (4, 1, True))])
def test_pick_config_gives_a_small_models_down_four_warps(n, k, swiglu, want):
    """Under 4,096 rows (no SwiGLU pair): 2 rows a program on 4 warps, fewer where the row has
    fewer runs than 4 warps' threads (LFM2-1.2B's [2048, 8192] 3.6 us against 4.2 on 2 warps:
    bench/RESULTS.md set AJ); the 27B-like matrices and the pairs as set AF measured them."""
    from models.kernels.cuda import qruns
    assert qruns.pick_config(n, k, swiglu) == want
    # an LM head's rows on the float path (its fp32 row): 16 rows, 1 warp (set AK); on int8 inputs as before
    assert qruns.pick_config(151936, 896, int8=False) == (16, 1, True) != qruns.pick_config(151936, 896)
    assert qruns.pick_config(n, k, swiglu, int8=False) == want  # (under 16,384 rows: the same)


@pytest.mark.parametrize("kind,n,k,group,swiglu", [("INT4", 37, 1024, 128, False), ("Q4KR", 40, 512, 32, True),
                                                  ("INT4", 14, 96, 32, True), ("Q50R", 33, 896, 32, False),
                                                  ("Q51R", 12, 576, 32, True)])
def test_float_path_takes_16_bit_rows(device, kind, n, k, group, swiglu):
    """The float path (int8 False: qplanar.A16) on bf16 and fp16 rows against x @ W^T in
    fp64 (fp32 outputs), for every tile shape."""
    from models.kernels.cuda import qruns
    qw, w = weight(kind, n, k, 1, device, group)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        ref, tol = product_and_tolerance(x.double(), w, None, swiglu, torch.float32)
        for config in (None, (2, 1, False), (8, 4, True), (4, 2, True)):
            out = qruns.gemv(x, qw, swiglu=swiglu, out_dtype=torch.float32, int8=False, config=config)
            err = (out.double() - ref).abs()
            assert bool((err <= tol).all()), (config, dtype, float((err - tol).max()))


@pytest.mark.parametrize("k,res", [(896, True), (640, False), (5120, True), (1152, True)])
@pytest.mark.parametrize("programs", [1, 8])
def test_normed_input_is_add_rms_norm_then_quantize_input(device, k, res, programs, monkeypatch):
    """normed_input's one launch leaves the bits of add_rms_norm then quantize_input: the stream,
    the normed row (signs of zero included), the int8 input; the row's next run GEMV takes the
    same buffer; a GEMV of the NormedRow equals the GEMV of its normed row. In one program or in
    several, each with its share of the runs (K = 1152: 36 runs, programs of 8 and a last of 4)."""
    from models.kernels.cuda import base, qruns
    from models.kernels.cuda.linear import NormedRow
    monkeypatch.setattr(qruns, "NORM_QUANTIZE_PROGRAMS", programs)

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()

    g = torch.Generator().manual_seed(5)
    qw, _ = weight("INT4", 16, k, 4, device, 32 if k % 128 else 128)
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = (torch.randn(1, k, generator=g) * 3).to(device, dtype)
        x[0, :32] = 0.0
        x[0, 1] = -0.0  # (add_rms_norm adds a zero row where nothing is pending: -0 becomes +0)
        r = torch.randn(1, k, generator=g).to(device, dtype) if res else None
        nw = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
        stream, h = base.add_rms_norm(x, r if res else torch.zeros_like(x), nw, 1e-6)
        row = NormedRow(x, r, nw, 1e-6)
        q = qruns.normed_input(row)
        assert torch.equal(q, qruns.quantize_input(h))
        assert torch.equal(bits(row.materialize()), bits(h))
        if res:
            assert torch.equal(bits(row.stream), bits(stream))
        assert qruns.normed_input(row) is q
        y = qruns.gemv(NormedRow(x, r, nw, 1e-6), qw, int8=True)
        assert torch.equal(y, qruns.gemv(h, qw, int8=True))


@pytest.mark.parametrize("kind,n,k,group,start,stop", [("INT4", 37, 1024, 128, 0, 37), ("INT4", 37, 256, 64, 5, 30),
                                                       ("Q4KR", 45, 1024, 32, 2, 45), ("Q4KR", 18, 768, 32, 3, 18),
                                                       ("Q50R", 20, 896, 32, 1, 20), ("Q51R", 13, 576, 32, 0, 9)])
def test_dequantize_kernel_is_the_oracle(device, kind, n, k, group, start, stop):
    """dequantize_rows (prefill's weights) on any tile: the oracle's rows, each value in fp32 rounded
    once (bf16: the fp32 value rounded)."""
    from models.kernels.cuda import qruns
    qw, w = weight(kind, n, k, 4, device, group)
    ref = w[start:stop]
    out = qruns.dequantize_rows(qw, start, stop, torch.float32)
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    for tile in ((8, 4, 4), (4, 16, 1), (32, 8, 8)):
        assert torch.equal(qruns.dequantize_rows(qw, start, stop, torch.float32, tile=tile), out), tile
    if device.type == "cuda":
        assert torch.equal(qruns.dequantize_rows(qw, start, stop, torch.bfloat16), out.to(torch.bfloat16))


def test_linears_take_the_runs_on_cuda():
    """The loader's step on CUDA (to_planar, after fusion): a Q4_K linear repacked as Q4KR with its
    blocks freed (148 bytes a super-block row, counted as Q4_K), the same outputs on the torch
    path; AWQ groups of a multiple of 32 kept as stored (the runs), others repacked as INT4P;
    qlinear's dispatch sends both run layouts to qruns.py."""
    from models.formats import gguf_blocks
    from models.quant import hf_layers
    from models.quant import layers as quant
    from models.kernels.cuda import qlinear, qruns
    qw, _ = gguf_weight("Q4_K", 20, 512, 6, "cpu")
    lin = quant.BlockLinear(qw.data, gguf_blocks.TYPES["Q4_K"])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9))
    ref = lin(x)
    assert lin.to_planar() and lin.qweight().fmt == "Q4KR" and not hasattr(lin, "blocks")
    assert torch.allclose(lin(x), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert quant.weight_formats(lin) == {"Q4_K": 20 * 2 * 148}
    assert qlinear.fits("Q4KR", 512) and qruns.takes(lin.qweight())
    awq = int4_linear(8, 256, 128, 5, "cpu")
    assert not awq.to_planar() and awq.qweight().fmt == "INT4" and qruns.takes(awq.qweight())
    g16 = hf_layers.GroupInt4Linear("GPTQ", torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 4).half(),
                                   torch.zeros(4, 4, dtype=torch.uint8), 16)
    assert g16.to_planar() and g16.qweight().fmt == "INT4P"


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1"])
def test_a_tied_5_bit_head_and_its_embedding_share_the_runs(fmt):
    """to_planar on a Q5_0 / Q5_1 linear (the loader's step on CUDA): Q50R / Q51R in the blocks'
    bytes, the same outputs; a tied head's embedding then reads the head's runs (share_layout):
    the same rows, the blocks freed, the table counted once. Without five_bit, the blocks stay."""
    from models.formats import gguf_blocks
    from models.quant import layers as quant
    from models.kernels.cuda import qlinear, qruns
    qw, _ = gguf_weight(fmt, 40, 96, 7, "cpu")
    emb = quant.BlockEmbedding(qw.data, ggml_type=gguf_blocks.TYPES[fmt])
    head = emb.as_linear()
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(9))
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    rows, ref = emb(ids), head(x)
    assert not head.to_planar(five_bit=False) and not emb.share_layout(head)
    layout = quant.BlockLinear.repack_for
    assert layout(head.ggml_type)[1] == {"Q5_0": "Q50R", "Q5_1": "Q51R"}[fmt]
    assert layout(gguf_blocks.TYPES["Q6_K"])[1] == "Q6KP"  # (planar, not runs)
    assert layout(head.ggml_type, five_bit=False) is None and layout(gguf_blocks.TYPES["Q4_K"])[1] == "Q4KR"
    assert head.to_planar() and head.qweight().fmt == {"Q5_0": "Q50R", "Q5_1": "Q51R"}[fmt]
    assert qlinear.fits(head.qweight().fmt, 96) and qruns.takes(head.qweight())
    assert torch.allclose(head(x), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert emb.share_layout(head) and emb.words is head.words and not hasattr(emb, "blocks")
    assert torch.equal(emb(ids), rows)
    assert quant.weight_formats(torch.nn.ModuleList([emb, head])) == {fmt: qw.data.numel()}


@pytest.mark.parametrize("group", [32, 64])
def test_runs_serve_rows_of_whole_groups_not_of_whole_128s(group):
    """An AWQ/GPTQ linear in groups of 32 or 64 over K = 320 (not whole 128s, the general
    kernels' INT4 block) stays as stored and is still the CUDA kernels' (qruns.py), not the torch
    path's; INT4 whose groups are not whole runs still needs whole 128s."""
    from models.kernels.cuda import qlinear, qruns
    from models.ops import quant as quant_ops
    from models.plan import bind_forms
    lin = int4_linear(6, 320, group, 3, "cpu")
    assert not lin.to_planar() and qruns.takes(lin.qweight())
    assert qlinear.fits("INT4", 320, group) and not qlinear.fits("INT4", 320, 16) and not qlinear.fits("INT4", 320)

    class Row:  # a NormedRow's interface: cuda_serves takes it without asking the device
        pass
    assert not lin.cuda_serves(Row())  # (no forms bound: the torch forms)
    assert bind_forms(lin) == 1 and lin.forms is quant_ops.FORMS
    assert lin.cuda_serves(Row())
    assert copy.deepcopy(lin).forms is quant_ops.FORMS


def test_qlinear_sends_runs_to_qruns(device):
    """qlinear.gemv and qlinear.dequantize on a run layout: qruns.py's results, bit for bit."""
    from models.kernels.cuda import qlinear, qruns
    for kind in ("INT4", "Q4KR"):
        qw, _ = weight(kind, 12, 512, 7, device, 128)
        x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(device)
        assert torch.equal(qlinear.gemv(x, qw), qruns.gemv(x, qw))
        assert torch.equal(qlinear.dequantize(qw, 1, 9, torch.float32), qruns.dequantize_rows(qw, 1, 9, torch.float32))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton (not interpreted)")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The GEMV (its inline DP4A included, which the interpreter does not run) on either input, with
    and without its read ahead, whole steps or not, SwiGLU or not, the quantizers (alone and after
    the norm) and the dequantize kernel, for INT4 and Q4KR, compile to sm_90 binaries (Triton's
    own ptxas, no device)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import qruns
    cases = []
    for fmt, aux, aux2, G in ((0, "*fp16", "*u8", 128), (1, "*i32", "*i16", 32)):
        sig = dict(x="*bf16", w="*i32", aux=aux, aux2=aux2, bias="*bf16", out="*bf16", N="i32", stride_w="i32",
                   stride_a="i32", stride_z="i32", q8="*i32", sync="*i32")
        cases += [(qruns._runs_gemv_kernel, {**sig, "x": "*i32" if a8 else "*bf16"},
                   dict(G=G, RUNS=runs, BN=4, C=64, STEPS=-(-runs // 64), EVEN=runs % 64 == 0, FMT=fmt, A8=a8,
                        HAS_BIAS=swiglu, SWIGLU=swiglu, PREFETCH=pf, Q8=False, PDL=True, INTERPRETED=False))
                  for swiglu in (False, True) for a8 in (False, True) for pf in (False, True) for runs in (160, 544)]
        cases.append((qruns._runs_dequant_kernel,
                      dict(w="*u8", aux=aux, aux2=aux2, out="*bf16", start="i32", stop="i32", stride_w="i32",
                           stride_a="i32", stride_z="i32", stride_o="i32"),
                      dict(G=G, FMT=fmt, BLOCK_N=qruns.DEQUANT_TILE[0], CR=qruns.DEQUANT_TILE[1])))
    cases.append((qruns._quantize_kernel, dict(x="*bf16", out="*i32", stride_x="i32"),
                  dict(RUNS=160, RB=8, PDL=True, INTERPRETED=False)))
    cases += [(qruns._norm_quantize_kernel,
               dict(x="*bf16", y="*bf16", w="*bf16", sum_out="*bf16", norm_out="*bf16", qout="*i32", eps="fp32"),
               dict(N=5120, BLOCK=8192, RB=rb, HAS_RES=True, PDL=True, INTERPRETED=False)) for rb in (32, 256)]
    for fn, sig, const in cases:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
