"""Device kernels: the fast forms of the architectures' ops (cuda/: Triton; cpu/: the C++ decode
step). Architectures import the kernel modules they call; a kernel never imports an
architecture. The C++ step is reached through the hook below (an architecture whose models it
can serve offers it as `model.cpu_decode_step(dtype)`; the engine asks the model, not this
package)."""
from __future__ import annotations

import torch


class CpuStepUnavailable(RuntimeError):
    """Raised by cpu_decode_step where the C++ step would serve but cannot be built or loaded."""


def cpu_step_serves(model, dtype: torch.dtype) -> bool:
    """Whether the C++ step serves decode of this dense GQA model in `dtype` (built or not)."""
    from .cpu import step
    return step.serves(model, dtype)


def cpu_step_built() -> bool:
    """Whether the C++ step's library is already compiled for this machine (cached)."""
    from .cpu import step
    return step.is_built()


def cpu_decode_step(model, dtype: torch.dtype):
    """The C++ one-token step for this dense GQA model, or None where it does not serve it.
    Raises CpuStepUnavailable where it would serve but cannot be built or loaded here."""
    from .cpu import step
    if not step.serves(model, dtype):
        return None
    try:
        return step.CpuStep(model)
    except step.Unavailable as e:
        raise CpuStepUnavailable(str(e)) from None
