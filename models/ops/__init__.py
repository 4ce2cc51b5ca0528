"""The ops the architectures (and the engine's sampler) call: the one way from a forward to a
kernel. Each op takes the tensors of one call and runs the kernel that serves it on this device,
dtype and shape, or says it does not (the `*_serves` / `*_fits` predicates: the planner's serving
rules, models/plan/serving.py, which the plan states at load), where the architecture's torch
form, the oracle, runs instead. Architectures import no kernel module, and nothing here asks a
kernel whether it serves (tests/chat/test_imports.py).

A kernel is looked up at call time, so that a benchmark's or a test's replacement of a kernel
module's function holds for the ops too."""
from __future__ import annotations

from . import attention, cpu, experts, linear, logits, norm, quant, recurrent, serving

__all__ = ["attention", "cpu", "experts", "linear", "logits", "norm", "quant", "recurrent", "serving"]
