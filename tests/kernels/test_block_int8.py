"""GGUF block products on int8 inputs on the CPU (`cpu_int8: on`; block_linear(..., int8=True),
models/kernels/cpu/blocks_int8.h) against their definition, written out here in fp64:
y = x~ W^T, W gguf-py's dequantized weights, x~ x rounded to int8 as llama.cpp's CPU kernels round
it for that weight type (ggml's vec_dot_type):
- K-quants (Q8_K): per 256 inputs, m the one of largest |x| (the first), iscale = -127 / m,
  q = min(127, round(iscale x)), x~ = q / iscale;
- the 32-weight types (Q8_0 / Q8_1): per 32, q = round(x 127 / max|x|), x~ = q dx, dx = max|x| / 127
  rounded to fp16.
Rounding to the nearest, ties to even, every step in fp32.

Tolerance: |y - x~ W^T| <= 1e-5 (|x~| |W|^T): the integer sums are exact, each is scaled once in
fp32, and the minimum terms are fp32 sums. Through a model: the C++ step with int8 inputs against
the torch step on the library's int8 products (each checked against x~ W^T), both with an fp32 KV
cache, within 1e-4 x max |logit|, and the same greedy tokens."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from models.formats import gguf_blocks
from models.quant import layers as quant
from models.formats import gguf_tensors
from tests.support.blocks import Q4_K_M, cpu_session, step_logits, tiny_gguf
from tests.support.blocks import QUANTIZED, random_blocks
from tests.support.blocks import inputs, rounded
from tests.support.blocks import K_QUANTS


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return torch.ops.chat_cpu


def reference(x: torch.Tensor, raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """(x~ W^T, |x~| |W|^T) in fp64."""
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    xt = rounded(x, qtype)
    return xt @ w.t(), xt.abs() @ w.abs().t()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 257])  # (17: two whole tiles and one row; 257: a GEMM on x~)
def test_int8_block_products_are_the_rounded_inputs_product(cpp, qtype, rows):
    raw = torch.from_numpy(random_blocks(qtype, rows=45, blocks_per_row=16 if qtype < Q.Q4_K else 2, seed=rows))
    k = gguf_blocks.row_weights(int(qtype), raw.shape[1])
    x = inputs(rows, k, rows)
    got = cpp.block_linear(x, raw, int(qtype), True).double()
    ref, scale = reference(x, raw, qtype)
    assert torch.all((got - ref).abs() <= 1e-5 * scale + 1e-30)
    # (not the fp32 product: x~ moves each output by far more than the tolerance somewhere)
    fp32 = cpp.block_linear(x[:8], raw, int(qtype)).double()  # (the fp32 kernel: up to 8 rows)
    assert bool(((fp32 - ref[:8]).abs() > 1e-3 * scale[:8]).any())


@pytest.mark.parametrize("qtype", [t for t in QUANTIZED if t not in K_QUANTS], ids=lambda t: t.name)
def test_prefill_rows_on_an_odd_count_of_blocks(cpp, qtype):
    """A prefill's rows over 15 blocks a row (no whole pairs: decode's form, kMaxRows at a time)
    and over 16 (pairs of blocks, the offsets and minimum terms as one GEMM), 11 rows."""
    for blocks in (15, 16):
        raw = torch.from_numpy(random_blocks(qtype, rows=21, blocks_per_row=blocks, seed=blocks))
        x = inputs(11, gguf_blocks.row_weights(int(qtype), raw.shape[1]), blocks)
        ref, scale = reference(x, raw, qtype)
        got = cpp.block_linear(x, raw, int(qtype), True).double()
        assert torch.all((got - ref).abs() <= 1e-5 * scale + 1e-30), blocks


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


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_the_q8_head_on_int8_inputs(cpp, rows):
    """quant.Q8Linear (a tied Q8_0 head, as codes and fp32 scales) under the library: with
    cpu_int8, x~ W^T with x rounded per 32 as for Q8_0 blocks (a code of -128 among them);
    without, the fp32 product; use_int8_inputs counts the head and sets it both ways."""
    raw = random_blocks(Q.Q8_0, rows=80, blocks_per_row=6, seed=rows)
    raw[0, 2] = 0x80  # (code -128: its magnitude 128 against q with q's sign flipped)
    w = gguf_blocks.dequantize(torch.from_numpy(raw), int(Q.Q8_0)).double()
    blocks = raw.reshape(80, 6, 34)
    codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(80, 192)
    scale = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(80, 6).astype(np.float32)
    head = quant.Q8Linear(gguf_tensors.QuantTensor("q8_0", codes, scale, np.zeros_like(scale)))
    assert torch.equal(head.codes.double().view(80, 6, 32) * head.scale.double()[..., None], w.view(80, 6, 32))
    head.fp32_kernel = cpp.q8_linear  # (as step.attach_block_kernels sets a model's Q8_0 head)
    x = inputs(rows, 192, rows)
    xt = rounded(x, Q.Q8_0)
    assert quant.use_int8_inputs(head, True) == 1 and head.int8_inputs
    got = head(x).double()
    assert torch.all((got - xt @ w.t()).abs() <= 1e-5 * (xt.abs() @ w.abs().t()) + 1e-30)
    quant.use_int8_inputs(head, False)
    exact, bound = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    assert torch.all((head(x).double() - exact).abs() <= 1e-5 * bound + 1e-30)
    assert bool(((got - exact).abs() > 1e-3 * bound).any())  # (x~ is not x)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_modules_take_the_setting(cpp, qtype):
    """use_int8_inputs on a BlockLinear and a BlockExperts with the library's kernels attached:
    a decode's few rows and a prefill's many on int8 inputs; off again: fp32."""
    from models.kernels.cpu import step
    from tests.support.quant import gguf_experts
    raw = torch.from_numpy(random_blocks(qtype, rows=40, blocks_per_row=8 if qtype < Q.Q4_K else 1, seed=3))
    lin = quant.BlockLinear(raw, int(qtype))
    kind = qtype.name if qtype >= Q.Q4_K else "Q8_0"  # (gguf_experts writes K-quants or Q8_0)
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, kind, gate_type=kind))
    net = torch.nn.ModuleList([lin, ex])
    step.attach_block_kernels(net)
    assert quant.use_int8_inputs(net, True) == 2 and net.cpu_int8
    w = gguf_blocks.dequantize(raw, int(qtype)).double()
    for rows in (2, 19):  # (a decode's few rows; a prefill's, more than KERNEL_ROWS and kMaxRows)
        x = inputs(rows, lin.in_features, 7)
        ref, scale = reference(x, raw, qtype)
        assert torch.all((lin(x).double() - ref).abs() <= 1e-5 * scale + 1e-30)
    xe = torch.randn(2, 256, generator=torch.Generator().manual_seed(9))
    idx, weights = torch.tensor([[1, 3], [0, 1]]), torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    on = ex(xe, idx, weights)
    quant.use_int8_inputs(net, False)
    assert not lin.int8_inputs and not ex.int8_inputs and not net.cpu_int8
    off = ex(xe, idx, weights)
    assert not torch.equal(on, off) and torch.allclose(on, off, rtol=0.05, atol=0.05 * float(off.abs().max()))
    assert torch.all((lin(x).double() - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_experts_prefill_on_int8_inputs_is_each_token_alone(cpp, kind):
    """A BlockExperts prefill on int8 inputs: 19 tokens, 13 of them routed to one expert (whole
    tiles and a remainder there), equal each token's own decode (its row alone through the same
    kernels) within the block products' tolerance; and not the fp32 experts' result."""
    from models.kernels.cpu import step
    from tests.support.quant import gguf_experts
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, kind, gate_type=kind))
    step.attach_block_kernels(ex)
    quant.use_int8_inputs(ex, True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 256, generator=gen)
    idx = torch.stack([torch.where(torch.arange(19) < 13, 2, torch.arange(19) % 4),
                       torch.where(torch.arange(19) < 13, 0, 3 - torch.arange(19) % 2)], 1)
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 4, idx[:, 1])
    weights = torch.rand(19, 2, generator=gen)
    assert int((idx == 2).sum()) > 8 and int((idx == 0).sum()) > 8
    many = ex(x, idx, weights)
    alone = torch.cat([ex(x[t:t + 1], idx[t:t + 1], weights[t:t + 1]) for t in range(19)])
    scale = float(alone.abs().max())
    assert torch.allclose(many, alone, rtol=0, atol=1e-5 * scale)
    quant.use_int8_inputs(ex, False)
    assert not torch.allclose(ex(x, idx, weights), many, rtol=0, atol=1e-4 * scale)


def tie_distance(x: torch.Tensor, qtype: Q) -> float:
    """How close any of x's values comes to a rounding tie, in int8 codes: the least |frac(v) - 1/2|
    over the values v that the rounding rounds (x's times 127 / their scale's input)."""
    x = x.reshape(-1, x.shape[-1]).float()
    if qtype in K_QUANTS:
        g = x.reshape(x.shape[0], -1, 256)
        v = (-127.0 / g.gather(-1, g.abs().argmax(-1, keepdim=True))) * g
    else:
        g = x.reshape(x.shape[0], -1, 32)
        v = g * (127.0 / g.abs().amax(-1, keepdim=True))
    v = v[torch.isfinite(v)]
    return float(((v - v.floor()) - 0.5).abs().min()) if v.numel() else 1.0


def test_cpp_step_on_int8_inputs_is_the_torch_step_on_rounded_inputs(tmp_path, monkeypatch):
    """A Q4_K_M-mix tiny GGUF: the C++ step with cpu_int8 (each linear's type carries the flag)
    against the torch step whose block linears take the library's int8 products, every one of
    those within 1e-5 of x~ W^T for its own input (a hook). Step by step from the same context:
    the same prefill (one code path, bit for bit), then the step's logits within 1e-4 x max
    |logit|, and not the fp32 C++ step's.
    The two steps' own sums (norms, attention) differ in order (~1e-7), and an input that close
    to a rounding tie moves one code, which moves this tiny model's logits by ~2% (measured: an
    input 3e-5 codes from a tie at the fourth of these steps). So each step starts from a prefill
    of the context (not from the step before: one moved code would stay in the cache), a step
    may differ only where the torch step met an input within 1e-4 codes of a tie, and six of
    the eight must agree. The C++ step keeps an fp32 KV cache here (its fp16 one moved these
    logits by ~1%)."""
    from models.kernels.cpu import step as cpu_step
    init = cpu_step.CpuStep.__init__

    def fp32_cache(self, model):
        init(self, model)
        self.kv_dtype = torch.float32

    monkeypatch.setattr(cpu_step.CpuStep, "__init__", fp32_cache)
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    cpp, ref, fp32 = (models.load(path, quantized=True) for _ in range(3))
    assert models.use_int8_inputs(cpp.model, True) > 0
    rows, ties = [], []

    def is_rounded_product(module, args, out):
        x = args[0].reshape(-1, module.in_features).contiguous()
        want, scale = reference(x, module.blocks, Q(module.ggml_type))
        assert torch.all((out.reshape(want.shape).double() - want).abs() <= 1e-5 * scale + 1e-30)
        rows.append(x.shape[0])
        ties.append(tie_distance(x, Q(module.ggml_type)))

    for m in ref.model.modules():
        if isinstance(m, quant.BlockLinear):
            m.register_forward_hook(is_rounded_product)

    prompt, steps = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    agree = 0
    for i, token in enumerate(steps):
        context = prompt + steps[:i]
        a, b = cpu_session(cpp, "on"), cpu_session(ref, "off")  # (cpu_kernel off takes the kernels off...)
        cpu_step.attach_block_kernels(ref.model)  # (... so they go back on after it)
        assert models.use_int8_inputs(ref.model, True) > 0 and "int8 inputs" in a.decode_path
        assert torch.equal(a.prefill(context), b.prefill(context))
        ties.clear()
        got, want = a.step(token)[-1], b.step(token)[-1]
        p = cpu_session(fp32, "on")
        p.prefill(context)
        plain = p.step(token)[-1]
        close = float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
        assert close or min(ties) < 1e-4, (i, float((got - want).abs().max()), min(ties))
        assert float((got - plain).abs().max()) > 1e-3 * float(want.abs().max())
        agree += close
    assert agree >= 6 and max(rows) == len(prompt) + len(steps) - 1 and rows.count(1) >= len(steps)


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


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512-forms", "avx2-forms"])
def test_auto_rounds_where_the_layers_hold_blocks(tmp_path, chat_here, monkeypatch, avx512):
    """`cpu_int8: auto` (the default): on for a K-quant mix (its layers' BlockLinears); for a
    Q4_1 file, wide with the library's AVX-512 and AVX2 forms alike (its linears kept in their
    blocks, interleaved: rows16, their inputs rounded to 16 bits; the Q8_0 head on fp32 inputs);
    the plan and the session say which, and a recording keeps what auto chose."""
    import yaml

    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from models.kernels.cpu import step
    monkeypatch.setattr(step, "avx512_forms", lambda: avx512)
    kq = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    q41 = tiny_gguf(tmp_path, "llama", Q.Q4_1, None, Q.Q8_0)
    assert load_settings(None).engine.cpu_int8 == "auto"
    for path, on in ((kq, True), (q41, True)):
        rt = open_runtime(load_settings(None, overrides={"model": str(path), "device": "cpu"}))
        model = rt.loaded.model
        assert models.int8_by_default(model) is on
        assert bool(getattr(model, "cpu_int8", False)) is on
        assert ("int8 inputs" in rt.loaded.plan.summary() or "rounded inputs" in rt.loaded.plan.summary()) is on
        assert ("int8 inputs" in rt.session.decode_path) is (path == kq)
        assert not any(isinstance(m, quant.Int4Linear) for m in model.modules())
        assert ("rows16" in rt.loaded.plan.summary()) is (path == q41)
        assert bool(getattr(model, "cpu_wide", False)) is (path == q41)
        assert ("16-bit inputs" in rt.session.decode_path) is (path == q41)
        script = tmp_path / "s.yaml"
        script.write_text(f"format: chat-transcript\nversion: 1\nmodel: {{source: {path}}}\n"
                          "sampling: {temperature: 0, max_new_tokens: 8}\nevents:\n  - user: one\n")
        rec = tmp_path / "r.yaml"
        code, out, err = chat_here("run", script, "-o", rec)
        assert code == 0, err
        assert yaml.safe_load(rec.read_text())["engine"]["cpu_int8"] == ("wide" if path == q41 else "on")
        code, out, err = chat_here("replay", rec)
        assert code == 0, err


def test_q4_1_blocks_through_the_cpp_step(tmp_path):
    """Q4_1 linears kept in their blocks (cpu_int8 on): with fp32 inputs, the C++ step against
    the torch step that dequantizes them, as for the other block types; on int8 inputs, each
    step's logits within a rounding's reach of those and not equal to them (the input rounded:
    test_cpp_step_on_int8_inputs_is_the_torch_step_on_rounded_inputs checks that form)."""
    from models.plan import KernelConfig
    path = tiny_gguf(tmp_path, "llama", Q.Q4_1, None, Q.Q5_0)  # (a Q5_0 head: blocks, as the layers)
    cpp, ref = (models.load(path, quantized=True, kernels=KernelConfig(cpu_int8=True)) for _ in range(2))
    assert not any(isinstance(m, quant.Int4Linear) for m in cpp.model.modules())
    assert {gguf_blocks.type_name(m.ggml_type) for m in cpp.model.model.layers.modules()
            if isinstance(m, quant.BlockLinear)} == {"Q4_1"}
    got, want = step_logits(cpp, "on"), step_logits(ref, "off")
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max()), float((got - want).abs().max())
    assert models.use_int8_inputs(cpp.model, True) > 0
    rounded = step_logits(cpp, "on")
    assert not torch.equal(rounded, got)
    assert float((rounded - want).abs().max()) <= 0.05 * float(want.abs().max())
