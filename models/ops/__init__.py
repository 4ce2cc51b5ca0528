"""The ops the architectures call: the one way from a model's forward to a kernel. Each op takes
the tensors of one call and runs the kernel that serves it on this device, dtype and shape, or
says it does not (the `*_serves` predicates), where the architecture's torch form, the oracle,
runs instead. Architectures import no kernel module (tests/chat/test_imports.py); the planner
(models/plan) reads the same predicates to say, at load, what each op site will run.

A kernel is looked up at call time, so that a benchmark's or a test's replacement of a kernel
module's function holds for the ops too."""
from __future__ import annotations

from . import attention, cpu, experts, linear, norm, recurrent, serving

__all__ = ["attention", "cpu", "experts", "linear", "norm", "recurrent", "serving"]
