"""The short-conv decode kernel (models/kernels/cuda/shortconv.py) against lfm2.ShortConv's torch
form, over several tokens from the same window: outputs and the window. On CUDA (gpu marker), and
on the CPU under Triton's interpreter where TRITON_INTERPRET=1 and Triton are present."""
import os

import pytest
import torch

from models.architectures import lfm2
from models import kernels


def layer_and_window(device, dtype, C, K, bias):
    cfg = lfm2.Lfm2Config(vocab_size=8, hidden_size=C, intermediate_size=8, layer_types=("conv",), num_heads=1,
                          num_kv_heads=1, head_dim=C, rope_theta=1e4, rms_eps=1e-5, max_position=64,
                          tie_embeddings=False, conv_kernel=K, conv_bias=bias)
    torch.manual_seed(0)
    layer = lfm2.ShortConv(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer = layer.to(device, dtype)
    (name, shape, _), = layer.state().tensors
    return layer, torch.randn(shape, device=device, dtype=dtype)


def compare(device, dtype, C, K, bias, atol, monkeypatch):
    """The kernel (called directly) against the layer's torch form between its two projections,
    over 6 tokens from one window. Both read the same projected input: the input projection has
    its own kernel on CUDA (a GEMV that rounds apart from cuBLAS), which is not under test here."""
    from models.kernels.cuda import shortconv as cuda_shortconv
    layer, window0 = layer_and_window(device, dtype, C, K, bias)
    xs = torch.randn(6, 1, C, device=device, dtype=dtype)
    plain_win, fused_win = window0.clone(), window0.clone()
    weight = layer.conv.weight[:, 0]
    kernels.switch(triton=False)  # the torch forms on any device
    with torch.inference_mode():
        for x in xs:
            bcx = layer.in_proj(x).contiguous()
            fused = cuda_shortconv.decode(bcx, fused_win, weight, layer.conv.bias)
            b, c, xv = bcx.chunk(3, dim=-1)
            plain = c * lfm2.conv_step(b * xv, plain_win, weight, layer.conv.bias).to(c.dtype)
            # bf16: the torch form rounds after each op, the kernel once
            err = float((fused.float() - plain.float()).abs().max())
            assert err <= atol * float(plain.float().abs().max()), err
            assert torch.equal(fused_win, plain_win)  # B * x rounded once, as the torch form rounds it


@pytest.mark.gpu
@pytest.mark.parametrize("C,K,bias", [(2048, 3, False), (300, 3, True), (64, 4, False), (130, 2, True)])
def test_short_conv_decode_kernel_matches_the_torch_form(C, K, bias, monkeypatch):
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    compare(torch.device("cuda"), torch.bfloat16, C, K, bias, 3e-2, monkeypatch)


@pytest.mark.gpu
def test_lfm2_layer_takes_the_kernel_on_cuda(monkeypatch):
    """ShortConv.forward on a one-token bf16 CUDA input runs the kernel (and the same numbers)."""
    from models.kernels.cuda import base as cuda_base, shortconv as cuda_shortconv
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    calls = []
    real = cuda_shortconv.decode
    monkeypatch.setattr(cuda_shortconv, "decode", lambda *a: calls.append(1) or real(*a))
    layer, window = layer_and_window(torch.device("cuda"), torch.bfloat16, 256, 3, False)
    with torch.inference_mode():
        layer(torch.randn(1, 256, device="cuda", dtype=torch.bfloat16), {"conv": window})
    assert calls == [1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's interpreter)")
@pytest.mark.parametrize("C,K,bias", [(300, 3, True), (64, 4, False), (130, 2, True)])
def test_short_conv_kernel_under_the_interpreter(C, K, bias, monkeypatch):
    """fp32 only: the interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even)."""
    pytest.importorskip("triton")
    compare(torch.device("cpu"), torch.float32, C, K, bias, 1e-5, monkeypatch)
