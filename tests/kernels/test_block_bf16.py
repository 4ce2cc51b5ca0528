"""A prefill's GGUF block products in bf16 on the CPU (block_linear_bf16; BlockLinear and
BlockExperts take it with `cpu_int8` on, from PREFILL_ROWS rows, where the CPU multiplies bf16
natively) against their definition, in fp64: y = bf16(x) bf16(W)^T, W gguf-py's dequantized
weights, each operand rounded to bf16 to the nearest (ties to even), the sums in fp32, the result
rounded to bf16 once.

Tolerance: |y - x_b W_b^T| <= 2^-8 |x_b W_b^T| + 1e-5 (|x_b| |W_b|^T): the result's one rounding
(2^-9 of it, relative) and the fp32 sums' order. Through a model: a tiny Q4_K_M-mix GGUF's prefill
logits with cpu_int8 on sit closer to the fp32 prefill's than the int8 tiles' do."""
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from models.formats import gguf_blocks
from models.quant import layers as quant
from tests.support.blocks import inputs
from tests.support.blocks import Q4_K_M, cpu_session, tiny_gguf
from tests.support.blocks import QUANTIZED, random_blocks


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return torch.ops.chat_cpu


def reference(x: torch.Tensor, raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_b W_b^T, |x_b| |W_b|^T) in fp64."""
    w = gguf_blocks.dequantize(raw, int(qtype)).bfloat16().double()
    xb = x.bfloat16().double()
    return xb @ w.t(), xb.abs() @ w.abs().t()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 64, 131])
def test_bf16_block_products_are_the_rounded_operands_product(cpp, qtype, rows):
    raw = torch.from_numpy(random_blocks(qtype, rows=45, blocks_per_row=16 if qtype < Q.Q4_K else 2, seed=rows))
    x = inputs(rows, gguf_blocks.row_weights(int(qtype), raw.shape[1]), rows)
    got = cpp.block_linear_bf16(x, raw, int(qtype)).double()
    ref, scale = reference(x, raw, qtype)
    assert torch.all((got - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-30)
    # (not the fp32 product: the rounding moves some output by far more than fp32 sums' order does)
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    assert bool(((got - x.double() @ w.t()).abs() > 1e-4 * scale).any())


def test_weights_in_more_rows_than_a_chunk(cpp):
    """W of 2,100 rows of 1,024 weights: three of block_linear_bf16's ~2 MiB chunks, the last short."""
    raw = torch.from_numpy(random_blocks(Q.Q4_K, rows=2100, blocks_per_row=4, seed=11))
    x = inputs(70, 1024, 3)
    got = cpp.block_linear_bf16(x, raw, int(Q.Q4_K)).double()
    ref, scale = reference(x, raw, Q.Q4_K)
    assert torch.all((got - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_modules_take_bf16_from_prefill_rows_with_int8_on(cpp, qtype, monkeypatch):
    """A BlockLinear and a BlockExperts with the library's kernels attached and cpu_int8 on: a
    prefill of PREFILL_ROWS rows or more is block_linear_bf16's product, fewer the int8 tiles'; with
    cpu_int8 off, the fp32 forms. Where the CPU has no native bf16 (bf16_gemm false), no module
    takes it: with the AVX-512 forms (VNNI) the int8 tiles serve a prefill, with the AVX2 forms
    the K-quants' int8 tiles and the fp32 GEMM on x itself for the 32-weight types (the
    dequantized weights: BlockLinear's torch form)."""
    from models.kernels.cpu import step
    from tests.support.quant import gguf_experts
    monkeypatch.setattr(step, "bf16_gemm", lambda: True)
    raw = torch.from_numpy(random_blocks(qtype, rows=40, blocks_per_row=8 if qtype < Q.Q4_K else 1, seed=3))
    lin = quant.BlockLinear(raw, int(qtype))
    kind = qtype.name if qtype >= Q.Q4_K else "Q8_0"
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, kind, gate_type=kind))
    net = torch.nn.ModuleList([lin, ex])
    step.attach_block_kernels(net)
    quant.use_int8_inputs(net, True)
    t = lin.ggml_type
    many, few = inputs(lin.PREFILL_ROWS, lin.in_features, 1), inputs(lin.PREFILL_ROWS - 1, lin.in_features, 2)
    assert torch.equal(lin(many), cpp.block_linear_bf16(many, raw, t))
    assert torch.equal(lin(few), cpp.block_linear(few, raw, t, True))
    xe = torch.randn(ex.PREFILL_ROWS, 256, generator=torch.Generator().manual_seed(9))
    idx = torch.stack([torch.full((ex.PREFILL_ROWS,), 2), torch.arange(ex.PREFILL_ROWS) % 2], 1)  # (expert 2: every row)
    weights = torch.full((ex.PREFILL_ROWS, 2), 0.5)
    g, u, d = ex.types
    h = torch.nn.functional.silu(cpp.block_linear_bf16(xe, ex.gate_blocks[2], g)) * \
        cpp.block_linear_bf16(xe, ex.up_blocks[2], u)
    expert2 = cpp.block_linear_bf16(h, ex.down_blocks[2], d) * 0.5
    got = ex(xe, idx, weights)
    rest = got - expert2
    assert torch.allclose(rest, ex(xe, idx, weights * torch.tensor([0.0, 1.0])), rtol=0, atol=1e-6)
    quant.use_int8_inputs(net, False)
    assert not torch.equal(lin(many), cpp.block_linear_bf16(many, raw, t))
    monkeypatch.setattr(step, "bf16_gemm", lambda: False)
    monkeypatch.setattr(step, "avx512_forms", lambda: True)
    step.attach_block_kernels(net)
    quant.use_int8_inputs(net, True)
    assert lin.bf16_kernel is None and ex.bf16_kernel is None and lin.prefill_form == ex.prefill_form == "int8"
    assert torch.equal(lin(many), cpp.block_linear(many, raw, t, True))
    monkeypatch.setattr(step, "avx512_forms", lambda: False)
    step.attach_block_kernels(net)
    quant.use_int8_inputs(net, True)
    if qtype >= Q.Q4_K:  # (the AVX2 forms' K-quant tiles: a super-block's sums in integers)
        assert lin.prefill_form == ex.prefill_form == "int8"
        assert torch.equal(lin(many), cpp.block_linear(many, raw, t, True))
    else:
        assert lin.prefill_form == ex.prefill_form == "fp32"
        exact = many.double() @ gguf_blocks.dequantize(raw, t).double().t()
        bound = many.double().abs() @ gguf_blocks.dequantize(raw, t).double().abs().t()
        assert torch.all((lin(many).double() - exact).abs() <= 1e-5 * bound + 1e-30)
    assert torch.equal(lin(few), cpp.block_linear(few, raw, t, True))


def test_prefill_logits_closer_to_fp32_than_the_int8_tiles(tmp_path, monkeypatch):
    """A tiny Q4_K_M-mix GGUF, a 100-token prefill with cpu_int8 on: in bf16 products (the
    default from PREFILL_ROWS rows) its last logits are nearer the fp32 prefill's than with the int8
    tiles for every row (PREFILL_ROWS past the prompt)."""
    from models.kernels.cpu import step
    monkeypatch.setattr(step, "bf16_gemm", lambda: True)
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    lm = models.load(path, quantized=True)
    prompt = [3 + (7 * i) % 200 for i in range(100)]
    s = cpu_session(lm, "on")
    fp32 = s.prefill(prompt)[-1]
    models.use_int8_inputs(lm.model, True)
    s.reset()
    bf16 = s.prefill(prompt)[-1]
    monkeypatch.setattr(quant.BlockLinear, "PREFILL_ROWS", 1 << 30)
    s.reset()
    int8 = s.prefill(prompt)[-1]
    assert not torch.equal(bf16, int8)
    assert float((bf16 - fp32).abs().max()) < 0.5 * float((int8 - fp32).abs().max())


def test_experts_of_mixed_types_take_each_types_prefill_form(monkeypatch):
    """A BlockExperts whose gate and up are Q4_K and whose down is Q8_0 (a K-quant mix's fallback),
    under the AVX2 forms: the K-quant's prefill on the int8 tiles, the Q8_0's by the fp32 GEMM,
    each matrix as its type says; the experts' output as each form gives it."""
    from models.kernels.cpu import step
    from tests.support.quant import gguf_experts
    monkeypatch.setattr(step, "bf16_gemm", lambda: False)
    monkeypatch.setattr(step, "avx512_forms", lambda: False)
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, "Q8_0", gate_type="Q4_K"))
    step.attach_block_kernels(ex)
    quant.use_int8_inputs(ex, True)
    assert ex.prefill_form == {int(Q.Q4_K): "int8", int(Q.Q8_0): "fp32"}
    x = torch.randn(ex.PREFILL_ROWS, 256, generator=torch.Generator().manual_seed(4))
    idx = torch.stack([torch.full((ex.PREFILL_ROWS,), 1), torch.tensor([0, 2, 3])[torch.arange(ex.PREFILL_ROWS) % 3]], 1)
    weights = torch.full((ex.PREFILL_ROWS, 2), 0.5)
    cpp = torch.ops.chat_cpu
    g, u, d = ex.types
    gate = cpp.block_linear(x, ex.gate_blocks[1], g, True)  # (expert 1: every row; K-quants: int8 tiles)
    h = torch.nn.functional.silu(gate) * cpp.block_linear(x, ex.up_blocks[1], u, True)
    expert1 = (h @ gguf_blocks.dequantize(ex.down_blocks[1], d).t()) * 0.5  # (Q8_0: the fp32 GEMM)
    rest = ex(x, idx, weights * torch.tensor([0.0, 1.0]))
    assert torch.allclose(ex(x, idx, weights) - rest, expert1, rtol=1e-5, atol=1e-5)


def test_cpu_rounding_says_what_the_block_products_take(monkeypatch):
    """models.cpu_rounding (/show's cpu_int8 line): nothing without the library's kernels, fp32
    inputs with cpu_int8 off, and with it on each GGUF type's prefill form under the AVX2 forms."""
    import models
    from models.kernels.cpu import step
    monkeypatch.setattr(step, "bf16_gemm", lambda: False)
    monkeypatch.setattr(step, "avx512_forms", lambda: False)
    net = torch.nn.ModuleList([quant.BlockLinear(torch.from_numpy(random_blocks(Q.Q4_K, rows=8, blocks_per_row=1, seed=1)),
                                                 int(Q.Q4_K)),
                               quant.BlockLinear(torch.from_numpy(random_blocks(Q.Q5_0, rows=8, blocks_per_row=8, seed=2)),
                                                 int(Q.Q5_0))])
    assert models.cpu_rounding(net) == ""
    step.attach_block_kernels(net)
    assert models.cpu_rounding(net) == "fp32 inputs (the blocks' exact products)"
    quant.use_int8_inputs(net, True)
    assert models.cpu_rounding(net) == ("decode's inputs rounded to int8 as llama.cpp rounds them; a prefill's rows: "
                                        "Q4_K int8 tiles; Q5_0 x itself by the fp32 GEMM")


@pytest.mark.slow
def test_show_names_cpu_int8_and_why(tmp_path):
    """/show on the embedded model (CPU, cpu_int8: auto): the setting, what it resolved to, why and
    what the block products take."""
    from tests.support.cli import run_chat
    p = run_chat("--temperature", "0", stdin="/show\n/exit\n", tmp_path=tmp_path)
    line = next(x for x in p.stdout.splitlines() if x.startswith("cpu_int8:"))
    assert line.startswith("cpu_int8: auto -> wide (the layers' blocks are all in rows16"), line
    assert line.endswith("Q4_1 inputs rounded to 16 bits per 32 (rows16), decode's and a prefill's; "
                         "the other products on fp32 inputs"), line
