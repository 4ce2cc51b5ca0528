"""The mixture-of-experts ops on CUDA: routing (`route`: softmax and top k on the device), one
token's chosen experts (`experts`, or its two halves; the planar quantized halves as
`planar_gate_up` / `planar_down`), and a prefill's pairs sorted by expert (`sort_pairs`), its
grouped GEMMs (`grouped_gate_up` / `grouped_down`, where `grouped_fits`) and the weighted sum
(`combine`, or with the next residual add and RMSNorm, `combine_add_rms_norm`); the sizes the
grouped GEMMs take: the planner's rule (models/plan/serving.py). The torch forms,
the oracle, are architectures/moe.py's."""
from __future__ import annotations

from ..kernels.cuda import grouped as _grouped, moe as _moe, qplanar as _qplanar
from ..plan.serving import grouped_fits
from .serving import calls

__all__ = ["combine", "combine_add_rms_norm", "experts", "experts_down", "experts_gate_up", "grouped_down",
           "grouped_fits", "grouped_gate_up", "planar_down", "planar_gate_up", "route", "sort_pairs"]

route = calls(_moe, "route")
experts = calls(_moe, "experts")
experts_gate_up = calls(_moe, "experts_gate_up")
experts_down = calls(_moe, "experts_down")
planar_gate_up = calls(_qplanar, "experts_gate_up")
planar_down = calls(_qplanar, "experts_down")
sort_pairs = calls(_moe, "sort_pairs")
combine = calls(_moe, "combine")
combine_add_rms_norm = calls(_moe, "combine_add_rms_norm")
grouped_gate_up = calls(_grouped, "gate_up")
grouped_down = calls(_grouped, "down")
