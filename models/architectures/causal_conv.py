"""The torch forms of a causal depthwise convolution over time that continues a window of the
last K-1 inputs (the conv state of LFM2's short convolutions, Mamba2's and Gated DeltaNet's conv;
the engine's StateManager owns the window). `conv_prefill` takes T inputs, `conv_step` one; both
leave the window as the next call expects it (oldest input first). On CUDA conv_prefill hands the
inputs to the conv kernel (ops.recurrent.causal_conv) (the layers' decode steps run step kernels of their own).
A step is the window times the weights, summed: mkldnn's depthwise conv1d is slow for one position
on the CPU (a hybrid GGUF's decode: bench/hybrid_gguf.py).

Contract: weight [C, K] (Conv1d's [C, 1, K] squeezed), state [C, K-1] updated in place, x [T, C];
the result [T, C] in weight's dtype: sum_j weight[c, j] * window[c, t + j] (+ bias).
"""
from __future__ import annotations

import torch

from ..ops import recurrent as recurrent_ops


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv of T inputs continuing from the window `state` (updated in place).
    x: [T, C]; state: [C, K-1] (the last K-1 inputs, oldest first); weight: [C, K]. Returns [T, C]."""
    if recurrent_ops.conv_serves(x, weight):  # one kernel, no copy of the window
        return recurrent_ops.causal_conv(x, state, weight, bias)
    # K shifted rows of the window times a column of weights each, summed in fp32 (the bias
    # first) and rounded once: bit for bit conv1d's depthwise form on the CPU (measured, fp32 and
    # bf16, with and without a bias), and faster (a hybrid GGUF's prompt: bench/hybrid_gguf.py)
    T, K = x.shape[0], weight.shape[1]
    window = torch.cat((state.t(), x.to(state.dtype)), dim=0)  # [K-1+T, C]
    state.copy_(window[-state.shape[1]:].t())
    win, w = window.to(weight.dtype).float(), weight.float()
    out = bias.float().expand(T, -1).clone() if bias is not None else win[0:T] * w[:, 0]
    for j in range(0 if bias is not None else 1, K):
        out.addcmul_(win[j:j + T], w[:, j])
    return out.to(weight.dtype)


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
