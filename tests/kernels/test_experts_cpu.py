"""The C++ library's one-token routed experts (experts_decode, models/kernels/cpu/step.cpp), which
quant.BlockExperts takes on the CPU where the library's kernels are attached (a MoE GGUF's torch
step): the same products as its per-expert loop (block_linear per matrix, on fp32 or int8 inputs),
the SwiGLU and the weighted sum in one call. Against the loop (`cpu_kernel` unset) to fp32
summation order; a decode step's logits of a Granite 4.0-H Q8_0 GGUF with it and without."""
import pytest
import torch

from models.quant import layers as quant
from tests.support.quant import gguf_experts


@pytest.fixture(scope="module")
def cpp():
    from models.kernels.cpu import step
    step.load()
    return step


@pytest.mark.parametrize("kind,gate,up,int8", [("Q6_K", "Q4_K", None, False), ("Q6_K", "Q4_K", None, True),
                                               ("Q8_0", "Q8_0", None, True), ("Q8_0", "Q4_K", None, False),
                                               ("Q4_K", "Q4_K", "Q6_K", True), ("Q6_K", "Q8_0", "Q4_K", True)])
def test_one_call_is_the_per_expert_loop(cpp, kind, gate, up, int8):
    # (gate and up of other types, so other row lengths: a mix a file may hold)
    ex = quant.BlockExperts(gguf_experts(6, 256, 256, kind, gate_type=gate, up_type=up, seed=4))
    cpp.attach_block_kernels(ex, norms=True)
    assert ex.cpu_kernel is torch.ops.chat_cpu.experts_decode
    quant.use_int8_inputs(ex, int8)
    gen = torch.Generator().manual_seed(2)
    for trial in range(4):
        x = torch.randn(1, 256, generator=gen)
        idx = torch.randperm(6, generator=gen)[:3][None]
        weights = torch.softmax(torch.randn(1, 3, generator=gen), -1)
        got = ex(x, idx, weights)
        kernel = ex.cpu_kernel
        ex.cpu_kernel = None  # (the loop)
        want = ex(x, idx, weights)
        ex.cpu_kernel = kernel
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    x, weights = torch.randn(1, 256, generator=gen), torch.softmax(torch.randn(1, 3, generator=gen), -1)
    twice = torch.tensor([[4, 1, 4]])  # (an expert chosen twice counts twice, in either form)
    got = ex(x, twice, weights)
    kernel, ex.cpu_kernel = ex.cpu_kernel, None
    want = ex(x, twice, weights)
    ex.cpu_kernel = kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    two = torch.randn(2, 256, generator=gen)  # (more than one row: the loop, whatever is attached)
    assert ex(two, torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5)).shape == (2, 256)


def test_bad_inputs_are_refused(cpp):
    ex = quant.BlockExperts(gguf_experts(4, 256, 256, "Q8_0", gate_type="Q8_0"))
    x = torch.randn(1, 256)
    args = (ex.gate_blocks, ex.up_blocks, ex.down_blocks, *ex.types)
    with pytest.raises(RuntimeError, match="expert 7 of 4"):
        torch.ops.chat_cpu.experts_decode(x, *args, torch.tensor([[7]]), torch.tensor([[1.0]]))
    with pytest.raises(RuntimeError, match="one fp32 CPU row"):
        torch.ops.chat_cpu.experts_decode(torch.randn(2, 256), *args, torch.tensor([[1]]), torch.tensor([[1.0]]))


@pytest.mark.slow
def test_a_granite_q8_0_gguf_decodes_as_with_the_loop(tmp_path, cpp):
    from tests.support.hybrid import decode_logits_with_op, granite_q8_0
    lm = granite_q8_0(tmp_path, "granitemoehybrid_e5")
    op = torch.ops.chat_cpu.experts_decode
    torch.testing.assert_close(decode_logits_with_op(lm, quant.BlockExperts, op, True),
                               decode_logits_with_op(lm, quant.BlockExperts, op, False), rtol=1e-4, atol=1e-4)
