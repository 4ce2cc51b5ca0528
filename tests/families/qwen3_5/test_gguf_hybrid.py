"""GGUF files of the hybrid and MoE families, written by llama.cpp's own converter from tiny HF
checkpoints: `qwen35`, `qwen35moe`, `qwen3next` and `qwen3moe` load to the model the HF directory
loads (its tensor names, the ssm_* tensors, its fused and split tensors, the value-head order and
the values it stores transformed), with the tokenizer, template and stop ids of the file.

The converter only recognises tokenizers by hash, so these conversions name the pre-tokenizer
(`qwen2`); the tokenizers themselves are checked against llama.cpp's vectors in
test_gguf_vocab.py. llama.cpp's MoE graphs renormalise the top-k weights and route every layer,
so the MoE checkpoints here do too.
"""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession
from tests.support.parity import TOL, rand_ids, session
from tests.support.tiny_gguf import mapped_spans

pytestmark = pytest.mark.slow  # (each test converts a checkpoint with llama.cpp's converter)

# kind → (tiny.py overrides the converter needs, converter options, the GGUF architecture)
CASES = {
    "qwen3_5": ({}, ("--no-mtp",), "qwen35"),
    "qwen3_5_moe": ({}, ("--no-mtp",), "qwen35moe"),
    "qwen3_next": ({"mlp_only_layers": []}, ("--no-mtp",), "qwen3next"),
    "qwen3_moe": ({"mlp_only_layers": [], "norm_topk_prob": True}, (), "qwen3moe"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.support.llama_cpp_tree import convert
    from tests.support.tiny import write_checkpoint
    out = {}
    for kind, (over, options, _) in CASES.items():
        d = tmp_path_factory.mktemp(kind)
        hf_dir = write_checkpoint(kind, str(d / "hf"), **over)
        out[kind] = (hf_dir, convert(hf_dir, str(d / f"{kind}.gguf"), "f32", pre="qwen2", options=options))
    return out


@pytest.mark.parametrize("kind", CASES)
def test_gguf_logits_and_greedy_tokens_equal_the_hf_directory(converted, kind):
    import gguf
    hf_dir, path = converted[kind]
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == CASES[kind][2]
    ours, ref = models.load(path), models.load(hf_dir)
    assert ours.model_type == ref.model_type
    ids = rand_ids(70, 3)
    assert (session(ours).prefill(ids, all_logits=True) - session(ref).prefill(ids, all_logits=True)).abs().max() <= TOL
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    prompt = rand_ids(25, 4)
    assert list(session(ours).generate(prompt, greedy)) == list(session(ref).generate(prompt, greedy))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_gguf_tokenizer_template_and_stop_ids(converted, kind):
    hf_dir, path = converted[kind]
    ours, ref = models.load(path), models.load(hf_dir)
    text = "<|im_start|>user\nhello there, 1234 the other<|im_end|>\n"
    assert ours.tokenizer.encode(text, add_special_tokens=False).ids == \
        ref.tokenizer.encode(text, add_special_tokens=False).ids
    assert ours.chat_template == ref.chat_template
    assert 2 in ours.eos_ids


def test_value_heads_are_reordered_back(converted):
    """qwen35's converter tiles the value heads (2 key heads, 4 value heads here): without the
    reorder the GGUF model differs from the HF one."""
    from models.formats import checkpoints
    hf_dir, path = converted["qwen3_5"]
    ckpt = checkpoints.load_gguf(path)
    z = ckpt.tensors["model.layers.0.linear_attn.in_proj_z.weight"]
    from safetensors.torch import load_file
    ref = load_file(hf_dir + "/model.safetensors")["model.layers.0.linear_attn.in_proj_z.weight"]
    assert torch.equal(z, ref)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_q8_0_hybrid_moe_keeps_its_blocks_with_value_heads_reordered(converted, tmp_path, kind):
    """Kept Q8_0 blocks take the value-head reorder by whole rows (and Qwen3-Next's fused qkvz and
    ba rows their split into Qwen3.5's layout: a GGUF loaded with its blocks failed there); the
    model stays within the quantized tolerance of the same file dequantized (a wrong row order is
    far outside it)."""
    from tests.support.llama_cpp_tree import convert
    from models.quant import layers as quant
    hf_dir, _ = converted[kind]
    path = convert(hf_dir, str(tmp_path / "q8.gguf"), "q8_0", pre="qwen2", options=("--no-mtp",))
    q, ref = models.load(path, quantized=True), models.load(path)
    assert any(isinstance(m, quant.BlockLinear) for m in q.model.modules())
    ids = rand_ids(40, 3)
    a, b = session(ref).prefill(ids, all_logits=True), session(q).prefill(ids, all_logits=True)
    assert float((a - b).abs().max()) <= 0.02 * float(a.abs().max())


@pytest.fixture(scope="module")
def q8_hybrid(converted, tmp_path_factory):
    """The tiny qwen3_5 as llama.cpp's converter writes it in Q8_0."""
    from tests.support.llama_cpp_tree import convert
    return convert(converted["qwen3_5"][0], str(tmp_path_factory.mktemp("q8") / "q8.gguf"), "q8_0", pre="qwen2",
                   options=("--no-mtp",))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_block_linears_read_through_the_cpu_librarys_kernels(converted, q8_hybrid, kind, tmp_path):
    """The GGUF blocks on the CPU take the library's kernels through the whole C++ step (the Q8_0
    qwen3_5, and the qwen3_5_moe with Q4_0 experts read by BlockExperts, its routed layers the
    step's moe_mlp): a session's decode steps and prefill equal, to the quantized tolerance, the
    torch forms on a second load of the file; cpu_kernel off detaches them again."""
    from gguf import GGMLQuantizationType as Q

    from models.quant import layers as quant
    from tests.support.tiny_gguf import requantize
    path = q8_hybrid if kind == "qwen3_5" else \
        requantize(converted[kind][1], str(tmp_path / "q4-experts.gguf"), {"_exps.weight": Q.Q4_0})
    lm, reference = models.load(path, quantized=True), models.load(path, quantized=True)
    s = DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32, cpu_kernel="on")
    # (the whole C++ step, which attaches the same kernels)
    assert s.decode_path.startswith("C++ step") and not lm.model.cpu_block_kernels
    kinds = (quant.BlockExperts,) if kind == "qwen3_5_moe" else (quant.BlockLinear,)
    kept = [m for m in lm.model.modules() if isinstance(m, kinds)]
    assert kept and all(m.fp32_kernel is not None and m.dequant_kernel is not None for m in kept)
    r = DecodeSession(reference.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32,
                      cpu_kernel="off")
    assert all(m.fp32_kernel is None for m in reference.model.modules() if isinstance(m, kinds))
    prompt, tokens = rand_ids(30, 5), [5, 9, 200, 7, 7, 31]
    got = torch.stack([s.prefill(prompt)[-1]] + [s.step(t)[-1] for t in tokens])
    want = torch.stack([r.prefill(prompt)[-1]] + [r.step(t)[-1] for t in tokens])
    # (the tied Q8_0 head's torch form sums in bf16, the library's q8_linear in fp32: ~0.3% apart here)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    DecodeSession(lm.model, max_context=16, device=torch.device("cpu"), dtype=torch.float32, cpu_kernel="off")
    assert not lm.model.cpu_block_kernels and all(m.fp32_kernel is None for m in kept)


def test_value_head_projections_keep_their_blocks(converted, q8_hybrid):
    """qwen35 in Q8_0: attn_qkv's tiled value rows move whole (its blocks kept), ssm_out stays
    as stored with its columns tiled (config linear_out_proj_tiled: the layer feeds it its heads
    in that order); nothing of a delta layer's projections is dequantized, and the model stays
    within the quantized tolerance of the same file dequantized, greedy tokens equal."""
    from models.formats import checkpoints
    from models.quant import layers as quant
    from models.formats import gguf_tensors
    path = q8_hybrid
    ckpt = checkpoints.load_gguf(path, keep_quantized=True)
    assert ckpt.config["linear_out_proj_tiled"] and not ckpt.notes
    for name in ("in_proj_qkv", "out_proj"):
        assert isinstance(ckpt.tensors[f"model.layers.0.linear_attn.{name}.weight"], gguf_tensors.GgufTensor)
    assert "linear_out_proj_tiled" not in checkpoints.load_gguf(path).config  # dequantized: HF's order
    q, ref = models.load(path, quantized=True), models.load(path)
    delta = q.model.model.layers[0].linear_attn
    assert delta.out_tiled and isinstance(delta.out_proj, quant.BlockLinear)
    ids = rand_ids(40, 3)
    a, b = session(ref).prefill(ids, all_logits=True), session(q).prefill(ids, all_logits=True)
    assert float((a - b).abs().max()) <= 0.02 * float(a.abs().max())
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    assert list(session(q).generate(ids, greedy)) == list(session(ref).generate(ids, greedy))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_a_shared_expert_gate_stored_flat_loads(converted, kind, tmp_path):
    """llama.cpp's quantizer writes the [1, hidden] shared-expert gate as [hidden] (ggml drops
    outer dims of 1): such a file loads to the model the converter's file loads."""
    from gguf import GGUFReader

    from tests.support.tiny_gguf import requantize
    path = requantize(converted[kind][1], str(tmp_path / "flat.gguf"), {}, flat=("ffn_gate_inp_shexp.weight",))
    assert [len(t.shape) for t in GGUFReader(path).tensors if t.name.endswith("ffn_gate_inp_shexp.weight")][0] == 1
    ids = rand_ids(24, 5)
    got, want = models.load(path, quantized=True), models.load(converted[kind][1], quantized=True)
    assert torch.equal(session(got).prefill(ids, all_logits=True), session(want).prefill(ids, all_logits=True))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_4bit_moe_gguf_keeps_its_experts_quantized_and_mapped(converted, kind, tmp_path):
    """The converter's file with its experts requantized to Q4_0: on the CPU the experts stay the
    file's mapped blocks (BlockExperts), and the model computes what the dequantized file does."""
    from gguf import GGMLQuantizationType as Q

    from models.quant import layers as quant
    from tests.support.tiny_gguf import requantize
    path = requantize(converted[kind][1], str(tmp_path / "q4-experts.gguf"), {"_exps.weight": Q.Q4_0})
    q, ref = models.load(path, quantized=True), models.load(path)
    experts = [layer.mlp.experts for layer in q.model.model.layers]
    assert all(isinstance(e, quant.BlockExperts) for e in experts)
    assert "Q4_0" in q.weight_bytes and q.n_params == ref.n_params
    spans = mapped_spans(path)
    assert spans and all(any(lo <= b.data_ptr() < hi for lo, hi in spans)
                         for e in experts for b in (e.gate_blocks, e.up_blocks, e.down_blocks))
    ids = rand_ids(40, 3)
    assert (session(q).prefill(ids, all_logits=True) - session(ref).prefill(ids, all_logits=True)).abs().max() <= TOL
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    assert list(session(q).generate(ids, greedy)) == list(session(ref).generate(ids, greedy))


def test_multi_token_prediction_layers_are_skipped(converted, tmp_path):
    """Released Qwen3.5 checkpoints carry an MTP block (`mtp.*`), which the converter writes by
    default as an extra block of nextn tensors (block_count + 1, nextn_predict_layers 1): the
    model loads without it and equals the HF directory, which skips `mtp.*` too."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.support.llama_cpp_tree import convert
    hf_dir = str(tmp_path / "with-mtp")
    shutil.copytree(converted["qwen3_5_moe"][0], hf_dir)
    tensors = load_file(hf_dir + "/model.safetensors")
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1."):  # a full-attention layer as the MTP block's layer
            tensors["mtp.layers.0." + name[len("model.layers.1."):]] = t.clone()
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(64)
    save_file(tensors, hf_dir + "/model.safetensors")
    config = json.load(open(hf_dir + "/config.json"))
    json.dump(dict(config, mtp_num_hidden_layers=1), open(hf_dir + "/config.json", "w"))
    path = convert(hf_dir, str(tmp_path / "mtp.gguf"), "f32", pre="qwen2")
    import gguf
    assert gguf.GGUFReader(path).fields["qwen35moe.nextn_predict_layers"].contents() == 1
    ours, ref = models.load(path), models.load(hf_dir)
    assert len(ours.model.model.layers) == 4
    ids = rand_ids(30, 2)
    assert (session(ours).prefill(ids, all_logits=True) - session(ref).prefill(ids, all_logits=True)).abs().max() <= TOL


def _mixed_file(converted, tmp_path) -> str:
    """The tiny qwen35 with its Gated DeltaNet projections in three block types, as quantized files
    mix them (llama.cpp's Q4_K_M: attn_qkv Q6_K in some layers, attn_gate Q4_K), of the types
    gguf-py's quantizers write: attn_qkv Q8_0, attn_gate Q5_0, ssm_alpha and ssm_beta Q4_0 (4 rows
    each), ssm_out Q8_0."""
    from gguf import GGMLQuantizationType as Q

    from tests.support.tiny_gguf import requantize
    return requantize(converted["qwen3_5"][1], str(tmp_path / "mixed.gguf"),
                      {"attn_qkv.weight": Q.Q8_0, "attn_gate.weight": Q.Q5_0, "ssm_alpha.weight": Q.Q4_0,
                       "ssm_beta.weight": Q.Q4_0, "ssm_out.weight": Q.Q8_0})


def test_delta_projections_of_three_types_keep_their_blocks_on_the_cpu(converted, tmp_path):
    """The mixed file on the CPU with its blocks kept: the Q4_0 b and a of 4 rows, which torch's int4
    packer does not take (whole 16-row groups only; it raises), stay in their blocks; a prefill and
    decode steps give the dequantized file's logits (to the fp16 KV cache the C++ step keeps with
    quantized weights: the dequantized file's is fp32)."""
    from models.quant import layers as quant
    path = _mixed_file(converted, tmp_path)
    lm = models.load(path, quantized=True)
    delta = next(layer.linear_attn for layer in lm.model.model.layers if layer.linear)
    assert [m.ggml_type for m in delta.in_projs] == [8, 6, 2, 2] and all(
        isinstance(m, quant.BlockLinear) for m in delta.in_projs)
    prompt, steps = rand_ids(21, 8), rand_ids(6, 9)
    a, b = session(lm), session(models.load(path))
    assert a.state.kv_dtype == torch.float16 and b.state.kv_dtype == torch.float32
    assert (a.prefill(prompt) - b.prefill(prompt)).abs().max() <= 5e-4
    for t in steps:
        assert (a.step(t) - b.step(t)).abs().max() <= 5e-4


@pytest.mark.gpu
def test_delta_projections_of_three_types_run_the_cuda_step_kernel(converted, tmp_path, monkeypatch):
    """The mixed file (_mixed_file) loaded on CUDA in bf16 with its blocks kept: each delta layer's
    projections fuse in groups (qkv, z, b+a) and its decode steps run the CUDA step kernel on
    their joined outputs; the logits of a prefill and of decode steps, graph on and off (the same bits), agree with the
    CPU's fp32 forward on the file's dequantized weights."""
    from models.kernels.cuda import delta as cuda_delta
    path = _mixed_file(converted, tmp_path)
    gpu = models.load(path, torch.device("cuda"), torch.bfloat16, quantized=True)
    deltas = [layer.linear_attn for layer in gpu.model.model.layers if layer.linear]
    assert deltas and all(len(d.in_projs) == 3 for d in deltas)
    calls = []
    monkeypatch.setattr(cuda_delta, "decode",
                        lambda *a, _real=cuda_delta.decode, **kw: (calls.append(1), _real(*a, **kw))[1])
    prompt, steps = rand_ids(21, 8), rand_ids(6, 9)
    ref = session(models.load(path))
    want = torch.cat([ref.prefill(prompt).reshape(1, -1)] + [ref.step(t).reshape(1, -1) for t in steps]).float()
    got = {}
    for graph in ("off", "on"):
        s = DecodeSession(gpu.model, max_context=128, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph=graph, eos_ids=())
        rows = [s.prefill(prompt).reshape(1, -1).float().clone()]  # (a graph's logits: one buffer, overwritten)
        calls.clear()  # (the session's start runs scratch steps of its own)
        rows += [s.step(t).reshape(1, -1).float().clone() for t in steps]
        got[graph] = torch.cat(rows).float().cpu()
        if graph == "off":
            assert len(calls) == len(steps) * len(deltas), (len(calls), len(deltas))
    assert torch.equal(got["on"], got["off"])
    err = (got["off"] - want).abs().max() / want.abs().max()
    assert err <= 0.05, float(err)
