"""CUDA: quantized checkpoints stay quantized on the GPU (GGUF blocks as stored: quant.BlockLinear /
BlockEmbedding; HF FP8 / AWQ / GPTQ: hf_quant's linears) and compute what the dequantized fp32
model computes, on tiny checkpoints of each format written here.

Documented tolerances, against the same file loaded dequantized (every weight widened to fp32):
  - fp32 model, whole-prompt forward (rows dequantized by the kernel in fp32, then the GEMM):
    max |logit difference| <= 1e-4 x the largest |logit|;
  - fp32 model, decode steps in a CUDA graph (the dequant-GEMV: fp32 sums in another order):
    <= 1e-4 x the largest |logit|, the same greedy tokens as the dequantized model;
  - bf16 model, decode steps in a CUDA graph: <= 5e-2 x the largest |logit| (bf16 activations),
    and the same tokens with graphs on and off;
  - GPU memory: the quantized weights take their file's bytes (+ 5% and 1 MB for norms and the
    allocator).
"""
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from engine.config import SamplingConfig
from engine.reference import full_logits
from engine.session import DecodeSession
from models.formats import gguf_blocks
from models.quant import layers as quant
from models.plan import KernelConfig

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
Q4_K_M = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K}
GGUF_CASES = [("llama", Q.Q4_0, None, Q.Q8_0), ("qwen2", Q.Q4_1, None, Q.Q4_0),
              ("llama", Q.Q5_0, None, Q.Q5_1), ("qwen2", Q.Q5_1, {"attn_v.weight": Q.Q8_0}, Q.Q5_0),
              ("llama", Q.Q4_K, Q4_K_M, Q.Q6_K), ("qwen2", Q.Q5_K, None, Q.Q4_K),
              ("llama", Q.Q6_K, None, Q.Q6_K), ("qwen2", Q.Q8_0, None, Q.Q8_0)]
# The K-quants and the 5-bit types twice: every matrix repacked (PLANAR_MIN_WEIGHTS 0: for qplanar.py's
# GEMV, or qruns.py's runs; qwen2's tied Q5_0 head with its embedding), and as the loader leaves a tiny
# model's matrices by default (their blocks kept: qlinear.py's GEMV); the Q4_K_M mix a third time with
# both in one model (128 Ki: the 256 Ki-weight gate/up repacked, the others kept)
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
FIVE_BIT = (Q.Q5_0, Q.Q5_1)
MIXED = 1 << 17
GGUF_RUNS = [c + (0,) for c in GGUF_CASES if c[1] in KQUANTS + FIVE_BIT] + [c + (None,) for c in GGUF_CASES] + \
    [c + (MIXED,) for c in GGUF_CASES if c[2] is Q4_K_M]
IDS = [f"{k}-{q.name}-embd_{e.name}" + {None: "", 0: "-planar", MIXED: "-mixed"}[m] for k, q, t, e, m in GGUF_RUNS]


def tiny_gguf(tmp_path, kind, linear, types, embed):
    from tests.support.blocks import tiny_gguf as write
    return write(tmp_path, kind, linear, types, embed)


def step_logits(lm, dtype, graph, prompt, steps):
    s = DecodeSession(lm.model, max_context=256, device=CUDA, dtype=dtype, cuda_graph=graph)
    s.prefill(prompt)
    # a copy of each step's row: with the graph on, step() returns the graph's one output buffer
    return torch.stack([s.step(t)[-1].float().clone() for t in steps])


def greedy(lm, dtype, graph, prompt):
    s = DecodeSession(lm.model, max_context=256, device=CUDA, dtype=dtype, cuda_graph=graph)
    return list(s.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=24)))


def close(a, b, rel):
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


def kernel_config(planar_min, tied=True):
    """The plan's config for a planar_min case: None, the defaults; else every matrix of more than
    planar_min weights repacked (runs types too), and with 0 a tied head in runs (not the default,
    kept working)."""
    if planar_min is None:
        return KernelConfig()
    return KernelConfig(planar_min_weights=planar_min, runs_min_weights=planar_min, tied_runs=tied and planar_min == 0)


def check_against_dequantized(path, quantized_types, ref_path=None, kernels=None):
    ref = models.load(ref_path or path, CUDA, torch.float32)
    q32 = models.load(path, CUDA, torch.float32, quantized=True, kernels=kernels)
    kinds = {name for name in q32.weight_bytes if name.isupper()}
    assert kinds >= set(quantized_types), (kinds, quantized_types)
    prompt, steps = list(range(3, 60)), [5, 9, 200, 7, 7, 31, 4, 100]
    a, b = full_logits(q32.model, prompt, CUDA), full_logits(ref.model, prompt, CUDA)
    assert close(a, b, 1e-4) and torch.equal(a.argmax(-1), b.argmax(-1))
    assert close(step_logits(q32, torch.float32, "on", prompt, steps),
                 step_logits(ref, torch.float32, "off", prompt, steps), 1e-4)
    assert greedy(q32, torch.float32, "on", prompt) == greedy(ref, torch.float32, "off", prompt)
    del q32
    q16 = models.load(path, CUDA, torch.bfloat16, quantized=True, kernels=kernels)
    assert close(step_logits(q16, torch.bfloat16, "on", prompt, steps),
                 step_logits(ref, torch.float32, "off", prompt, steps), 5e-2)
    assert greedy(q16, torch.bfloat16, "on", prompt) == greedy(q16, torch.bfloat16, "off", prompt)
    return q16


@pytest.mark.parametrize("kind,linear,types,embed,planar_min", GGUF_RUNS, ids=IDS)
def test_gguf_blocks_on_cuda_match_the_dequantized_model(tmp_path, kind, linear, types, embed,
                                                          planar_min):
    kernels = kernel_config(planar_min)
    path = tiny_gguf(tmp_path, kind, linear, types, embed)
    names = {linear.name, embed.name} | {t.name for t in (types or {}).values()}
    q16 = check_against_dequantized(path, names, kernels=kernels)
    layer = q16.model.model.layers[0]
    mlp = layer.mlp
    gate_up = mlp.gate_up_proj  # fused; as stored, or repacked as Q4KR, Q50R, Q51R (runs.py), Q5KP or Q6KP (planar.py)
    assert isinstance(gate_up, quant.BlockLinear) and all(t.is_cuda for t in gate_up.stored())
    runs_type = linear in (Q.Q4_K,) + FIVE_BIT
    least = kernels.runs_min_weights if runs_type else kernels.planar_min_weights
    assert gate_up.planar == ((linear in KQUANTS and gate_up.in_features % 256 == 0 or linear in FIVE_BIT)
                              and gate_up.in_features * gate_up.out_features > least)
    embed_tokens, head = q16.model.model.embed_tokens, q16.model.lm_head
    if planar_min == 0 and kind == "qwen2" and embed in FIVE_BIT + (Q.Q4_K,):  # a tied head in runs, shared
        assert embed_tokens.planar and head.planar and embed_tokens.words is head.words
        assert not hasattr(embed_tokens, "blocks") and q16.weight_bytes[embed.name] > 0
    if planar_min == MIXED:  # the Q6_K down and the Q4_K attention keep their blocks beside it
        assert gate_up.planar and not mlp.down_proj.planar and not layer.self_attn.o_proj.planar
    assert isinstance(q16.model.model.embed_tokens, quant.BlockEmbedding)
    assert q16.weight_format.startswith("GGUF ") and linear.name in q16.weight_format


@pytest.mark.parametrize("planar_min", [0, None], ids=["planar", "default"])
def test_gguf_on_cuda_takes_the_files_bytes(tmp_path, planar_min):
    """GPU memory of a Q4_K_M-like tiny GGUF on CUDA: its blocks' bytes, not bf16's: every K-quant
    matrix repacked, as a large model's are (planar_min 0), or (the default on a tiny model) every
    one kept in its blocks, the file's bytes exactly."""
    import gguf
    kernels = kernel_config(planar_min, tied=False)
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, Q4_K_M, Q.Q6_K)
    reader = gguf.GGUFReader(path)
    file_bytes = {}
    for t in reader.tensors:
        name = gguf_blocks.type_name(int(t.tensor_type))
        file_bytes[name] = file_bytes.get(name, 0) + int(t.n_bytes)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    lm = models.load(path, CUDA, torch.bfloat16, quantized=True, kernels=kernels)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before
    got = lm.weight_bytes
    # Q6KP holds Q6_K's bytes; one_storage may round each of a linear's three parts up to 16 bytes
    q6kp = sum(1 for m in lm.model.modules() if isinstance(m, quant.BlockLinear) and m.planar_fmt == "Q6KP")
    assert 0 <= got["Q6_K"] - file_bytes["Q6_K"] <= 48 * q6kp, (got["Q6_K"], file_bytes["Q6_K"], q6kp)
    # Q4_K linears repacked as Q4KR (quant/runs.py): 148 bytes a super-block row against 144;
    # the embedding keeps the file's blocks
    embed = lm.model.model.embed_tokens
    embed_q4k = embed.blocks.numel() if isinstance(embed, quant.BlockEmbedding) and embed.ggml_type == Q.Q4_K else 0
    q4k = [m for m in lm.model.modules() if isinstance(m, quant.BlockLinear) and m.ggml_type == Q.Q4_K]
    q4kr = sum(m.out_features * m.in_features // 256 for m in q4k if m.planar_fmt == "Q4KR")
    assert all(m.planar_fmt in ("", "Q4KR") for m in q4k)
    if planar_min is None:  # (a tiny model's matrices: Q6_K in its blocks; Q4_K in runs where RUNS_MIN_WEIGHTS is 0)
        assert q6kp == 0 and got["Q6_K"] == file_bytes["Q6_K"], got
        assert (q4kr > 0) == (kernels.runs_min_weights == 0), q4kr
    else:
        assert q4kr == (file_bytes["Q4_K"] - embed_q4k) // 144
    assert got["Q4_K"] == file_bytes["Q4_K"] + 4 * q4kr, (got["Q4_K"], file_bytes["Q4_K"], q4kr)
    quantized = sum(v for k, v in file_bytes.items() if k.startswith("Q"))
    f32 = file_bytes.get("F32", 0)
    assert used <= 1.05 * (quantized + f32 // 2) + (1 << 20), (used, quantized)


HF_CASES = [("llama", "fp8"), ("qwen2", "awq"), ("llama", "gptq"), ("qwen2", "gptq_asym"), ("qwen3_5", "fp8"),
            ("qwen3_5", "gptq_v2")]


@pytest.mark.parametrize("kind,method", HF_CASES, ids=[f"{k}-{m}" for k, m in HF_CASES])
def test_hf_quantized_on_cuda_match_the_dequantized_model(tmp_path, kind, method):
    from models.quant import hf_layers
    from tests.support.tiny_hf_quant import write_quantized
    qdir, rdir = write_quantized(kind, str(tmp_path), method)
    name = {"fp8": "FP8", "awq": "AWQ"}.get(method, "GPTQ")
    q16 = check_against_dequantized(qdir, {name}, rdir)
    linears = [m for m in q16.model.modules() if isinstance(m, (hf_layers.Fp8Linear, hf_layers.GroupInt4Linear))]
    assert linears and all(m.qweight().data.is_cuda for m in linears)
    # on CUDA: groups of whole 32-weight runs as stored (qruns.py), others INT4P (qplanar.py)
    assert all(m.qweight().fmt == ("INT4" if m.group % 32 == 0 else "INT4P") for m in linears
               if isinstance(m, hf_layers.GroupInt4Linear))
    assert name in q16.weight_format
