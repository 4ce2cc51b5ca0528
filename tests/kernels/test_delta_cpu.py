"""The C++ library's Gated DeltaNet decode step (delta_decode, models/kernels/cpu/delta_step.h),
which a hybrid's torch step takes on the CPU where its GGUF blocks go through the per-linear
kernels, against the layer's torch form: one-token steps from random non-zero conv and recurrent
states (after a 3-token prefill), as Qwen3.5 configures the layer and as OLMo-Hybrid does (beta =
2 sigmoid(b), the gated norm's own eps), key heads serving one or two value heads, odd head sizes.
Tolerance: fp32 summation order, rtol 1e-4 / atol 1e-5 on the outputs and both states."""
import pytest
import torch

from models.kernels.cpu import step as cpu_step
from tests.support.hybrid import delta_layer_and_states
from tests.support.hybrid import library_step_is_torch_step


@pytest.mark.parametrize("nk,nv,dk,dv,olmo", [(2, 4, 64, 64, False), (2, 2, 24, 40, True), (1, 3, 16, 8, False)])
def test_the_library_step_is_the_torch_step(nk, nv, dk, dv, olmo):
    cpu_step.load()
    layer, states = delta_layer_and_states(torch.device("cpu"), torch.float32, nk=nk, nv=nv, dk=dk, dv=dv, olmo=olmo)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    library_step_is_torch_step(layer, states, x, torch.ops.chat_cpu.delta_decode, "recurrent")


def test_the_per_linear_kernels_attach_it_and_cpu_kernel_off_detaches_it():
    from models.architectures.qwen3_5 import GatedDeltaNet
    layer, _ = delta_layer_and_states(torch.device("cpu"), torch.float32, nk=2, nv=2, dk=16, dv=16, olmo=False)
    net = torch.nn.ModuleList([layer])
    cpu_step.attach_block_kernels(net)
    assert layer.cpu_kernel is None  # (the whole C++ step's attach: no norms, no delta step)
    cpu_step.attach_block_kernels(net, norms=True)
    assert layer.cpu_kernel is torch.ops.chat_cpu.delta_decode and layer.norm.cpu_kernel is not None
    cpu_step.detach_block_kernels(net)
    assert layer.cpu_kernel is None and GatedDeltaNet.cpu_kernel is None and layer.norm.cpu_kernel is None
