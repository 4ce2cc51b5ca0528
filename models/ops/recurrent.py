"""The fixed-state ops of the hybrids, each the kernel form of a torch oracle in architectures/:
the causal depthwise conv over a window (`causal_conv`), LFM2's short-conv step, the Gated
DeltaNet step (`delta_step`, with its per-head counters) and chunked prefill (`scan_*`), and
Mamba2's step (`ssd_step`) and chunked scan (`ssd_chunk_scan`). Shapes and dtypes: the kernels'
docstrings, which each op carries."""
from __future__ import annotations

import torch

from ..kernels.cuda import conv as _conv, delta as _delta, scan as _scan, shortconv as _shortconv, ssd as _ssd
from .serving import calls

causal_conv = calls(_conv, "causal_conv")
shortconv_step = calls(_shortconv, "decode")
delta_step = calls(_delta, "decode")
delta_counters = calls(_delta, "counters")
ssd_step = calls(_ssd, "decode")
ssd_step_fits = calls(_ssd, "decode_fits")
ssd_chunk_scan = calls(_ssd, "chunk_scan")
ssd_scan_fits = calls(_ssd, "scan_fits")
scan_prepare = calls(_scan, "prepare")
scan_prepare_raw = calls(_scan, "prepare_raw")
scan_solve = calls(_scan, "solve")
scan_solve_fits = calls(_scan, "solve_fits")
scan_fits = calls(_scan, "scan_fits")
chunk_scan = calls(_scan, "chunk_scan")
gated_norm = calls(_scan, "gated_norm")


def conv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """causal_conv serves x [T, C] against weight [C, K]."""
    return _conv.usable(x, weight)
