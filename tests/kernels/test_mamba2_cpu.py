"""The C++ library's Mamba2 decode step (mamba2_decode, models/kernels/cpu/mamba2_step.h), which a
Mamba2 hybrid's torch step takes on the CPU where its GGUF blocks go through the per-linear
kernels, against the mixer's torch form: one-token steps from random non-zero conv and ssm states
(after a 3-token prefill), with and without the conv's bias, one and several groups, a finite and
an open dt range. Tolerance: fp32 summation order, rtol 1e-4 / atol 1e-5 on the outputs and both
states; a Granite 4.0-H Q8_0 GGUF's decode logits with the library's kernels against without."""
import pytest
import torch

from models.architectures.mamba2 import Mamba2Mixer
from models.kernels.cpu import step as cpu_step
from tests.support.hybrid import library_step_is_torch_step
from tests.support.hybrid import decode_logits_with_op, granite_q8_0


def mixer_and_states(H, P, N, G, K, bias, dt_limit, seed=0):
    torch.manual_seed(seed)
    hidden = 48
    m = Mamba2Mixer(hidden, H, P, N, G, K, 1e-5, conv_bias=bias, dt_limit=dt_limit)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.A_log.uniform_(-1, 1.5)
        m.norm.weight.uniform_(0.5, 1.5)
    m.reset_buffers("cpu")
    st = {name: torch.randn(shape) * 0.5 for name, shape in (("conv", (m.conv_dim, K - 1)), ("ssm", (H, P, N)))}
    return m, st, torch.randn(7, hidden)


@pytest.mark.parametrize("H,P,N,G,K,bias,dt_limit", [
    (4, 8, 16, 1, 4, True, (0.0, float("inf"))),
    (6, 16, 8, 2, 4, False, (0.01, 0.1)),
    (2, 64, 128, 1, 2, True, (0.001, float("inf"))),
    (8, 4, 32, 4, 3, True, (0.0, float("inf"))),
])
def test_the_library_step_is_the_torch_step(H, P, N, G, K, bias, dt_limit):
    cpu_step.load()
    layer, states, x = mixer_and_states(H, P, N, G, K, bias, dt_limit)
    library_step_is_torch_step(layer, states, x, torch.ops.chat_cpu.mamba2_decode, "ssm")


def test_bad_shapes_are_refused():
    cpu_step.load()
    layer, st, x = mixer_and_states(4, 8, 16, 1, 4, True, (0.0, float("inf")))
    zx = layer.in_proj(x[:1])
    with pytest.raises(RuntimeError, match="one token's projection"):
        torch.ops.chat_cpu.mamba2_decode(zx[:, :-1], st["conv"], layer.conv1d.weight.detach(), None, st["ssm"],
                                         layer.A, layer.dt_bias32, layer.D32, layer.norm.weight.detach(), 1e-5, 0.0,
                                         float("inf"), 4, 8, 16, 1)


def test_the_per_linear_kernels_attach_it_and_cpu_kernel_off_detaches_it():
    layer, _, _ = mixer_and_states(4, 8, 16, 1, 4, True, (0.0, float("inf")))
    net = torch.nn.ModuleList([layer])
    cpu_step.attach_block_kernels(net)
    assert layer.cpu_kernel is None  # (the whole C++ step's attach: no per-layer ops)
    cpu_step.attach_block_kernels(net, norms=True)
    assert layer.cpu_kernel is torch.ops.chat_cpu.mamba2_decode
    cpu_step.detach_block_kernels(net)
    assert layer.cpu_kernel is None and Mamba2Mixer.cpu_kernel is None


@pytest.mark.slow
def test_a_granite_q8_0_gguf_decodes_as_without_the_library(tmp_path):
    lm = granite_q8_0(tmp_path, position_embedding_type="nope")
    assert "C++ step: Mamba2 mixer" in lm.plan.kernels()  # (the whole step serves it; here the torch step's op)
    op = torch.ops.chat_cpu.mamba2_decode
    torch.testing.assert_close(decode_logits_with_op(lm, Mamba2Mixer, op, True),
                               decode_logits_with_op(lm, Mamba2Mixer, op, False), rtol=1e-4, atol=1e-4)
