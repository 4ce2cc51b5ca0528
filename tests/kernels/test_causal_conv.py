"""The prefill's causal depthwise conv (models/kernels/cuda/conv.py) against the torch form the
layers use without it (cat of the state and the inputs, conv1d, SiLU): the output, and the state
it leaves, at prompt lengths shorter than the window, equal to it and longer, from a non-zero
state, with and without bias and SiLU, on a slice of a wider projection. Run by Triton's
interpreter on the CPU (where Triton is importable) and compiled on the device. And the torch form
itself on the CPU (causal_conv.conv_prefill: shifted rows times weight columns) against conv1d,
bit for bit."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import run_interpreted

CASES = [(T, K, bias, silu) for T in (1, 2, 3, 5, 40, 100) for K, bias, silu in ((4, False, True), (3, True, False),
                                                                                 (4, True, True))]


def check(device, dtype, C, cases, tol):
    from models.kernels.cuda import conv
    g = torch.Generator().manual_seed(C)
    for T, K, bias, silu in cases:
        big = torch.randn(T, C + 37, generator=g).to(device, dtype)
        x = big[:, 5:5 + C]  # a slice of a wider projection's rows
        st0 = torch.randn(C, K - 1, generator=g).to(device, dtype)
        w = torch.randn(C, 1, K, generator=g).to(device, dtype)
        b = torch.randn(C, generator=g).to(device, dtype) if bias else None
        st = st0.clone()
        y = conv.causal_conv(x, st, w, b, silu)
        window = torch.cat((st0, x.t()), 1)
        ref = F.conv1d(window[None].float(), w.float(), None if b is None else b.float(), groups=C)[0].t()
        ref = F.silu(ref) if silu else ref
        assert y.dtype == dtype and y.shape == (T, C)
        assert float((y.float() - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max())), (T, K, bias, silu)
        assert torch.equal(st, window[:, -(K - 1):]), (T, K)


INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.kernels.test_causal_conv import CASES, check
check(torch.device("cpu"), torch.float32, 200, CASES, 1e-5)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not importable here")
def test_causal_conv_under_the_interpreter_equals_the_torch_form():
    run_interpreted(INTERPRETED)


@pytest.mark.gpu
def test_causal_conv_on_the_device_equals_the_torch_form():
    """bf16 at the 35B-A3B-like DeltaNet's channels (8192) and an odd count: one rounding of the
    fp32 sum (2^-8 of the largest output)."""
    from models.kernels.cuda import base as cuda_base
    if not torch.cuda.is_available() or not cuda_base.ENABLED:
        pytest.skip("needs CUDA and Triton")
    check(torch.device("cuda"), torch.bfloat16, 8192, [(2048, 4, False, True), (7, 4, True, True), (2, 3, True, False)],
          2 ** -7)
    check(torch.device("cuda"), torch.bfloat16, 1000, CASES, 2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_conv_prefill_is_conv1d_bit_for_bit(dtype):
    """conv_prefill's CPU form sums the window's K shifted rows times a column of weights each in
    fp32, the bias first, and rounds once: the same bits as conv1d's depthwise form over a
    window of the state and the inputs (what it replaced, at a third of its time), and the state
    left as the last K-1 inputs; T shorter than the window, equal and longer, K = 3 and 4."""
    from models.architectures.causal_conv import conv_prefill
    g = torch.Generator().manual_seed(1)
    for T, K, bias in [(1, 4, False), (2, 3, True), (3, 4, True), (40, 4, False), (257, 4, True), (100, 3, False)]:
        C = 96 + T
        x = torch.randn(T, C, generator=g).to(dtype)
        st0 = torch.randn(C, K - 1, generator=g).to(dtype)
        w = torch.randn(C, K, generator=g).to(dtype)
        b = torch.randn(C, generator=g).to(dtype) if bias else None
        st = st0.clone()
        y = conv_prefill(x, st, w, b)
        window = torch.cat((st0, x.t()), 1)
        ref = F.conv1d(window[None], w[:, None, :], b, groups=C)[0].t()
        assert y.dtype == dtype and torch.equal(y, ref), (T, K, bias, float((y.float() - ref.float()).abs().max()))
        assert torch.equal(st, window[:, -(K - 1):])
