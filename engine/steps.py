"""The decode step a DecodeSession runs, chosen once when it opens (`choose`): the model itself
(eager; on CUDA its Triton kernels, which the session graphs where cuda_graph allows), its
torch.compile'd form (compile: on), or on the CPU the model's C++ step (cpu_kernel: auto | on,
`model.cpu_decode_step(dtype)`).

Contract: every form is called as the model is, `fn(tokens, positions, state, ...)`, on the same
state buffers, and gives the model's logits (the C++ step: as tests/kernels/test_cpu_step.py and
tests/kernels/test_hybrid_step.py bound them). `kv_dtype` is the KV-cache dtype a form keeps where it
keeps its own (the C++ step over 4-bit weights: fp16, half the bytes a long context's step reads),
else None; `note` says why auto fell back to the torch step, for the front end to show. A setting
that cannot hold here (cpu_kernel: on where no C++ step serves) is a ConfigError."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import ConfigError


@dataclass
class DecodeStep:
    fn: Callable[..., Any]
    note: str = ""          # why the C++ step does not run where cpu_kernel: auto asked for it
    compiled: bool = False  # torch.compile'd (the session compiles a CPU one before its first turn)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        return getattr(self.fn, "kv_dtype", None)

    @property
    def verify(self):
        """The form's exact multi-token verify (the C++ step's), or None."""
        return getattr(self.fn, "verify", None)


def choose(model, device: torch.device, dtype: torch.dtype, *, compile: str = "off",
           cpu_kernel: str = "auto") -> DecodeStep:
    """The step for these settings (module docstring)."""
    if cpu_kernel == "on" and (device.type != "cpu" or compile == "on"):
        raise ConfigError("cpu_kernel: 'on' is the CPU's decode step (with compile: off); use auto or off")
    if device.type == "cpu" and compile == "off" and cpu_kernel != "off":
        return _cpu_kernel_step(model, dtype, cpu_kernel == "on")
    if device.type == "cpu" and hasattr(model, "cpu_kernels_off"):
        model.cpu_kernels_off()  # (an earlier session over this model may have attached them)
    if compile != "on":
        return DecodeStep(model)
    if device.type == "cuda":
        return DecodeStep(torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=False),
                          compiled=True)
    # The CPU step attends over the live slots, one more each step: dynamic shapes, one compile.
    # The C++ wrapper calls the generated kernels without Python between them, faster than the
    # Python wrapper (bench/cpu_bench.py --compile on).
    compiled = torch.compile(model, dynamic=True, fullgraph=False, options={"cpp_wrapper": True})

    def step_fn(*args, **kwargs):
        # the model's float constants (eps, scales) as constants: with symbolic floats the trace
        # is redone once (a first attempt of ~15 s thrown away)
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return DecodeStep(step_fn, compiled=True)


def _cpu_kernel_step(model, dtype: torch.dtype, required: bool) -> DecodeStep:
    """The model's C++ decode step, or the model itself where it has none for this model and
    dtype, or (auto) where it cannot be built here, with a note saying why. Required (on): those
    are errors."""
    hook = getattr(model, "cpu_decode_step", None)
    try:
        step = hook(dtype) if hook is not None else None
    except RuntimeError as e:  # models.kernels.CpuStepUnavailable: no compiler, a failed build
        if required:
            raise ConfigError(f"cpu_kernel: on, but the CPU decode kernel is unavailable ({e}); "
                              "use cpu_kernel: auto or off") from None
        return DecodeStep(model, note=f"CPU decode kernel unavailable ({e}); decoding with the torch step")
    if step is not None:
        return DecodeStep(step)
    if required and not getattr(model, "cpu_block_kernels", False):  # (its GGUF blocks on the C++ library: served)
        raise ConfigError("cpu_kernel: on, but this model has no CPU decode kernel (the dense GQA "
                          "models, LFM2 and the DeltaNet and Mamba2 hybrids in float32 have one); use "
                          "cpu_kernel: auto or off")
    return DecodeStep(model)
