"""GGUF block products on int8 inputs on the CPU (`cpu_int8: on`; block_linear(..., int8=True),
models/kernels/cpu/blocks_int8.h) against their definition, written out here in fp64:
y = x~ W^T, W gguf-py's dequantized weights, x~ each 32 inputs of a row rounded to int8 with one
scale as llama.cpp's CPU kernels round theirs (x~ = q dx, dx = max|x| / 127, q = round(x 127 /
max|x|), ties to even).

Tolerance: |y - x~ W^T| <= 1e-5 (|x~| |W|^T): the integer sums are exact, each is scaled once in
fp32, and the minimum terms (Q4_1, Q5_1, Q4_K, Q5_K) are fp32 sums. Through a model: the C++
step with int8 inputs against the torch step whose block linears take x~ (a hook), both with an
fp32 KV cache, within 1e-4 x max |logit|, and the same greedy tokens."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from models.formats import gguf_blocks, quant
from test_block_quant import Q4_K_M, cpu_session, step_logits, tiny_gguf
from test_gguf_blocks import QUANTIZED, random_blocks


@pytest.fixture
def chat_here(capsys, monkeypatch):
    """`chat ...` in this process: (exit status, stdout, stderr)."""
    import os

    from chat.__main__ import main
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(*args):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return torch.ops.chat_cpu


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x~ in fp64, from x [T, K] fp32 (each division a tensor's: correctly rounded, as C++'s)."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(g * inv).clamp(-127, 127)
    return (q.double() * (amax / torch.full_like(amax, 127.0)).double()).reshape(x.shape)


def inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with a block of zeros, one of large and one of tiny values, and one a single
    nonzero input."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 0:32] = 0
    x[:, 32:64] *= 1e4
    x[:, 64:96] *= 1e-30
    x[:, 96:128] = 0
    x[:, 100] = -3.0
    return x


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_block_products_are_the_rounded_inputs_product(cpp, qtype, rows):
    raw = torch.from_numpy(random_blocks(qtype, rows=45, blocks_per_row=16 if qtype < Q.Q4_K else 2, seed=rows))
    k = gguf_blocks.row_weights(int(qtype), raw.shape[1])
    x = inputs(rows, k, rows)
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    xt = rounded(x)
    got = cpp.block_linear(x, raw, int(qtype), True).double()
    ref, scale = xt @ w.t(), xt.abs() @ w.abs().t()
    assert torch.all((got - ref).abs() <= 1e-5 * scale + 1e-30)
    # (not the fp32 product: x~ moves each output by far more than the tolerance somewhere)
    fp32 = cpp.block_linear(x, raw, int(qtype)).double()
    assert bool(((fp32 - ref).abs() > 1e-3 * scale).any())


def test_the_rounding_is_to_the_nearest_with_ties_to_even(cpp):
    """A Q8_0 row of ones (d = 1) sums q dx: inputs 127 and k + 1/2 (dx = 1) give q = 127 and the
    even neighbours: 127 + 0 + 2 + 2 + 4 - 0 - 2 = 133 (x's own sum is 132)."""
    block = np.zeros(34, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    block[2:] = 1
    x = torch.zeros(1, 32)
    x[0, :7] = torch.tensor([127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -2.5])
    blocks = torch.from_numpy(block).reshape(1, 34)
    assert float(cpp.block_linear(x, blocks, int(Q.Q8_0), True)) == 133.0
    assert float(cpp.block_linear(x, blocks, int(Q.Q8_0))) == 132.0


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_modules_take_the_setting(cpp, qtype):
    """use_int8_inputs on a BlockLinear and a BlockExperts with the library's kernels attached:
    a few rows on int8 inputs, more rows (prefill's dequantized GEMM) in fp32; off again: fp32."""
    from models.kernels.cpu import step
    from test_qplanar import gguf_experts
    raw = torch.from_numpy(random_blocks(qtype, rows=40, blocks_per_row=8 if qtype < Q.Q4_K else 1, seed=3))
    lin = quant.BlockLinear(raw, int(qtype))
    kind = qtype.name if qtype >= Q.Q4_K else "Q8_0"  # (gguf_experts writes K-quants or Q8_0)
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, kind, gate_type=kind))
    net = torch.nn.ModuleList([lin, ex])
    step.attach_block_kernels(net)
    assert quant.use_int8_inputs(net, True) == 2 and net.cpu_int8
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    x = inputs(2, lin.in_features, 7)
    xt = rounded(x)
    assert torch.all((lin(x).double() - xt @ w.t()).abs() <= 1e-5 * (xt.abs() @ w.abs().t()) + 1e-30)
    many = inputs(6, lin.in_features, 8)  # (more than KERNEL_ROWS: fp32, dequantized)
    assert torch.all((lin(many).double() - many.double() @ w.t()).abs() <= 1e-5 * (many.double().abs() @ w.abs().t()))
    xe = torch.randn(2, 256, generator=torch.Generator().manual_seed(9))
    idx, weights = torch.tensor([[1, 3], [0, 1]]), torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    on = ex(xe, idx, weights)
    quant.use_int8_inputs(net, False)
    assert not lin.int8_inputs and not ex.int8_inputs and not net.cpu_int8
    off = ex(xe, idx, weights)
    assert not torch.equal(on, off) and torch.allclose(on, off, rtol=0.05, atol=0.05 * float(off.abs().max()))
    assert torch.all((lin(x).double() - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30)


def test_cpp_step_on_int8_inputs_is_the_torch_step_on_rounded_inputs(tmp_path, monkeypatch):
    """A Q4_K_M-mix tiny GGUF: the C++ step with cpu_int8 (each linear's type carries the flag)
    against the torch step whose block linears take x~ for decode's rows (a hook), step after
    step, within 1e-4 x max |logit|; the same greedy tokens. And not the fp32 C++ step's logits.
    The C++ step keeps an fp32 KV cache here: with its fp16 one, inputs that differ by 1e-5
    round to neighbouring int8 codes here and there, which moved these logits by ~1% (measured)."""
    from engine.config import SamplingConfig
    from models.kernels.cpu import step as cpu_step
    init = cpu_step.CpuStep.__init__

    def fp32_cache(self, model):
        init(self, model)
        self.kv_dtype = torch.float32

    monkeypatch.setattr(cpu_step.CpuStep, "__init__", fp32_cache)
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    cpp, ref, fp32 = (models.load(path, quantized=True) for _ in range(3))
    assert models.use_int8_inputs(cpp.model, True) > 0

    def round_decode_rows(module, args):
        x = args[0]
        if x.dim() == 2 and x.shape[0] <= quant.BlockLinear.KERNEL_ROWS:
            return (rounded(x).float(),)

    for m in ref.model.modules():
        if isinstance(m, quant.BlockLinear):
            m.register_forward_pre_hook(round_decode_rows)

    got, want, plain = step_logits(cpp, "on"), step_logits(ref, "off"), step_logits(fp32, "on")
    assert "int8 inputs" in cpu_session(cpp, "on").decode_path
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), float((got - want).abs().max())
    assert float((got - plain).abs().max()) > 1e-3 * float(want.abs().max())
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    assert list(cpu_session(cpp, "on").generate(list(range(3, 40)), greedy)) == \
        list(cpu_session(ref, "off").generate(list(range(3, 40)), greedy))


def test_the_setting_is_recorded_and_replayed(tmp_path, chat_here):
    """`chat run --cpu-int8 on` on a GGUF records `cpu_int8: on`, and the recording replays on that
    path; a recording from before the setting replays with it off."""
    import yaml

    from chat import transcript as tr
    from chat.__main__ import build_replay_parser, settings_for
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    script = tmp_path / "s.yaml"
    script.write_text(f"format: chat-transcript\nversion: 1\nmodel: {{source: {path}}}\n"
                      "sampling: {temperature: 0, max_new_tokens: 12}\nevents:\n  - user: one\n  - user: two\n")
    rec = tmp_path / "r.yaml"
    code, out, err = chat_here("run", script, "-o", rec, "--cpu-int8", "on")
    assert code == 0, err
    data = yaml.safe_load(rec.read_text())
    assert data["engine"]["cpu_int8"] == "on"
    code, out, err = chat_here("replay", rec)
    assert code == 0, err
    del data["engine"]["cpu_int8"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data))
    args = build_replay_parser().parse_args([str(old)])
    assert settings_for(args, tr.load(str(old))).engine.cpu_int8 == "off"
    assert settings_for(args, tr.load(str(rec))).engine.cpu_int8 == "on"
