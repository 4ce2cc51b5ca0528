"""GGUF matrices kept in their blocks on the CPU (quant.BlockLinear / BlockEmbedding, the C++
step's block kernels) against the dequantized fp32 path on the same file.

Documented tolerance, every block type (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0 inside the layers;
tiny checkpoints written here): prefill multiplies exactly gguf-py's dequantized weights, and the
C++ step's block_linear applies each block's scale to its partial sum, so the only differences
are fp32 rounding (the order of the sums, where the scale is applied) and, under the C++ step,
the fp16 KV cache it keeps with quantized weights, as with 4-bit ones:
  - a whole-prompt forward (prefill: rows dequantized a block at a time, then a GEMM):
    max |logit difference| <= 1e-4 x the largest |logit|, the same argmax everywhere;
  - C++ decode steps against the torch steps on the same quantized model: <= 2e-3 x the
    largest |logit| (the fp16 cache), the same greedy tokens.
"""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

import models
from models.formats import gguf_blocks
from models.quant import layers as quant
from tests.support.blocks import QUANTIZED, bits, random_blocks
from tests.support.tiny_gguf import mapped_spans
from tests.support.blocks import Q4_K_M, SIZES, cpu_session, step_logits, tiny_gguf

BLOCK = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return torch.ops.chat_cpu


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_cpp_dequant_equals_gguf_bit_for_bit(cpp, qtype):
    raw = random_blocks(qtype, rows=37, blocks_per_row=12 if qtype < Q.Q4_K else 3, seed=5)
    want = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))
    got = cpp.block_dequant(torch.from_numpy(raw), int(qtype))
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cpp_block_linear_is_the_dequantized_product(cpp, qtype, rows):
    raw = random_blocks(qtype, rows=45, blocks_per_row=16 if qtype < Q.Q4_K else 2, seed=rows)
    raw2 = torch.from_numpy(raw)
    k = gguf_blocks.row_weights(int(qtype), raw.shape[1])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = cpp.block_linear(x, raw2, int(qtype)).double()
    ref = x.double() @ gguf_blocks.dequantize(raw2, int(qtype)).double().t()
    scale = x.double().abs() @ gguf_blocks.dequantize(raw2, int(qtype)).double().abs().t()
    assert torch.all((got - ref).abs() <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", BLOCK, ids=lambda t: t.name)
def test_block_linear_module_torch_path(qtype, monkeypatch):
    """The torch path (no kernel set): rows dequantized a few at a time, then a GEMM per chunk."""
    raw = random_blocks(qtype, rows=70, blocks_per_row=8 if qtype < Q.Q4_K else 1, seed=2)
    lin = quant.BlockLinear(torch.from_numpy(raw), int(qtype))
    monkeypatch.setattr(quant, "_DEQUANT_ELEMENTS", 3 * lin.in_features)  # chunks of 3 rows
    x = torch.randn(5, lin.in_features, dtype=torch.float64)
    w = gguf_blocks.dequantize(torch.from_numpy(raw), int(qtype)).double()
    # float64 inputs: exact weights, float64 sums in another order
    assert torch.all((lin(x) - x @ w.t()).abs() <= 1e-12 * (x.abs() @ w.abs().t()))


# --- tiny checkpoints of each format ----------------------------------------------------------


CASES = [("llama", Q.Q5_0, None, Q.Q5_1), ("qwen2", Q.Q5_1, {"attn_v.weight": Q.Q8_0}, Q.Q5_0),
         ("llama", Q.Q4_K, Q4_K_M, Q.Q6_K),
         ("qwen2", Q.Q5_K, None, Q.Q4_K), ("llama", Q.Q6_K, None, Q.Q6_K)]
IDS = [f"{k}-{q.name}{'+' + '+'.join(sorted({x.name for x in t.values()})) if t else ''}-embd_{e.name}"
       for k, q, t, e in CASES]


@pytest.mark.parametrize("kind,linear,types,embed", CASES, ids=IDS)
def test_tiny_gguf_blocks_match_the_dequantized_forward(tmp_path, kind, linear, types, embed):
    from engine.reference import full_logits
    path = tiny_gguf(tmp_path, kind, linear, types, embed)
    ref, q = models.load(path), models.load(path, quantized=True)
    blocks = [m for m in q.model.modules() if isinstance(m, quant.BlockLinear)]
    kinds = {gguf_blocks.type_name(m.ggml_type) for m in blocks}
    assert linear.name in kinds and all(t.name in kinds for t in (types or {}).values())
    if embed != Q.Q8_0:  # the embedding table (and qwen2's tied head) read as stored
        assert isinstance(q.model.model.embed_tokens, quant.BlockEmbedding)
    assert q.n_params == ref.n_params
    ids = list(range(3, 70))
    a, b = full_logits(ref.model, ids), full_logits(q.model, ids)
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max()), float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_tied_q8_0_table_of_a_vocabulary_torchs_packer_does_not_take(tmp_path):
    """A tied Q8_0 embedding of 328 rows (not whole 16-row groups, which torch's int4 packer needs
    for the Q8_0 head's two int4 planes; it raises): the table and the head stay in their blocks,
    and compute the dequantized file's logits."""
    from engine.reference import full_logits
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf
    path = write_gguf("qwen2", str(tmp_path / "v328.gguf"), hf_model("qwen2", vocab_size=328, **SIZES), Q.Q8_0,
                      embed_type=Q.Q8_0)
    ref, q = models.load(path), models.load(path, quantized=True)
    assert isinstance(q.model.model.embed_tokens, quant.BlockEmbedding) and isinstance(q.model.lm_head, quant.BlockLinear)
    ids = list(range(3, 70))
    a, b = full_logits(ref.model, ids), full_logits(q.model, ids)
    assert a.shape[-1] == 328 and float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


@pytest.mark.parametrize("kind,linear,types,embed", CASES, ids=IDS)
def test_cpp_step_on_tiny_block_ggufs(tmp_path, kind, linear, types, embed):
    """The C++ step reads the blocks directly; the torch step dequantizes them: same logits to
    fp32 summation order and the fp16 cache, step after step, and the same greedy tokens."""
    from engine.config import SamplingConfig
    from models.kernels.cpu import step as cpu_step
    path = tiny_gguf(tmp_path, kind, linear, types, embed)
    # two loads: a C++ step sets its kernels on the model's block modules (its prefill then uses
    # them too), so the torch side must be a model no C++ step has touched
    cpp, ref = models.load(path, quantized=True), models.load(path, quantized=True)
    assert cpu_step.supports(cpp.model)
    got, want = step_logits(cpp, "on"), step_logits(ref, "off")
    assert all(m.fp32_kernel is None for m in ref.model.modules() if isinstance(m, quant.BlockLinear))
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max()), float((got - want).abs().max())
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    assert list(cpu_session(cpp, "on").generate(list(range(3, 40)), greedy)) == \
        list(cpu_session(ref, "off").generate(list(range(3, 40)), greedy))


def test_blocks_are_the_files_mapped_pages(tmp_path):
    """Kept blocks are views of the GGUF's memory mapping (no copy): their addresses lie in a
    mapping of the file itself; llama's permuted Q/K rows are the exception (copied)."""
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    lm = models.load(path, quantized=True)
    spans = mapped_spans(path)
    assert spans

    def mapped(t):
        p = t.data_ptr()
        return any(lo <= p < hi for lo, hi in spans)
    layer = lm.model.model.layers[0]
    assert mapped(layer.self_attn.v_proj.blocks) and mapped(layer.mlp.down_proj.blocks)
    assert mapped(lm.model.model.embed_tokens.blocks)
    assert not mapped(layer.self_attn.q_proj.blocks)  # reordered rows: a copy


def test_other_types_are_dequantized_with_a_note(tmp_path):
    """A type the CPU does not keep (MXFP4 here) is widened to fp32 with one line saying so;
    F32 tensors are not mentioned."""
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf
    path = write_gguf("qwen2", str(tmp_path / "iq.gguf"), hf_model("qwen2"), Q.Q4_1,
                      {"ffn_down.weight": Q.MXFP4})
    lm = models.load(path, quantized=True)
    assert lm.notes == ["2 MXFP4 tensors dequantized to fp32 (kept in blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                        "Q4_K, Q5_K, Q6_K)"]
    assert isinstance(lm.model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert models.load(path).notes == []  # the dequantized path widens everything: nothing to say


def test_weight_format_names_types_and_bytes(tmp_path):
    lm = models.load(tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K), quantized=True)
    fmt = lm.weight_bytes
    assert set(fmt) >= {"Q4_K", "Q6_K", "float32"}
    n = 256 * 512  # one ffn_down in Q6_K: 210 bytes per 256 weights
    assert fmt["Q6_K"] >= 2 * n // 256 * 210
    assert lm.weight_format.startswith("GGUF Q") and "MB" in lm.weight_format
    assert models.load(lm.source).weight_format.startswith("float32 ")


def test_the_benchmarks_q4_k_m_writer():
    """bench/requantize.py (the Q4_K_M file of the benchmarks): its K-quant blocks decode through
    gguf-py to the weights within a few percent, and its type rules are llama.cpp's."""
    import importlib.util
    import os

    from tests.support.paths import ROOT
    spec = importlib.util.spec_from_file_location("requantize", os.path.join(ROOT, "bench", "requantize.py"))
    rq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rq)
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    for qtype, fn, rms in ((Q.Q4_K, rq.quantize_q4_k, 0.1), (Q.Q6_K, rq.quantize_q6_k, 0.03)):
        got = np.asarray(gguf_dequantize(fn(w), qtype), dtype=np.float32)
        assert got.shape == w.shape and np.sqrt(((got - w) ** 2).mean()) <= rms * w.std()
    assert rq.q4_k_m_type("token_embd.weight", 30, tied=True) == "Q6_K"
    assert [rq.q4_k_m_type(f"blk.{i}.ffn_down.weight", 30, False) for i in (0, 3, 4, 5, 27)] == \
        ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert rq.q4_k_m_type("blk.4.attn_q.weight", 30, False) == "Q4_K" and rq.FALLBACK["Q4_K"] == "Q5_0"
