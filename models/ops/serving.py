"""Where the device kernels serve a call, as the planner's rules say (models/plan/serving.py, the
one place that asks the kernels: device and dtype `serves`, one token `one_row`, any number
`rows`, per-head sizes `fits`), and the context in which forwards compile their kernels ahead of
a graph capture."""
from __future__ import annotations

import functools

from ..kernels.cuda import base as _base
from ..plan.serving import enabled, fits, one_row, precompiles, rows, serves

__all__ = ["calls", "enabled", "fits", "one_row", "precompile_context", "precompiling_now", "rows", "serves"]


def precompile_context(device, dtype):
    """A context inside which forwards on `device` in `dtype` submit their kernels' compiles in
    parallel instead of running them, or None where no kernel serves them or this Triton cannot."""
    return _base.precompiling() if precompiles(device, dtype) else None


def precompiling_now() -> bool:
    """Whether launches are being skipped (inside a precompile context): the outputs they would
    fill hold garbage, so nothing may read them (no graph is captured over them)."""
    return _base.precompiling_now()


def calls(module, name: str):
    """The op that runs `module.name` as the module holds it at call time (a benchmark's A/B or a
    test's replacement of the kernel holds for the op too), with the kernel's name and contract."""
    kernel = getattr(module, name)

    @functools.wraps(kernel)
    def op(*args, **kwargs):
        return getattr(module, name)(*args, **kwargs)
    return op
