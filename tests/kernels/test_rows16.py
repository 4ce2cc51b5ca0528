"""The rows16 layout (models/quant/rows16.py) and its int8 products (models/kernels/cpu/rows16_int8.h):
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks interleaved 16 rows at a time, read by the library with the
inputs rounded as llama.cpp rounds them (`cpu_int8`), or to 16 bits (`wide`).

Oracles: the layout against its inverse and the blocks' own bytes; the product against x~ W^T in
fp64 (test_block_int8.py's rounding and tolerance); a row's bits the same in any run of rows (a
decode, a verify's rows, a prefill) and on the AVX2 build as on the native one; through a model,
the plan's interleaved matrices against the row-by-row block products, step by step, and the
C++ step against the torch step on the same layout."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from models.formats import gguf_blocks
from models.quant import layers as quant
from models.quant import rows16
from tests.support.blocks import rounded
from tests.support.blocks import tiny_gguf
from tests.support.blocks import random_blocks as random_array
from tests.support.paths import ROOT

TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def planned(qtype) -> None:
    """Skip where the kernel plan keeps this type row by row (Q8_0 with the AVX2 forms)."""
    from models.kernels.cpu import step
    if qtype not in step.rows16_types():
        pytest.skip(f"the plan keeps {qtype.name} row by row with this library's forms")


def random_blocks(qtype, rows, blocks_per_row, seed) -> torch.Tensor:
    return torch.from_numpy(random_array(qtype, rows, blocks_per_row, seed))


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return torch.ops.chat_cpu


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_layout_is_the_blocks_rearranged(qtype):
    blocks = random_blocks(qtype, 48, 8, seed=1)
    r = rows16.interleave(blocks, qtype)
    assert r.shape == blocks.shape and r.dtype == torch.uint8
    assert torch.equal(rows16.deinterleave(r, qtype), blocks)
    size = rows16.block_bytes(qtype)
    head = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q5_0: 6, Q.Q5_1: 8, Q.Q8_0: 2}[qtype]
    if qtype in (Q.Q4_0, Q.Q4_1):  # (the fifth bits' words and Q8_0's codes are recoded)
        assert torch.equal(torch.sort(r.flatten()).values, torch.sort(blocks.flatten()).values)
    # group 1, block 2: the 16 rows' scales first, then quad 3's bytes of row 5 where the layout says
    group = r[16:32].flatten()
    block = group[2 * 16 * size:3 * 16 * size]
    rows = blocks[16:32, 2 * size:3 * size]
    assert torch.equal(block[:32], rows[:, :2].flatten())
    quad = block[16 * head + 3 * 64 + 5 * 4:16 * head + 3 * 64 + 6 * 4]
    assert torch.equal(quad ^ 0x80 if qtype == Q.Q8_0 else quad, rows[5, head + 12:head + 16])
    if qtype in (Q.Q5_0, Q.Q5_1):  # row 5's fifth bits: code 4 k + i's at bit 8 i + k, 16 + 4 k + i's at 8 i + 4 + k
        at = 16 * (head - 4) + 5 * 4
        word = int.from_bytes(bytes(block[at:at + 4].tolist()), "little")
        qh = int.from_bytes(bytes(rows[5, head - 4:head].tolist()), "little")
        for i in range(4):
            for k in range(4):
                assert (word >> (8 * i + k)) & 1 == (qh >> (4 * k + i)) & 1
                assert (word >> (8 * i + 4 + k)) & 1 == (qh >> (16 + 4 * k + i)) & 1


def test_layout_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="16-row groups"):
        rows16.interleave(random_blocks(Q.Q4_1, 24, 2, seed=2), Q.Q4_1)
    with pytest.raises(ValueError, match="no rows16 layout"):
        rows16.interleave(random_blocks(Q.Q4_K, 16, 1, seed=2), Q.Q4_K)
    assert rows16.fits(Q.Q4_0, 32) and not rows16.fits(Q.Q4_0, 40) and rows16.fits(Q.Q5_0, 32)
    assert not rows16.fits(Q.Q6_K, 32)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x~ in fp64 for 16-bit inputs (rows16_int8.h's quantize_wide): per 32, q = round(x 32767 /
    max|x|) to the nearest, ties to even (the product and quotient in fp32), x~ = q max|x| / 32767."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(g * inv).clamp(-32767, 32767)
    return (q.double() * (amax / 32767.0).double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 37])
@pytest.mark.parametrize("width", ["int8", "wide"])
def test_product_matches_the_definition(cpp, qtype, rows, width):
    blocks = random_blocks(qtype, 64, 12, seed=3)  # 64 outputs, 384 inputs
    w = gguf_blocks.dequantize(blocks, qtype).double()
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    code = rows16.CODE + (rows16.WIDE if width == "wide" else 0) + qtype
    y = cpp.block_linear(x, rows16.interleave(blocks, qtype), code, True)
    xr = wide(x) if width == "wide" else rounded(x, qtype)
    ref = xr @ w.T
    bound = 1e-5 * (xr.abs() @ w.abs().T) + 1e-6
    assert (y.double() - ref).abs().le(bound).all(), (y.double() - ref).abs().max()
    if width == "wide":  # (16 bits: within ~1e-4 of the product on x itself, where int8's error is ~1e-2)
        exact = x.double() @ w.T
        assert (y.double() - exact).abs().max() <= 1e-4 * (x.double().abs() @ w.abs().T).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("width", [0, rows16.WIDE], ids=["int8", "wide"])
def test_each_row_has_its_own_bits_in_any_run(cpp, qtype, width):
    """A decode's row, a verify's rows (block_linear_rows) and a prefill's many (block_linear): each
    row's sums in the same order, so the same bits."""
    blocks = rows16.interleave(random_blocks(qtype, 96, 6, seed=4), qtype)
    x = torch.randn(21, 192, generator=torch.Generator().manual_seed(5))
    code = rows16.CODE + width + qtype
    alone = torch.cat([cpp.block_linear(x[t:t + 1], blocks, code, True) for t in range(21)])
    assert torch.equal(cpp.block_linear(x, blocks, code, True), alone)
    for n in (2, 3, 8, 9):
        assert torch.equal(cpp.block_linear_rows(x[:n].contiguous(), blocks, code, True), alone[:n])


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512-forms", "avx2-forms"])
def test_auto_chooses_wide_inputs_on_rows16(tmp_path, monkeypatch, avx512):
    """`cpu_int8: auto` keeps a Q4_1 file's linears in their blocks, in rows16, on either kernel
    set, and rounds their inputs to 16 bits (models.rounding_by_default: wide); with cpu_rows16 off
    the AVX-512 forms take torch's int4 planes (fp32 inputs: off) and the AVX2 forms the row-by-row
    int8 products (on)."""
    from models.kernels.cpu import step
    from models.plan import KernelConfig
    monkeypatch.setattr(step, "avx512_forms", lambda: avx512)
    path = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    for on in (True, False):
        lm = models.load(path, quantized=True, kernels=KernelConfig(cpu_int8=None, cpu_rows16=on))
        planes = any(isinstance(m, quant.Int4Linear) for m in lm.model.modules())
        assert planes is (avx512 and not on)
        assert ("rows16" in lm.plan.summary()) is on
        assert models.rounding_by_default(lm.model) == ("wide" if on else "off" if planes else "on")


def test_rows16_types_by_kernel_set(monkeypatch):
    """VNNI's forms take every rows16 type; the AVX2 forms leave Q8_0 to its row-by-row products."""
    from models.kernels.cpu import step
    monkeypatch.setattr(step, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512_vnni"})
    monkeypatch.setattr(step, "_isa", "native")
    assert step.rows16_types() == TYPES
    monkeypatch.setattr(step, "_isa", "avx2")
    assert step.rows16_types() == (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
    monkeypatch.setattr(step, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(step, "_isa", "native")
    assert Q.Q8_0 not in step.rows16_types()


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_auto_takes_wide_inputs_where_every_block_is_in_rows16(tmp_path, qtype):
    """A Q5_0 file's linears all in rows16: auto rounds their inputs to 16 bits, as for Q4_1. A Q8_0
    file's are in rows16 only with VNNI's forms, so auto takes int8 inputs for it on any CPU (a
    recording's choice replays alike on an AVX2 machine)."""
    from models.kernels.cpu import step
    from models.plan import KernelConfig
    lm = models.load(tiny_gguf(tmp_path, "llama", qtype), quantized=True, kernels=KernelConfig(cpu_int8=None))
    held = [m for m in lm.model.modules() if isinstance(m, quant.BlockLinear)]
    assert held and all((m.rows16 is not None) is (qtype in step.rows16_types()) for m in held)
    assert models.rounding_by_default(lm.model) == ("wide" if qtype == Q.Q5_0 else "on")


def test_no_rows16_where_the_library_has_no_forms_for_it(tmp_path, monkeypatch):
    """A CPU without AVX2 (FMA, F16C) gets a portable library with no rows16 products: the plan
    leaves the blocks as they are (their row-by-row products), and auto rounds them to int8 as before."""
    from models.kernels.cpu import step
    from models.plan import KernelConfig
    monkeypatch.setattr(step, "_cpu_flags", lambda: {"sse2", "avx"})
    assert not step.rows16_forms()
    lm = models.load(tiny_gguf(tmp_path, "llama", Q.Q4_1), quantized=True, kernels=KernelConfig(cpu_int8=None))
    assert not any(isinstance(m, quant.Int4Linear) for m in lm.model.modules())
    assert not any(m.rows16 is not None for m in lm.model.modules() if isinstance(m, quant.BlockLinear))
    assert "rows16" not in lm.plan.summary() and models.rounding_by_default(lm.model) == "on"


def test_wide_on_a_file_without_rows16_rounds_nothing_and_says_so(tmp_path):
    """`cpu_int8: wide` on a K-quant file: no rows16 matrices, so every product takes fp32 inputs;
    the model, the plan and the session say so, and the runtime reports that the setting changed
    nothing."""
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from tests.support.blocks import Q4_K_M
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    notes = []
    rt = open_runtime(load_settings(None, overrides={"model": str(path), "device": "cpu", "cpu_int8": "wide"}),
                      status=notes.append)
    assert not rt.loaded.model.cpu_wide and not rt.loaded.model.cpu_int8
    assert "int8 inputs" not in rt.loaded.plan.summary() and "16-bit" not in rt.session.decode_path
    assert any(n.startswith("cpu_int8: wide changes nothing here") for n in notes), notes


def test_int8_inputs_only(cpp):
    blocks = rows16.interleave(random_blocks(Q.Q4_1, 16, 2, seed=6), Q.Q4_1)
    with pytest.raises(RuntimeError, match="takes int8 inputs"):
        cpp.block_linear(torch.randn(1, 64), blocks, rows16.CODE + Q.Q4_1, False)


def _load(path, rows16_on: bool, wide: bool = False):
    from engine.config import EngineConfig
    from engine.device import kernel_config
    kernels = kernel_config(EngineConfig(cpu_int8="on")).but(cpu_rows16=rows16_on)
    lm = models.load(path, quantized=True, kernels=kernels)
    models.use_int8_inputs(lm.model, True, wide=wide)
    return lm


@pytest.mark.parametrize("linear", TYPES, ids=lambda q: q.name)
def test_the_plan_interleaves_and_the_steps_agree(tmp_path, linear):
    """With cpu_int8 on, the plan puts a rows16 type's linears in rows16 (cpu_rows16, the
    default) and says so. Step by step from the same prefilled context: the C++ step against the
    torch step whose linears take the same rows16 products (fp32 KV caches both; their norms and
    attention sum in other orders, so an input within a hair of a rounding tie may move one code:
    six of eight steps within 1e-4 x max |logit|, as test_block_int8.py allows), and both within
    a rounding's reach of the row-by-row products'."""
    from models.kernels.cpu import step as cpu_step
    from tests.support.blocks import cpu_session
    planned(linear)
    path = tiny_gguf(tmp_path, "llama", linear)
    cpp, ref, plain = _load(path, True), _load(path, True), _load(path, False)
    held = [m for m in cpp.model.modules() if isinstance(m, quant.BlockLinear)]
    assert held and all(m.rows16 is not None for m in held)
    assert "rows16 GEMV (rounded inputs)" in cpp.plan.summary()
    assert not any(m.rows16 is not None for m in plain.model.modules() if isinstance(m, quant.BlockLinear))
    assert "rows16" not in plain.plan.summary()
    init = cpu_step.CpuStep.__init__

    def fp32_cache(self, model):
        init(self, model)
        self.kv_dtype = torch.float32

    prompt, steps = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]
    agree = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_step.CpuStep, "__init__", fp32_cache)
        for i, token in enumerate(steps):
            context = prompt + steps[:i]
            a, b, c = cpu_session(cpp, "on"), cpu_session(ref, "off"), cpu_session(plain, "on")
            cpu_step.attach_block_kernels(ref.model)  # (cpu_kernel off took them off)
            models.use_int8_inputs(ref.model, True)
            for s in (a, b, c):
                s.prefill(context)
            got, want, rows = a.step(token)[-1], b.step(token)[-1], c.step(token)[-1]
            scale = float(want.abs().max())
            agree += float((got - want).abs().max()) <= 1e-4 * scale
            assert float((got - rows).abs().max()) <= 0.05 * scale
    assert agree >= 6


@pytest.mark.parametrize("linear,wide,types", [(Q.Q4_1, False, None), (Q.Q4_1, True, None), (Q.Q5_0, False, None),
                                               (Q.Q8_0, True, None), (Q.Q5_0, False, {"attn_v.weight": Q.Q8_0})],
                         ids=["Q4_1-int8", "Q4_1-wide", "Q5_0-int8", "Q8_0-wide", "Q5_0+Q8_0-int8"])
def test_verify_rows_are_the_steps_bits(tmp_path, linear, wide, types):
    """The C++ step's multi-token verify over rows16 matrices gives each row the one-token step's
    logits bit for bit (speculative decoding's exactness rests on it); with q/k/v of two types, the
    step's joint product of the three (x rounded once for both) gives each its own call's bits."""
    from engine.session import DecodeSession
    planned(linear)
    if types:
        planned(Q.Q8_0)
    lm = _load(tiny_gguf(tmp_path, "llama", linear, types), True, wide)
    assert all(m.rows16 is not None for m in lm.model.modules() if isinstance(m, quant.BlockLinear))
    assert all(m.wide_inputs is wide for m in lm.model.modules() if isinstance(m, quant.BlockLinear))
    s = DecodeSession(lm.model, max_context=256, device=torch.device("cpu"), dtype=torch.float32, cpu_kernel="on")
    s.prefill(list(range(3, 30)))
    before = s.state.snapshot().fixed
    steps = torch.stack([s.step(t)[-1] for t in (5, 9, 200, 7)])
    s.state.unfeed(4, before)
    rows = s._forward([5, 9, 200, 7], verify=True)
    assert torch.equal(rows, steps)


@pytest.mark.parametrize("linear", TYPES, ids=lambda q: q.name)
def test_wide_inputs_keep_the_fp32_steps(tmp_path, linear):
    """`cpu_int8: wide`: the rows16 matrices' inputs rounded to 16 bits, the Q8_0 head's left in
    fp32. The C++ step's logits stay within 1e-3 x max |logit| of its fp32-input step's, step after
    step, with the same greedy tokens, where int8 inputs move them further."""
    from tests.support.blocks import step_logits
    planned(linear)
    lm = _load(tiny_gguf(tmp_path, "llama", linear), True, wide=True)
    assert lm.model.cpu_wide and not any(m.int8_inputs for m in lm.model.modules() if isinstance(m, quant.Q8Linear))
    wide_steps = step_logits(lm, "on")
    models.use_int8_inputs(lm.model, False)
    exact = step_logits(lm, "on")
    models.use_int8_inputs(lm.model, True)
    int8 = step_logits(lm, "on")
    scale = float(exact.abs().max())
    near = float((wide_steps - exact).abs().max())
    assert near <= 1e-3 * scale and torch.equal(wide_steps.argmax(-1), exact.argmax(-1))
    assert float((int8 - exact).abs().max()) > 3 * near


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from models.kernels.cpu import step
step.select_isa(sys.argv[2]); step.load()
from models.quant import rows16
from tests.support.blocks import random_blocks
from gguf import GGMLQuantizationType as Q
out = []
for qtype in rows16.TYPES:
    b = rows16.interleave(torch.from_numpy(random_blocks(qtype, 48, 10, seed=7)), qtype)
    x = torch.randn(11, 320, generator=torch.Generator().manual_seed(8))
    for width in (0, rows16.WIDE):
        y = torch.ops.chat_cpu.block_linear(x, b, rows16.CODE + width + qtype, True)
        out.append(y.view(torch.int32).flatten().tolist())
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not all(f in open("/proc/cpuinfo").read() for f in (" avx2", " fma", " f16c")),
                    reason="needs an AVX2 CPU")
def test_avx2_and_native_builds_give_the_same_bits():
    """AVX-512 VNNI takes a group in one vector, AVX2 in two halves, with the same integers and the
    same fp32 operations a row: the two builds' products are the same bits."""
    outs = []
    for isa in ("native", "avx2"):
        p = subprocess.run([sys.executable, "-c", CHILD, ROOT, isa], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
