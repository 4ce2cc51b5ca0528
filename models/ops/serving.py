"""Where the device kernels serve a call: device and dtype (`serves`), one token (`one_row`: the
decode kernels) or any number (`rows`: the multi-token forms), per-head sizes (`fits`), and the
context in which forwards compile their kernels ahead of a graph capture."""
from __future__ import annotations

import functools

import torch

from ..kernels.cuda import base as _base


def enabled() -> bool:
    """The Triton kernels are importable here and switched on (kernels.configure)."""
    return _base.ENABLED


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The Triton kernels serve forwards on this device in this dtype (CUDA, half precision, on)."""
    return _base.serves(device, dtype)


def one_row(x: torch.Tensor) -> bool:
    """The one-token kernels serve this forward: `serves`, one row, outside torch.compile."""
    return _base.usable(x)


def rows(x: torch.Tensor) -> bool:
    """The multi-token kernels serve this forward: `serves`, outside torch.compile."""
    return _base.prefill_usable(x)


def fits(*dims: int, least: int = 1) -> bool:
    """The per-head kernels take these sizes (powers of two, at least `least`)."""
    return _base.fits(*dims, least=least)


def precompile_context(device: torch.device, dtype: torch.dtype):
    """A context inside which forwards on `device` in `dtype` submit their kernels' compiles in
    parallel instead of running them, or None where no kernel serves them or this Triton cannot."""
    if _base.serves(device, dtype) and _base.can_precompile():
        return _base.precompiling()
    return None


def calls(module, name: str):
    """The op that runs `module.name` as the module holds it at call time (a benchmark's A/B or a
    test's replacement of the kernel holds for the op too), with the kernel's name and contract."""
    kernel = getattr(module, name)

    @functools.wraps(kernel)
    def op(*args, **kwargs):
        return getattr(module, name)(*args, **kwargs)
    return op
