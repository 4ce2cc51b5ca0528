"""models/kernels/cuda/qplanar.py: the INT4P repack against the weights AWQ/GPTQ's INT4 encodes,
and its dequant-GEMV against the dequantized product (of the input rounded to int8 per group,
x~, where the GEMV takes int8 inputs), on CUDA (`gpu`) and under Triton's
interpreter on the CPU (TRITON_INTERPRET=1 with a Triton on PYTHONPATH; skipped otherwise).
Tolerance: |y - ref| <= 1e-5 * scale + (bf16 output: 2^-8 |ref|), scale = |x| @ |W|^T."""
import importlib.util
import os

import pytest
import torch


from models.quant import hf_layers
from tests.support.quant import PLANAR_LAYOUTS, gguf_experts, gguf_repack, gguf_weight, int4_linear, product_and_tolerance


@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (33, 1024, 128), (18, 512, 64)])
def test_repack_keeps_every_weight(n, k, group):
    from models.kernels.cuda import qplanar
    lin = int4_linear(n, k, group, 0, "cpu")
    pw = qplanar.repack(lin.qweight())
    assert pw.data.dtype == torch.int32 and pw.data.shape == (-(-n // qplanar.R), k // 8, qplanar.R)
    ref = lin.dequantize(torch.float64)
    assert torch.equal(qplanar.dequantize(pw), ref)  # s q - s z: the checkpoint's s and z, kept as stored
    rows = -(-n // qplanar.R) * qplanar.R  # 4 bits a weight and 3 bytes a group (an fp16 s, a uint8 z)
    assert pw.nbytes() == rows * (k // 2 + k // group * 3)


def test_repack_refuses_what_it_cannot_hold():
    from models.quant.layers import QWeight
    from models.kernels.cuda import qplanar
    with pytest.raises(ValueError, match="INT4P"):
        qplanar.repack(QWeight("INT4", torch.zeros(4, 8, dtype=torch.uint8), 4, 16, torch.zeros(4, 4).half(),
                               torch.zeros(4, 4, dtype=torch.uint8), 4))


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("k,group", [(512, 32), (1024, 128), (256, 64)])
def test_quantize_input_packs_the_reference(device, k, group, pairs):
    """quantize_input's buffer holds, at word position g G/8 + m, the int8 codes of the inputs the
    even and the odd nibbles meet (bytes j / 2 of j = 0, 2, 4, 6 and 1, 3, 5, 7: input g G + G/8 j
    + m), dx sum_j q and dx / 16, for quantized_reference's x~ = q dx; a zero group stays zero,
    the largest input of a group is +-127 dx, and |x~ - x| <= dx / 2 (up to fp32 rounding)."""
    from models.kernels.cuda import qplanar
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, k, generator=g) * torch.logspace(-3, 3, k // group).repeat_interleave(group)
    x[1, :group] = 0
    x[2, 5] = 1e4
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        xq = qplanar.quantize_input(x.to(device, dtype), group, pairs).cpu()
        ref = qplanar.quantized_reference(x.to(dtype), group)
        assert xq.shape == ((3, k // 8, 4) if pairs else (3, 4, k // 8))
        if pairs:  # (the four values of a word position side by side: as planes, for the checks below)
            xq = xq.transpose(1, 2).contiguous()
        gw = group // 8
        codes = torch.zeros(3, k, dtype=torch.int64)
        for j in range(8):
            byte = (xq[:, j % 2] >> (8 * (j // 2))) & 255
            byte = torch.where(byte > 127, byte - 256, byte)
            pos = torch.arange(k // 8)
            codes[:, (pos // gw) * group + gw * j + pos % gw] = byte.long()
        dx = xq[:, 3].view(torch.float32).double().reshape(3, -1, gw)[..., 0].repeat_interleave(group, 1) * 16
        assert torch.equal(codes * dx, ref)
        sums = codes.reshape(3, k // group, 8, gw).sum(2).reshape(3, -1)
        assert torch.equal(xq[:, 2].view(torch.float32), sums.float() * (xq[:, 3].view(torch.float32) * 16))
        assert bool((codes[1, :group] == 0).all()) and int(codes[2].abs().max()) == 127
        # (dx / 2, give or take the fp32 roundings of 127 / amax and of x 127 / amax: ~2^-23 of 127 dx)
        assert bool(((ref - x.to(dtype).double()).abs() <= dx / 2 * (1 + 1e-4)).all())


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n,k,group,swiglu,bias", [(37, 1024, 128, False, False), (40, 2048, 128, True, True),
                                                   (22, 512, 64, False, True), (8, 128, 128, True, False),
                                                   (14, 256, 128, True, True)])
def test_gemv_is_the_dequantized_product(device, n, k, group, swiglu, bias, int8):
    """Against x @ W^T in fp64, or x~ @ W^T with int8 inputs (x~ = quantized_reference(x))."""
    from models.kernels.cuda import qplanar
    lin = int4_linear(n, k, group, 1, device)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(device) if bias else None
    pw = qplanar.repack(lin.qweight())
    w = lin.dequantize(torch.float64)
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        xd = qplanar.quantized_reference(x, group).to(device) if int8 else x.double()
        ref, tol = product_and_tolerance(xd, w, b, swiglu, dtype)
        # pick_config's form, and its general form (a split K where the grid is small)
        for config in (None, qplanar.pick_config(n // 2 if swiglu else n, k, group, small=False)):
            out = qplanar.gemv(x, pw, b, swiglu=swiglu, out_dtype=dtype, int8=int8, config=config)
            err = (out.double() - ref).abs()
            assert bool((err <= tol).all()), (config, float((err - tol).max()))


@pytest.mark.parametrize("k,group,res", [(896, 32, True), (640, 128, False), (512, 64, True), (5120, 32, True),
                                         (1152, 32, True)])
@pytest.mark.parametrize("programs", [1, 8])
def test_normed_input_is_add_rms_norm_then_quantize_input(device, k, group, res, programs, monkeypatch):
    """normed_input's one launch leaves the bits of add_rms_norm then quantize_input: the stream,
    the normed row (signs of zero included), the int8 input; the row's next GEMV of that group
    takes the same buffer; a GEMV of the NormedRow equals the GEMV of its normed row. In one
    program or in several, each with its share of the groups (K = 1152: 36 groups, 4 programs of 8
    and a last of 4)."""
    from models.kernels.cuda import base, qplanar
    monkeypatch.setattr(qplanar, "NORM_QUANTIZE_PROGRAMS", programs)
    from models.kernels.cuda.linear import NormedRow

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()

    g = torch.Generator().manual_seed(5)
    lin = int4_linear(16, k, group, 4, device)
    pw = qplanar.repack(lin.qweight())
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = (torch.randn(1, k, generator=g) * 3).to(device, dtype)
        x[0, :group] = 0.0
        x[0, 1] = -0.0  # (add_rms_norm adds a zero row where nothing is pending: -0 becomes +0)
        r = torch.randn(1, k, generator=g).to(device, dtype) if res else None
        w = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
        stream, h = base.add_rms_norm(x, r if res else torch.zeros_like(x), w, 1e-6)
        row = NormedRow(x, r, w, 1e-6)
        q = qplanar.normed_input(row, group)
        assert torch.equal(q, qplanar.quantize_input(h, group))
        assert torch.equal(bits(row.materialize()), bits(h))
        if res:
            assert torch.equal(bits(row.stream), bits(stream))
        assert qplanar.normed_input(row, group) is q
        # (the other layout of the int8 input, INT4P's: pairs_for, in the same one launch)
        fresh = NormedRow(x, r, w, 1e-6)
        assert torch.equal(qplanar.normed_input(fresh, group, True), qplanar.quantize_input(h, group, True))
        assert torch.equal(bits(fresh.materialize()), bits(h))
        y = qplanar.gemv(NormedRow(x, r, w, 1e-6), pw, int8=True)
        assert torch.equal(y, qplanar.gemv(h, pw, int8=True))


@pytest.mark.parametrize("n,k,group,start,stop", [(37, 1024, 128, 0, 37), (37, 256, 128, 5, 30), (18, 512, 64, 3, 18)])
def test_dequantize_kernel_is_the_oracle(device, n, k, group, start, stop):
    from models.kernels.cuda import qplanar
    lin = int4_linear(n, k, group, 4, device)
    pw = qplanar.repack(lin.qweight())
    ref = lin.dequantize(torch.float64)[start:stop]
    out = qplanar.dequantize_rows(pw, start, stop, torch.float32)
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    if device.type == "cuda":  # bf16: the fp32 value rounded once
        assert torch.equal(qplanar.dequantize_rows(pw, start, stop, torch.bfloat16), out.to(torch.bfloat16))


def test_a_fused_linear_takes_the_planar_layout_after_fusion():
    """to_planar() (the loader's step on CUDA, after fusion) on a fused linear of groups that are
    not whole 32-weight runs (those stay as stored: qruns.py reads them): INT4P with the stored
    layout freed, the same outputs and splits (the torch path here), and no fusing after."""
    parts = [int4_linear(n, 256, 16, seed, "cpu") for n, seed in ((24, 5), (8, 6), (9, 7))]
    fused = hf_layers.GroupInt4Linear.concat(parts)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    ref = fused(x)
    assert fused.to_planar() and fused.qweight().fmt == "INT4P" and not hasattr(fused, "packed")
    assert hf_layers.GroupInt4Linear.concat([fused, parts[0]]) is None
    out = fused(x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    assert [t.shape[-1] for t in fused.split(x)] == [24, 8, 9]
    odd = int4_linear(8, 96, 24, 9, "cpu")  # groups of 24 over 96: whole groups, a multiple of 8
    assert odd.to_planar()
    runs = int4_linear(8, 96, 32, 9, "cpu")  # whole runs: kept as stored
    assert not runs.to_planar() and runs.qweight().fmt == "INT4" and hasattr(runs, "packed")
    bad = hf_layers.GroupInt4Linear("GPTQ", torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 4).half(),
                                   torch.zeros(4, 4, dtype=torch.uint8), 4)  # groups of 4: not whole words
    assert not bad.to_planar() and bad.qweight().fmt == "INT4"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton (not interpreted)")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The GEMV (its inline LOP3 and DP4A included, which the interpreter does not run) on either
    input, with and without its read ahead, the input's int8 quantizers (alone and after the
    norm, in one program of the whole row and in several) and the dequantize kernel, for INT4P,
    Q4KP, Q6KP and Q5KP, compile to sm_90 binaries (Triton's own ptxas, no device)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import qplanar
    cases = []
    for fmt in range(4):  # INT4P, Q4KP, Q6KP, Q5KP
        G, aux, aux2 = (128, 32, 16, 32)[fmt], "*fp16", "*u8"
        sig = dict(x="*bf16", w="*i32", aux=aux, aux2=aux2, bias="*bf16", out="*bf16", part="*fp32", idx="*i64",
                   N="i32", rows_e="i32", stride_x="i32", stride_w="i32", stride_a="i32", stride_z="i32")
        cases += [(qplanar._planar_gemv_kernel, {**sig, "x": "*i32" if a8 else "*bf16"},
                   dict(G=G, KW=64, STEPS=10, BLOCKS=4,
                                                          SPLIT=split, EXPERTS=False, PARTIAL=split > 1, FMT=fmt,
                                                          HAS_BIAS=False, SWIGLU=swiglu, A8=a8, PREFETCH=pf,
                                                          PAIRS=qplanar.pairs_for(fmt), PDL=True, INTERPRETED=False))
                  for swiglu in (False, True) for split in (1, 2) for a8 in (False, True) for pf in (False, True)]
        # the experts' GEMVs: gate/up (SwiGLU into h) and down (fp32 input rows, partial sums)
        cases += [(qplanar._planar_gemv_kernel, {**sig, "x": "*i32" if a8 else x_type, "out": "*fp32"},
                   dict(G=G, KW=32, STEPS=8, BLOCKS=2, SPLIT=1, EXPERTS=True, PARTIAL=not swiglu,
                        FMT=fmt, HAS_BIAS=False, SWIGLU=swiglu, A8=a8, PREFETCH=bool(fmt),
                        PAIRS=qplanar.pairs_for(fmt), PDL=True, INTERPRETED=False))
                  for swiglu, x_type in ((True, "*bf16"), (False, "*fp32")) for a8 in (False, True)]
        pairs = qplanar.pairs_for(fmt)
        cases.append((qplanar._quantize_kernel, dict(x="*bf16", out="*i32", stride_x="i32", n_groups="i32"),
                      dict(G=G, GB=4, KW8=640, PAIRS=pairs, PDL=True, INTERPRETED=False)))
        cases += [(qplanar._norm_quantize_kernel,
                   dict(x="*bf16", y="*bf16", w="*bf16", sum_out="*bf16", norm_out="*bf16", qout="*i32", eps="fp32"),
                   dict(N=5120, BLOCK=8192, G=G, NGB=ngb, HAS_RES=True, PAIRS=pairs, PDL=True, INTERPRETED=False))
                  for ngb in (8192 // G, 4)]
        cases += [(qplanar._planar_dequant_kernel,
                   dict(w="*i32", aux=aux, aux2=aux2, out="*bf16", start="i32", stop="i32", stride_w="i32",
                        stride_a="i32", stride_z="i32", stride_o="i32", kw8="i32"),
                   dict(G=G, NG=most // G, FMT=fmt, BLOCK_N=bn, FLAT=flat))
                  for bn, most, flat in ((16, 128, False), qplanar.DEQUANT_TILE[:2] + qplanar.DEQUANT_TILE[3:])]
    reduce_sig = dict(part="*fp32", bias="*bf16", weights="*fp32", shared="*bf16", shared_gate="*bf16", out="*bf16",
                      N="i32")
    cases += [(qplanar._reduce_kernel, reduce_sig, dict(PARTS=4, HAS_BIAS=True, SWIGLU=True, WEIGHTED=False,
                                                        SHARED=False, PDL=True, BLOCK=1024)),
              (qplanar._reduce_kernel, reduce_sig, dict(PARTS=8, HAS_BIAS=False, SWIGLU=False, WEIGHTED=True,
                                                        SHARED=True, PDL=True, BLOCK=1024))]
    for fn, sig, const in cases:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.parametrize("n,k", [(10, 512), (37, 256), (8, 1024)])
def test_q4k_repack_keeps_every_weight(n, k):
    from models.quant import planar
    qw, ref = gguf_weight("Q4_K", n, k, 0, "cpu")
    pw = planar.repack_q4k(qw)
    assert pw.fmt == "Q4KP" and pw.data.shape == (-(-n // planar.ROWS), k // 8, planar.ROWS)
    assert torch.equal(planar.dequantize_q4kp(pw), ref)  # every value exact (d sc and dmin m in fp32)
    rows = -(-n // planar.ROWS) * planar.ROWS  # 4.625 bits a weight (Q4_K: 4.5), rows padded to whole blocks
    assert pw.nbytes() == rows * (k // 2 + k // 256 * 4 + k // 32 * 2)


@pytest.mark.parametrize("n,k", [(10, 512), (37, 256), (8, 1024)])
def test_q5k_repack_keeps_every_weight(n, k):
    """Q5KP holds Q5_K's every weight (gguf-py's fp32 dequantization, to its rounding), in 5.625
    bits a weight against Q5_K's 5.5, rows padded to whole blocks."""
    from models.formats import gguf_blocks
    from models.quant import planar
    qw, ref = gguf_weight("Q5_K", n, k, 0, "cpu")
    assert int(gguf_blocks.q5_k_codes(qw.data.reshape(-1, 176)).max()) == 31  # the high bit met
    pw = planar.repack_q5k(qw)
    assert pw.fmt == "Q5KP" and pw.group == 32
    assert pw.data.shape == (-(-n // planar.ROWS), k // 8 + k // 32, planar.ROWS)  # the low words, then the high
    assert torch.allclose(planar.dequantize_q5kp(pw), ref, rtol=2 ** -23, atol=0)
    assert torch.equal(planar.dequantize_planar_rows(pw, 3, n), planar.dequantize_q5kp(pw)[3:])
    rows = -(-n // planar.ROWS) * planar.ROWS
    assert pw.nbytes() == rows * k * 180 // 256


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n,k,swiglu", [(37, 1024, False), (40, 512, True), (12, 768, False)])
def test_gguf_planar_gemv_and_dequantize_are_the_oracle(device, fmt, n, k, swiglu, int8):
    """Q4KP's, Q5KP's and Q6KP's GEMV (both input forms) and dequantize kernel against the fp64 weights."""
    from models.kernels.cuda import qplanar
    qw, w = gguf_weight(fmt, n, k, 1, device)
    pw = gguf_repack(fmt)(qw)
    w = w.to(device)
    out = qplanar.dequantize_rows(pw, 3, n, torch.float32)
    assert torch.allclose(out.double(), w[3:], rtol=0, atol=1e-6 * float(w.abs().max()))
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        xd = qplanar.quantized_reference(x, pw.group).to(device) if int8 else x.double()
        ref, tol = product_and_tolerance(xd, w, None, swiglu, dtype)
        head_tile = qplanar.pick_config(n // 2 if swiglu else n, k, pw.group, *qplanar.HEAD_FLOAT_TILE, small=False)
        for config in (None, head_tile):  # (the tile an LM head's float path takes)
            y = qplanar.gemv(x, pw, swiglu=swiglu, out_dtype=dtype, int8=int8, config=config)
            assert bool(((y.double() - ref).abs() <= tol).all()), \
                (config, float(((y.double() - ref).abs() - tol).max()))


@pytest.mark.parametrize("fmt", ["AWQ", "Q4_K", "Q5_K", "Q6_K"])
def test_every_dequantize_tile_gives_the_same_rows(device, fmt):
    """qplanar.dequantize_rows on any tile (rows, weights a program, warps, flat store or the 4-D
    one) writes the default tile's rows, bit for bit (the default's against the oracle: the tests
    above), a partial last row block included."""
    from models.kernels.cuda import qplanar
    n, k = 45, 1024
    pw = qplanar.repack(int4_linear(n, k, 128, 6, device).qweight()) if fmt == "AWQ" else \
        gguf_repack(fmt)(gguf_weight(fmt, n, k, 2, device)[0])
    ref = qplanar.dequantize_rows(pw, 2, n, torch.float32)
    for tile in ((8, 256, 4, True), (16, 512, 8, True), (32, 1024, 8, False), (4, 128, 1, True)):
        assert torch.equal(qplanar.dequantize_rows(pw, 2, n, torch.float32, tile=tile), ref), tile


@pytest.mark.parametrize("fmt,layout,row_bytes", [("Q4_K", "Q4KR", 2 * 148), ("Q5_K", "Q5KP", 2 * 180),
                                                   ("Q6_K", "Q6KP", 2 * 210)])
def test_a_k_quant_linear_takes_the_planar_layout(fmt, layout, row_bytes):
    """BlockLinear.to_planar() (the loader's step on CUDA) for Q4_K, Q5_K and Q6_K (a Q4_K_M
    file's LM head and some of its down and value projections): the kernel's layout (Q4_K: runs,
    quant/runs.py; the others planar) with the blocks freed, the same outputs on the torch path,
    its bytes counted as the file's type (Q4KR: 148 a super-block row against 144; Q5KP: 180
    against 176; Q6KP: Q6_K's 210); other types keep their blocks."""
    from models.formats import gguf_blocks
    from models.quant import layers as quant
    qw, _ = gguf_weight(fmt, 20, 512, 6, "cpu")
    lin = quant.BlockLinear(qw.data, gguf_blocks.TYPES[fmt])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9))
    ref = lin(x)
    assert quant.BlockLinear.repack_for(gguf_blocks.TYPES[fmt])[1] == layout  # (what the loader asks)
    assert lin.to_planar() and lin.qweight().fmt == layout and not hasattr(lin, "blocks")
    assert torch.allclose(lin(x), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert quant.weight_formats(lin) == {fmt: 20 * row_bytes}
    assert quant.BlockLinear.concat([lin, lin]) is None
    q8 = quant.BlockLinear(torch.zeros(4, 34, dtype=torch.uint8), gguf_blocks.TYPES["Q8_0"])
    assert not q8.to_planar() and q8.qweight().fmt == "Q8_0" and quant.BlockLinear.repack_for(q8.ggml_type) is None


@pytest.mark.parametrize("n,k", [(10, 512), (37, 256), (8, 1024)])
def test_q6k_repack_keeps_every_weight(n, k):
    """Q6KP holds Q6_K's every weight (d sc (q - 32) is exact in fp32: an fp16 times at most
    2^7 x 2^5), in 6.5625 bits a weight as Q6_K, rows padded to whole blocks."""
    from models.formats import gguf_blocks
    from models.quant import planar
    qw, ref = gguf_weight("Q6_K", n, k, 0, "cpu")
    q, sc, _ = gguf_blocks.q6_k_codes(qw.data.reshape(-1, 210))
    assert int(q.max()) == 63 and int(q.min()) == 0 and int(sc.min()) < 0  # every code and signed scales met
    pw = planar.repack_q6k(qw)
    assert pw.fmt == "Q6KP" and pw.group == 16
    assert pw.data.shape == (-(-n // planar.ROWS), k // 8 + k // 16, planar.ROWS)  # the low words, then the high
    assert torch.equal(planar.dequantize_q6kp(pw), ref)
    assert torch.equal(planar.dequantize_planar_rows(pw, 3, n), ref[3:])
    rows = -(-n // planar.ROWS) * planar.ROWS
    assert pw.nbytes() == rows * k * 210 // 256


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_repack_by_row_chunks_is_the_whole_repack(fmt, monkeypatch):
    """A matrix of more than CHUNK_ROWS rows is repacked a chunk at a time (bounded temporaries):
    the same tensors as at once, the last chunk's rows padded as the whole matrix's were."""
    from models.quant import planar
    qw = gguf_weight(fmt, 37, 512, 3, "cpu")[0]
    repack = gguf_repack(fmt)
    whole = repack(qw)
    monkeypatch.setattr(planar, "CHUNK_ROWS", 8)
    chunked = repack(qw)
    assert (chunked.fmt, chunked.n, chunked.k, chunked.group) == (whole.fmt, whole.n, whole.k, whole.group)
    for a, b in ((chunked.data, whole.data), (chunked.scales, whole.scales), (chunked.zeros, whole.zeros)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt,split,swiglu,bias", [("INT4P", 2, False, True), ("INT4P", 4, True, True),
                                                   ("Q4KP", 2, True, False), ("Q4KP", 8, False, False),
                                                   ("Q6KP", 4, True, True), ("Q5KP", 2, True, False)])
def test_a_split_k_gemv_is_the_one_launch_gemv(device, fmt, split, swiglu, bias):
    """K split across programs (pick_config's choice where a grid is small): the partial sums,
    reduced in order by a second kernel, give the one-launch kernel's product up to fp32
    reassociation, bias and SwiGLU applied alike; the same bits on every call."""
    from models.quant import planar
    from models.kernels.cuda import qplanar
    n, k = 40, 2048
    if fmt == "INT4P":
        pw = planar.repack_int4p(int4_linear(n, k, 128, 5, device).qweight())
    else:
        gguf = {"Q4KP": "Q4_K", "Q5KP": "Q5_K", "Q6KP": "Q6_K"}[fmt]
        pw = gguf_repack(gguf)(gguf_weight(gguf, n, k, 5, device)[0])
    b = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(device) if bias else None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(device)
    whole = qplanar.gemv(x, pw, b, swiglu=swiglu, config=(8, 4, 16, 1))
    parts = qplanar.gemv(x, pw, b, swiglu=swiglu, config=(8, 4, 16, split))
    assert torch.allclose(parts, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))
    assert torch.equal(parts, qplanar.gemv(x, pw, b, swiglu=swiglu, config=(8, 4, 16, split)))
    with pytest.raises(ValueError, match="K split in 3"):
        qplanar.gemv(x, pw, b, config=(8, 4, 16, 3))


def test_pick_config_splits_k_only_where_the_grid_is_small():
    from models.kernels.cuda import qplanar
    assert qplanar.pick_config(248320, 5120, 128)[3] == 1  # a vocabulary's rows: 31,040 programs already
    rows, _, kw, split = qplanar.pick_config(5120, 17408, 128)
    assert 5120 // rows * split >= 2048 and (17408 // 8 // kw) % split == 0
    assert qplanar.pick_config(8, 256, 32)[3] == 1  # too few steps to split


def test_an_lm_heads_float_path_takes_its_own_tile():
    """A vocabulary's rows on fp32 inputs (the LM head's normed row): HEAD_FLOAT_TILE's 16 rows x 2
    warps; on int8 inputs, and for other matrices, the general form's 8 x 2; a tile asked for kept."""
    from models.kernels.cuda import qplanar
    assert qplanar.pick_config(248320, 5120, 16, int8=False)[:2] == qplanar.HEAD_FLOAT_TILE == (16, 2)
    assert qplanar.pick_config(248320, 5120, 16)[:2] == (8, 2)
    assert qplanar.pick_config(10240, 5120, 16, int8=False)[:2] == (8, 2)
    assert qplanar.pick_config(248320, 5120, 16, 4, 1, int8=False)[:2] == (4, 1)
    assert qplanar.pick_config(248320, 5120, 16, 8, 2, int8=False)[:2] == (8, 2)  # a tile given, even the general one
    assert qplanar.pick_config(1024, 3584, 32) == (8, 4, 64, 1)  # a small matrix: 7 steps of 64 words, unsplit
    assert qplanar.pick_config(1024, 3584, 32, small=False) == (8, 2, 32, 2)
    assert qplanar.pick_config(896, 4864, 32) == (4, 1, 8, 4)  # small, 608 words: 4 parts of 19 8-word steps
    # small in weights, but the general form's grid is big enough (1,280 and 2,048 programs): not small
    assert qplanar.pick_config(5120, 2048, 32) == (8, 2, 32, 2)
    assert qplanar.pick_config(2048, 8192, 32) == (8, 2, 32, 8)
    assert qplanar.pick_config(8192, 1024, 32) == (8, 4, 64, 1)  # a big grid, but K unsplit there: small
    assert qplanar.pick_config(16384, 768, 32) == (8, 2, 32, 1)  # K unsplit, a big grid, no 64-word rows: general


@pytest.mark.parametrize("gate_type,down_type", [("Q4_K", "Q4_K"), ("Q5_K", "Q6_K"), ("Q6_K", "Q5_K")])
@pytest.mark.parametrize("int8", [False, True])
def test_expert_gemvs_are_the_chosen_experts_products(device, int8, gate_type, down_type, monkeypatch):
    """qplanar.experts_gate_up / experts_down read only the experts idx names (idx on the
    device), each slot against its own input row, and sum the slots in their order with the
    routing weights and a shared expert's output: against the fp64 oracle of the same blocks
    (of the int8 inputs x~ and h~, where the kernels take them); each planar layout (Q4KP, Q5KP,
    Q6KP) in either half."""
    from models.quant import layers as quant, planar
    from models.kernels.cuda import qplanar
    monkeypatch.setattr(qplanar, "int8_inputs", lambda dtype: int8)
    E, I, H = 5, 256, 256
    ex = quant.PlanarExperts.from_gguf(gguf_experts(E, I, H, down_type, gate_type=gate_type), device, torch.float32)
    gu, dn = ex.qweight("gate_up"), ex.qweight("down")
    assert (gu.fmt, dn.fmt) == (PLANAR_LAYOUTS[gate_type], PLANAR_LAYOUTS[down_type])
    w_gu = planar.dequantize_planar_rows(gu, 0, gu.n).cpu().reshape(E, 2 * I, H)  # (the oracle on the CPU, in fp64)
    w_dn = planar.dequantize_planar_rows(dn, 0, dn.n).cpu().reshape(E, H, I)
    g = torch.Generator().manual_seed(4)
    idx = torch.tensor([[3, 0, 4]]).to(device)
    weights = torch.tensor([[0.5, 0.3, 0.2]]).to(device)
    shared, sg = torch.randn(1, H, generator=g).to(device), torch.tensor([[0.7]]).to(device)
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        x = torch.randn(1, H, generator=g).to(device, dtype)
        h = qplanar.experts_gate_up(x, gu, idx, E)
        xd = qplanar.quantized_reference(x.cpu(), gu.group) if int8 else x.double().cpu()
        ref_h, scale_h = [], []
        for e in idx[0].tolist():
            gate, up = (w_gu[e] @ xd[0]).chunk(2)
            ref_h.append(gate / (1 + torch.exp(-gate)) * up)
            sg_, su = (w_gu[e].abs() @ xd[0].abs()).chunk(2)
            scale_h.append(sg_ * (1 + up.abs()) + su * (1 + gate.abs()))
        ref_h, scale_h = torch.stack(ref_h), torch.stack(scale_h)
        assert h.shape == (3, I) and h.dtype == torch.float32
        assert bool(((h.double().cpu() - ref_h).abs() <= 1e-5 * scale_h).all())
        out = qplanar.experts_down(h, dn, idx, weights, E, dtype, shared, sg)
        hd = qplanar.quantized_reference(h.cpu(), dn.group) if int8 else h.double().cpu()
        wd = weights.double().cpu()[0]
        parts = [wd[s] * (w_dn[e] @ hd[s]) for s, e in enumerate(idx[0].tolist())]
        ref = sum(parts) + shared.double().cpu()[0] / (1 + torch.exp(-sg.double().cpu()[0, 0]))
        scale = sum(wd[s] * (w_dn[e].abs() @ hd[s].abs()) for s, e in enumerate(idx[0].tolist())) + 1
        tol = 1e-5 * scale + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
        assert out.shape == (1, H) and out.dtype == dtype
        assert bool(((out.double().cpu()[0] - ref).abs() <= tol).all())
        assert torch.equal(out, qplanar.experts_down(h, dn, idx, weights, E, dtype, shared, sg))


@pytest.mark.parametrize("gate_type,down_type", [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q5_K", "Q6_K"),
                                                  ("Q4_K", "Q8_0"), ("Q8_0", "Q5_K")])
def test_planar_experts_compute_what_the_files_blocks_do(gate_type, down_type):
    """PlanarExperts (the CUDA form of a GGUF's experts, built here on the CPU) against
    BlockExperts (the CPU's, on the file's blocks) for several tokens: K-quant halves repacked
    (Q4_K_M's Q4_K and Q6_K, Q5_K_M's Q5_K), a Q8_0 half dense; each half's bytes counted under
    the type the file stored, a dense half under its dtype."""
    from models.quant import layers as quant
    t = gguf_experts(6, 256, 256, down_type, gate_type=gate_type)
    planar_ex = quant.PlanarExperts.from_gguf(t, torch.device("cpu"), torch.float32)
    for half, kind in (("gate_up", gate_type), ("down", down_type)):
        planar = kind in PLANAR_LAYOUTS
        assert (planar_ex.qweight(half) is not None) == planar
        assert hasattr(planar_ex, f"{half}_proj") == (not planar)
    assert planar_ex.gguf_kinds() == {h: k for h, k in (("gate_up", gate_type), ("down", down_type))
                                      if k in PLANAR_LAYOUTS}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=g)
    idx = torch.tensor([[1, 5], [5, 0], [2, 1], [1, 3]])
    w = torch.rand(4, 2, generator=g)
    ref = quant.BlockExperts(t)(x, idx, w)
    assert torch.allclose(planar_ex(x, idx, w), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    formats = quant.weight_formats(planar_ex)
    held: dict[str, int] = {}  # each planar half's storages, counted once, under its file type
    seen: set[int] = set()
    for half, kind in planar_ex.gguf_kinds().items():
        for n in ("words", "dd", "sm"):
            storage = getattr(planar_ex, f"{half}_{n}").untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held[kind] = held.get(kind, 0) + storage.nbytes()
    assert {k: formats.get(k) for k in held} == held
    assert ("float32" in formats) == ("Q8_0" in (gate_type, down_type))


def test_one_storage_holds_the_same_weights_in_one_allocation(device):
    """planar.one_storage (what to_planar keeps): data, scales and zeros as views of one buffer,
    each at a multiple of ALIGN bytes; the GEMV on it gives the same bits as on the separate tensors."""
    from models.quant import planar
    from models.kernels.cuda import qplanar
    lin = int4_linear(22, 384, 128, 8, device)  # 3 groups a row: the scales' bytes are not a multiple of 16
    pw = qplanar.repack(lin.qweight())
    one = planar.one_storage(pw)
    parts = [one.data, one.scales, one.zeros]
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1
    assert all(t.data_ptr() % planar.ALIGN == 0 for t in parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, [pw.data, pw.scales, pw.zeros]))
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(9)).to(device)
    assert torch.equal(qplanar.gemv(x, one, int8=False), qplanar.gemv(x, pw, int8=False))
    lin.to_planar()
    assert len({t.untyped_storage().data_ptr() for t in lin.format_tensors()[1]}) == 1
