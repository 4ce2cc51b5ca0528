"""CUDA: prefill's weights made ahead on a side stream (models/kernels/cuda/prefill_weights.py)
give the bits of the weights dequantized in line: the same logits, bit for bit, once the order
of the linears is learned, when two models' prefills interleave (each one's successors then
mispredicted at the switch; the models in bf16 and fp32), and in a decode session."""
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from engine.reference import full_logits
from engine.session import DecodeSession

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def tiny(tmp_path, kind, linear, types, embed):
    from test_block_quant import tiny_gguf
    return tiny_gguf(tmp_path, kind, linear, types, embed)


def test_weights_made_ahead_give_the_same_logits(tmp_path):
    from models.kernels.cuda import prefill_weights as pw
    a = models.load(tiny(tmp_path, "llama", Q.Q4_K, {"ffn_down.weight": Q.Q6_K}, Q.Q6_K), CUDA, torch.bfloat16,
                    quantized=True).model
    b = models.load(tiny(tmp_path, "qwen2", Q.Q5_K, None, Q.Q4_K), CUDA, torch.float32, quantized=True).model
    prompt = list(range(3, 60))
    pw.release()
    pw.AHEAD = False
    try:
        ref_a, ref_b = full_logits(a, prompt, CUDA), full_logits(b, prompt, CUDA)
    finally:
        pw.AHEAD = True
    made, taken = pw.counts["made"], pw.counts["taken"]
    for _ in range(2):
        assert torch.equal(full_logits(a, prompt, CUDA), ref_a)
    assert pw.counts["taken"] > taken  # the second prefill took the buffers the first learned to make
    for model, ref in ((b, ref_b), (a, ref_a), (b, ref_b), (a, ref_a)):  # each switch: a misprediction
        assert torch.equal(full_logits(model, prompt, CUDA), ref)
    assert pw.counts["made"] - made > pw.counts["taken"] - taken > 0
    pw.release()


def test_a_session_prefill_with_weights_made_ahead_decodes_the_same(tmp_path):
    """A session's prefill and its greedy tokens (CUDA graph on), without the side stream (which
    learns the order), then with it twice."""
    from engine.config import SamplingConfig
    from models.kernels.cuda import prefill_weights as pw
    lm = models.load(tiny(tmp_path, "llama", Q.Q4_K, {"attn_v.weight": Q.Q6_K}, Q.Q6_K), CUDA, torch.bfloat16,
                     quantized=True)
    prompt = [(7 * i) % 200 + 3 for i in range(300)]
    outs = []
    for ahead in (False, True, True):
        pw.AHEAD = ahead
        s = DecodeSession(lm.model, max_context=512, device=CUDA, dtype=torch.bfloat16, cuda_graph="on")
        outs.append(list(s.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=16))))
    pw.AHEAD = True
    pw.release()
    assert outs[0] == outs[1] == outs[2]
