"""models/kernels/cuda/qlinear.py: the Triton dequant-GEMV and dequantize kernels against the torch
dequantizers (the oracles: gguf_blocks.dequantize, bit for bit gguf-py's; hf_quant's), for every
format, on random weights.

Runs on CUDA (`gpu`), and on the CPU under Triton's interpreter:
`TRITON_INTERPRET=1 PYTHONPATH=<triton> pytest tests/kernels/test_quant_kernels.py` (skipped otherwise).
Documented tolerances, against the float64 product of the oracle's fp32 weights, with
scale = |x| @ |W|^T (the sum of the products' magnitudes):
  - GEMV, fp32 out: |y - ref| <= 1e-5 * scale (fp32 sums in another order, each block's scale
    applied to its partial sum);
  - GEMV, bf16 activations and output: <= 1e-5 * scale + 2^-8 * |ref| (the output's rounding);
  - dequantize, fp32 out: within 1e-6 of the largest weight of its 16-weight run (scale * code -
    offset in fp32, against the oracle's own order of the same ops: exact in the interpreter);
  - many rows (prefill: rows dequantized to bf16, then torch's GEMM): <= 1e-2 * scale (bf16
    weights and inputs: a 2^-9 relative rounding each).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from models.formats import gguf_blocks, gguf_tensors
from models.quant import layers as quant
from tests.support.blocks import QUANTIZED, random_blocks


def gguf_weight(qtype, rows, seed, device):
    """(BlockLinear, its oracle weights fp64) for random blocks; rows not a multiple of BLOCK_N."""
    raw = torch.from_numpy(random_blocks(qtype, rows=rows, blocks_per_row=48 if qtype < Q.Q4_K else 4, seed=seed))
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    return quant.BlockLinear(raw.to(device), int(qtype)), w.to(device)


def bound(x, w):
    return x.double().abs() @ w.abs().t()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_gemv_is_the_dequantized_product(device, qtype):
    from models.kernels.cuda import qlinear
    lin, w = gguf_weight(qtype, 13, 1, device)
    x = torch.randn(1, lin.in_features, generator=torch.Generator().manual_seed(0)).to(device)
    bias = torch.randn(lin.out_features).to(device)
    got = qlinear.gemv(x, lin.qweight(), bias, out_dtype=torch.float32).double()
    ref = x.double() @ w.t() + bias.double()
    assert torch.all((got - ref).abs() <= 1e-5 * bound(x, w) + 1e-6 * bias.double().abs())
    if device.type == "cuda":  # bf16 activations and output
        xb = x.bfloat16()
        got = qlinear.gemv(xb, lin.qweight()).double()
        ref = xb.double() @ w.t()
        assert torch.all((got - ref).abs() <= 1e-5 * bound(xb, w) + 2 ** -8 * ref.abs())


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_dequantize_kernel_is_the_oracle(device, qtype):
    from models.kernels.cuda import qlinear
    lin, w = gguf_weight(qtype, 21, 3, device)
    got = qlinear.dequantize(lin.qweight(), 3, 20, torch.float32).double()
    want = w[3:20]
    run = want.abs().reshape(17, -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(17, -1)
    assert torch.all((got - want).abs() <= 1e-6 * run)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_norm_prologue_swiglu_and_many_rows(device, qtype):
    """A NormedRow input (residual add + RMSNorm in the prologue, the stream written), the SwiGLU
    pair of row halves, and the many-row path, against the same ops in fp64 on the oracle."""
    from models.kernels.cuda.linear import NormedRow
    from models.ops import quant as quant_ops
    lin, w = gguf_weight(qtype, 16, 2, device)  # 8 gate rows, then 8 up rows
    g = torch.Generator().manual_seed(1)
    k = lin.in_features
    x, res = torch.randn(1, k, generator=g).to(device), torch.randn(1, k, generator=g).to(device)
    nw = torch.rand(k, generator=g).to(device) + 0.5
    row = NormedRow(x, res, nw, 1e-6)
    got = quant_ops.swiglu(lin, row).double()
    s = (x + res).double()
    h = F.rms_norm(s, (k,), nw.double(), 1e-6)
    gate, up = (h @ w.t()).chunk(2, dim=-1)
    ref = F.silu(gate) * up
    tol = 1e-5 * (bound(h, w[:8]) * up.abs() + bound(h, w[8:]) * gate.abs()) + 1e-6 * ref.abs()
    assert torch.all((got - ref).abs() <= tol)
    assert torch.equal(row.stream, x + res)
    xs = torch.randn(37, k, generator=g).to(device)
    ref = xs.double() @ w.t()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    got = quant_ops.forward(lin, xs.to(dtype)).double()
    assert torch.all((got - ref).abs() <= 1e-2 * bound(xs, w))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_embedding_rows(device, qtype):
    from models.kernels.cuda import qlinear
    raw = torch.from_numpy(random_blocks(qtype, rows=30, blocks_per_row=8 if qtype < Q.Q4_K else 1, seed=4))
    w = gguf_blocks.dequantize(raw, int(qtype))
    ids = torch.tensor([3, 0, 29, 3, 17])
    qw = qlinear.QWeight(qtype.name, raw.to(device), *w.shape)
    got = qlinear.dequantize_rows(qw, ids.to(device), torch.float32).cpu()
    run = w[ids].abs().reshape(5, -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(5, -1)
    assert torch.all((got - w[ids]).abs() <= 1e-6 * run)


def test_formats_cover_the_kept_gguf_types():
    from models.kernels.cuda import qlinear
    for t in gguf_tensors.kept_types():
        name = gguf_blocks.type_name(t)
        assert name in qlinear.FORMATS and qlinear.FORMATS[name][1] == gguf_blocks.LAYOUTS[t].bytes
    assert np.all([qlinear.fits(gguf_blocks.type_name(t), 256) for t in gguf_tensors.kept_types()])


def hf_weight(method, n, k, seed, device):
    """(the format's linear on `device`, its oracle weights fp64): FP8, AWQ, GPTQ from the
    encoders of tests/support/tiny_hf_quant.py."""
    from tests.support import tiny_hf_quant as enc
    from models.formats import hf_quant
    from models.quant import hf_layers
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if method == "fp8":
        pieces, _ = enc.fp8(w)
        t = hf_quant.Fp8Tensor(pieces["weight"], pieces["weight_scale_inv"])
    elif method == "awq":
        pieces, _ = enc.awq(w)
        t = hf_quant.awq(pieces["qweight"], pieces["qzeros"], pieces["scales"], enc.GROUP)
    else:
        pieces, _ = enc.gptq(w, sym=False, v1=True)
        t = hf_quant.gptq(pieces["qweight"], pieces["qzeros"], pieces["scales"], pieces["g_idx"], enc.GROUP, True)
    return hf_layers.module(t, device), t.dequantize().double().to(device)


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_hf_formats_gemv_dequantize_and_swiglu(device, method):
    from models.kernels.cuda import qlinear
    from models.kernels.cuda.linear import NormedRow
    from models.ops import quant as quant_ops
    lin, w = hf_weight(method, 264, 1536, 7, device)  # 264 rows: not whole 128-row FP8 blocks
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1536, generator=g).to(device)
    got = qlinear.gemv(x, lin.qweight(), out_dtype=torch.float32).double()
    assert torch.all((got - x.double() @ w.t()).abs() <= 1e-5 * bound(x, w))
    d = qlinear.dequantize(lin.qweight(), 5, 264, torch.float32).double()
    run = w[5:].abs().reshape(259, -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(259, -1)
    assert torch.all((d - w[5:]).abs() <= 1e-6 * run)
    half, _ = hf_weight(method, 256, 1536, 8, device)  # gate and up halves of 128 rows each
    wh = half.dequantize().double()
    res, nw = torch.randn(1, 1536, generator=g).to(device), torch.rand(1536, generator=g).to(device) + 0.5
    got = quant_ops.swiglu(half, NormedRow(x, res, nw, 1e-6)).double()
    h = F.rms_norm((x + res).double(), (1536,), nw.double(), 1e-6)
    gate, up = (h @ wh.t()).chunk(2, dim=-1)
    tol = 1e-5 * (bound(h, wh[:128]) * up.abs() + bound(h, wh[128:]) * gate.abs()) + 1e-6 * gate.abs() * up.abs()
    assert torch.all((got - F.silu(gate) * up).abs() <= tol)
    xs = torch.randn(9, 1536, generator=g).to(device)
    got = quant_ops.forward(lin, xs.to(torch.bfloat16 if device.type == "cuda" else torch.float32)).double()
    assert torch.all((got - xs.double() @ w.t()).abs() <= 1e-2 * bound(xs, w))


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_fused_rows_of_odd_sizes(device, method):
    """Linears fused whatever their row counts (Gated DeltaNet's in_proj: qkv, z, then b and a of
    a row per head): FP8 then keeps a scale per row; the product is the parts' products side by side."""
    from models.kernels.cuda import qlinear
    sizes = [136, 128, 6, 6] if method == "fp8" else [136, 128, 8, 8]  # (AWQ packs eight columns a word)
    parts = [hf_weight(method, n, 256, seed, device) for seed, n in enumerate(sizes)]
    fused = type(parts[0][0]).concat([p for p, _ in parts])
    assert fused is not None and fused.sizes == sizes
    w = torch.cat([w for _, w in parts])
    assert torch.equal(fused.dequantize().double(), w)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).to(device)
    got = qlinear.gemv(x, fused.qweight(), out_dtype=torch.float32).double()
    assert torch.all((got - x.double() @ w.t()).abs() <= 1e-5 * bound(x, w))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_rows_not_whole_steps(device, qtype):
    """Rows of 13 blocks (3 super-blocks): the last step is padded (blocks past the row re-read,
    inputs masked to zero); the GEMV and the dequantized rows are still the oracle's."""
    from models.kernels.cuda import qlinear
    raw = torch.from_numpy(random_blocks(qtype, rows=9, blocks_per_row=13 if qtype < Q.Q4_K else 3, seed=6))
    w = gguf_blocks.dequantize(raw, int(qtype)).double().to(device)
    qw = qlinear.QWeight(qtype.name, raw.to(device), *w.shape)
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(2)).to(device)
    got = qlinear.gemv(x, qw, out_dtype=torch.float32).double()
    assert torch.all((got - x.double() @ w.t()).abs() <= 1e-5 * bound(x, w))
    out = torch.full((9, w.shape[1] + 7), 7.0, device=device)  # wider rows: nothing written past K
    d = qlinear.dequantize(qw, 0, 9, torch.float32, out=out[:, :w.shape[1]])
    run = w.abs().reshape(9, -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(9, -1)
    assert torch.all((d.double() - w).abs() <= 1e-6 * run) and torch.all(out[:, w.shape[1]:] == 7.0)


@pytest.mark.parametrize("qtype,k,swiglu", [(Q.Q4_K, 3584, False), (Q.Q8_0, 3584, False), (Q.Q6_K, 3584, False),
                                            (Q.Q5_0, 1824, True), (Q.Q4_K, 3584, True), (Q.Q8_0, 4864, False)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_small_matrices_read_whole(device, qtype, k, swiglu):
    """Matrices of at most WHOLE_STEP_BYTES (qlinear.launch_config): a row in one padded step of
    4,096 weights (Q4_K, Q8_0), 2,048 (Q5_0 with a SwiGLU pair), or in steps of 1,024 where
    it is longer (Q6_K, a SwiGLU pair at 3,584; Q8_0 at 4,864); the GEMV is the oracle's
    product in each, a NormedRow's prologue included."""
    from models.kernels.cuda import qlinear
    from models.kernels.cuda.linear import NormedRow
    blocks = k // 32 if qtype < Q.Q4_K else k // 256
    raw = torch.from_numpy(random_blocks(qtype, rows=10, blocks_per_row=blocks, seed=8))
    w = gguf_blocks.dequantize(raw, int(qtype)).double().to(device)
    qw = qlinear.QWeight(qtype.name, raw.to(device), *w.shape)
    most = qlinear.launch_config(qw, swiglu)[2]
    # pick_config's result given back as an explicit config (quant_bench's sweeps) launches the same
    assert qlinear.launch_config(qw, swiglu, qlinear.pick_config(qw, swiglu)) == qlinear.launch_config(qw, swiglu)
    assert most == {(Q.Q4_K, False): 4096, (Q.Q8_0, False): 4096 if k <= 4096 else 1024}.get(
        (qtype, swiglu), 2048 if k <= 2048 else 1024)
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(1, k, generator=g).to(device), torch.randn(1, k, generator=g).to(device)
    nw = torch.rand(k, generator=g).to(device) + 0.5
    h = F.rms_norm((x + res).double(), (k,), nw.double(), 1e-6)
    got = qlinear.gemv(NormedRow(x, res, nw, 1e-6), qw, swiglu=swiglu, out_dtype=torch.float32).double()
    ref = h @ w.t()
    if swiglu:
        gate, up = ref.chunk(2, dim=-1)
        tol = 1e-5 * (bound(h, w[:5]) * up.abs() + bound(h, w[5:]) * gate.abs()) + 1e-6 * (F.silu(gate) * up).abs()
        assert torch.all((got - F.silu(gate) * up).abs() <= tol)
    else:
        assert torch.all((got - ref).abs() <= 1e-5 * bound(h, w))


@pytest.mark.parametrize("config", [(4, 1, 4), (8, 2, 4), (16, 4, 8), (32, 8, 4)], ids=str)
def test_fp8_gemv_configs(device, config):
    """fp8.py's GEMV per (BLOCK_N, NB, warps): steps that divide the row or pad it (12 blocks),
    scales shared by a program's rows or per row (fused parts of odd sizes; SwiGLU halves of 200
    rows, whose up rows start inside a block of scales, with a bias), a bias and the norm prologue."""
    from models.kernels.cuda import fp8
    from models.kernels.cuda.linear import NormedRow
    g = torch.Generator().manual_seed(11)
    lin, w = hf_weight("fp8", 264, 1536, 9, device)
    x = torch.randn(1, 1536, generator=g).to(device)
    bias = torch.randn(264, generator=g).to(device)
    got = fp8.gemv(x, lin.qweight(), bias, out_dtype=torch.float32, config=config).double()
    ref = x.double() @ w.t() + bias.double()
    assert torch.all((got - ref).abs() <= 1e-5 * bound(x, w) + 1e-6 * bias.double().abs())
    parts = [hf_weight("fp8", n, 1536, seed, device) for seed, n in enumerate([136, 6])]
    fused = type(parts[0][0]).concat([p for p, _ in parts])
    wf = torch.cat([w for _, w in parts])
    got = fp8.gemv(x, fused.qweight(), out_dtype=torch.float32, config=config).double()
    assert torch.all((got - x.double() @ wf.t()).abs() <= 1e-5 * bound(x, wf))
    pair, wp = hf_weight("fp8", 400, 1536, 12, device)  # [gate; up], 200 rows each
    res, nw = torch.randn(1, 1536, generator=g).to(device), torch.rand(1536, generator=g).to(device) + 0.5
    row = NormedRow(x, res, nw, 1e-6)
    pair_bias = torch.randn(400, generator=g).to(device)  # (the up rows' bias sits 200 below the gate rows')
    got = fp8.gemv(row, pair.qweight(), pair_bias, swiglu=True, out_dtype=torch.float32, config=config).double()
    assert torch.equal(row.stream, x + res)
    h = F.rms_norm((x + res).double(), (1536,), nw.double(), 1e-6)
    gate, up = (h @ wp.t() + pair_bias.double()).chunk(2, dim=-1)
    tol = 1e-5 * (bound(h, wp[:200]) * up.abs() + bound(h, wp[200:]) * gate.abs()) + 1e-6 * gate.abs() * up.abs()
    assert torch.all((got - F.silu(gate) * up).abs() <= tol)


@pytest.mark.parametrize("config", [(1, 32, 1), (2, 32, 1), (4, 64, 2), (8, 64, 2), (4, 128, 4), (5, 128, 4),
                                    (3, 64, 2)], ids=str)
def test_fp8_gemv16_configs(device, config):
    """fp8.py's fp16-product form (inline PTX: CUDA only) per (BLOCK_N, R, warps): rows of whole
    steps or a padded last step (1,152 = 9 blocks), a last program with spare rows (262 rows),
    scales shared or per row (fused parts of odd sizes; SwiGLU halves of 198 rows with a bias,
    whose up rows start inside a program's rows), the norm prologue, inputs of a wide range and
    all-zero runs, and bf16 in and out as decode runs it. Bounds: each run's 16 products summed in
    fp16 (8 a lane, each sum rounded to 11 bits) is within 2^-8 of sum |x w| (4e-3 of `bound`),
    and within 2e-3 of the output's rms."""
    if device.type != "cuda":
        pytest.skip("the fp16-product form is inline PTX: no interpreter")
    from models.kernels.cuda import fp8
    from models.kernels.cuda.linear import NormedRow
    g = torch.Generator().manual_seed(13)

    def check(got, ref, b):
        err = (got - ref).abs()
        assert torch.all(err <= 4e-3 * b), float((err / b).max())
        assert float(err.pow(2).mean().sqrt()) <= 2e-3 * float(ref.pow(2).mean().sqrt())

    for k in (1536, 1152):
        lin, w = hf_weight("fp8", 262, k, 9, device)
        x = torch.randn(1, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]
        x[0, 32:64] = 0.0  # two runs of zeros
        x = x.to(device)
        bias = torch.randn(262, generator=g).to(device)
        got = fp8.gemv(x, lin.qweight(), bias, out_dtype=torch.float32, config=config, form="f16").double()
        check(got, x.double() @ w.t() + bias.double(), bound(x, w) + 1e-6 * bias.double().abs())
        xb = x.bfloat16()  # decode's case: a bf16 row in, bf16 out (one more rounding, 2^-9 of |y|)
        got = fp8.gemv(xb, lin.qweight(), config=config, form="f16")
        assert got.dtype == torch.bfloat16
        ref = xb.double() @ w.t()
        assert torch.all((got.double() - ref).abs() <= 4e-3 * bound(xb, w) + 4e-3 * ref.abs())
        parts = [hf_weight("fp8", n, k, seed, device) for seed, n in enumerate([136, 6])]
        fused = type(parts[0][0]).concat([p for p, _ in parts])
        wf = torch.cat([w for _, w in parts])
        got = fp8.gemv(x, fused.qweight(), out_dtype=torch.float32, config=config, form="f16").double()
        check(got, x.double() @ wf.t(), bound(x, wf))
        pair, wp = hf_weight("fp8", 396, k, 12, device)  # [gate; up], 198 rows each
        xn = torch.randn(1, k, generator=g).to(device)
        res, nw = torch.randn(1, k, generator=g).to(device), torch.rand(k, generator=g).to(device) + 0.5
        row = NormedRow(xn, res, nw, 1e-6)
        pair_bias = torch.randn(396, generator=g).to(device)
        got = fp8.gemv(row, pair.qweight(), pair_bias, swiglu=True, out_dtype=torch.float32, config=config,
                       form="f16").double()
        assert torch.equal(row.stream, xn + res)
        h = F.rms_norm((xn + res).double(), (k,), nw.double(), 1e-6)
        gate, up = (h @ wp.t() + pair_bias.double()).chunk(2, dim=-1)
        # (the prologue's fp32 inputs rounded to fp16 once more: 9 roundings, ~4.4e-3 at worst)
        tol = 5e-3 * (bound(h, wp[:198]) * up.abs() + bound(h, wp[198:]) * gate.abs()) + 1e-6 * gate.abs() * up.abs()
        assert torch.all((got - F.silu(gate) * up).abs() <= tol)


def test_fp8_gemv_takes_the_fp16_form_above_one_step(device):
    """gemv's default on CUDA: matrices above WHOLE_STEP_BYTES take the fp16-product form, within
    its bounds of the product (CHAT_FP8_GEMV=f32: the fp32 form, within 1e-5); smaller ones the
    fp32 form."""
    if device.type != "cuda":
        pytest.skip("the fp16-product form is inline PTX: CUDA only")
    from models.kernels.cuda import fp8
    lin, w = hf_weight("fp8", 2176, 4096, 4, device)  # 8.5 MiB of codes
    qw = lin.qweight()
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1)).to(device)
    assert fp8.takes16(x, qw) == (fp8.FORM == "f16")
    assert not fp8.takes16(x.cpu(), qw)
    got = fp8.gemv(x, qw, out_dtype=torch.float32)
    assert torch.equal(got, fp8.gemv(x, qw, out_dtype=torch.float32, form="f16" if fp8.FORM == "f16" else "f32"))
    tol = 4e-3 if fp8.takes16(x, qw) else 1e-5
    assert torch.all((got.double() - x.double() @ w.t()).abs() <= tol * bound(x, w))
    small, ws = hf_weight("fp8", 264, 1536, 9, device)
    assert not fp8.takes16(x[:, :1536], small.qweight())


def test_fp8_gemv_refuses_configs_its_steps_cannot_take():
    """A config whose step is not a power of two of blocks (fp32 form) or of runs, at least one
    128-weight block's 8 (fp16 form), is refused before any launch: its blocks' scales would be
    read for the wrong weights."""
    from models.kernels.cuda import fp8
    lin, _ = hf_weight("fp8", 64, 256, 1, torch.device("cpu"))
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="power of two"):
        fp8.gemv(x, lin.qweight(), config=(2, 3, 4), form="f32")
    with pytest.raises(ValueError, match="at least 8"):
        fp8.gemv(x, lin.qweight(), config=(2, 4, 1), form="f16")
