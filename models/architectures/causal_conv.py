"""The torch forms of a causal depthwise convolution over time that continues a window of the
last K-1 inputs (the conv state of LFM2's short convolutions, Mamba2's and Gated DeltaNet's conv;
the engine's StateManager owns the window). `conv_prefill` takes T inputs, `conv_step` one; both
leave the window as the next call expects it (oldest input first). On CUDA conv_prefill hands the
inputs to kernels/cuda/conv.py's kernel (the layers' decode steps run step kernels of their own).
A step is the window times the weights, summed: mkldnn's depthwise conv1d took ~250 us for one
position of 6,144 channels on the 2-core CPU (bench/RESULTS.md, CPU hybrid GGUFs).

Contract: weight [C, K] (Conv1d's [C, 1, K] squeezed), state [C, K-1] updated in place, x [T, C];
the result [T, C] in weight's dtype: sum_j weight[c, j] * window[c, t + j] (+ bias).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cuda import conv as cuda_conv


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv of T inputs continuing from the window `state` (updated in place).
    x: [T, C]; state: [C, K-1] (the last K-1 inputs, oldest first); weight: [C, K]. Returns [T, C]."""
    if cuda_conv.usable(x, weight):  # one kernel, no copy of the window
        return cuda_conv.causal_conv(x, state, weight, bias)
    window = torch.cat((state, x.t().to(state.dtype)), dim=1)  # [C, K-1+T]
    state.copy_(window[:, -state.shape[1]:])
    return F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0].t()


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """One token: the window shifts by one in place. x: [1, C]; state: [C, K-1]. Returns [1, C].
    Summed in fp32 and rounded once to weight's dtype, as conv1d's half-precision forms sum."""
    xt = x[0].to(weight.dtype)
    w = weight.float()
    out = (state.float() * w[:, :-1]).sum(-1) + xt.float() * w[:, -1]
    if bias is not None:
        out = out + bias.float()
    state[:, :-1].copy_(state[:, 1:].clone())
    state[:, -1].copy_(xt)
    return out.to(weight.dtype)[None]
