"""The fixed-state ops of the hybrids, each the kernel form of a torch oracle in architectures/:
the causal depthwise conv over a window (`causal_conv`), LFM2's short-conv step, the Gated
DeltaNet step (`delta_step`, with its per-head counters) and chunked prefill (`scan_*`), and
Mamba2's step (`ssd_step`) and chunked scan (`ssd_chunk_scan`). Shapes and dtypes: the kernels'
docstrings, which each op carries; the sizes each takes: the planner's rules
(models/plan/serving.py)."""
from __future__ import annotations

from ..kernels.cuda import conv as _conv, delta as _delta, scan as _scan, shortconv as _shortconv, ssd as _ssd
from ..plan.serving import conv_serves, scan_fits, scan_solve_fits, ssd_scan_fits, ssd_step_fits
from .serving import calls

__all__ = ["causal_conv", "chunk_scan", "conv_serves", "delta_counters", "delta_step", "gated_norm", "scan_fits",
           "scan_prepare", "scan_prepare_raw", "scan_solve", "scan_solve_fits", "shortconv_step", "ssd_chunk_scan",
           "ssd_scan_fits", "ssd_step", "ssd_step_fits"]

causal_conv = calls(_conv, "causal_conv")
shortconv_step = calls(_shortconv, "decode")
delta_step = calls(_delta, "decode")
delta_counters = calls(_delta, "counters")
ssd_step = calls(_ssd, "decode")
ssd_chunk_scan = calls(_ssd, "chunk_scan")
scan_prepare = calls(_scan, "prepare")
scan_prepare_raw = calls(_scan, "prepare_raw")
scan_solve = calls(_scan, "solve")
chunk_scan = calls(_scan, "chunk_scan")
gated_norm = calls(_scan, "gated_norm")
