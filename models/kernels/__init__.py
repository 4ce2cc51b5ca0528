"""Device kernels: the fast forms of the architectures' ops (cuda/: Triton; cpu/: the C++ decode
step). Architectures reach them through models/ops, and whether one serves a call is asked only
by the planner's rules (models/plan/serving.py); a kernel never imports an op or an
architecture. The C++ step is reached through the hook below (an architecture whose models it
can serve offers it as `model.cpu_decode_step(dtype)`; the engine asks the model, not this
package). Where the whole step does not serve a model, its GGUF blocks still go through the C++
library's per-linear kernels (`cpu_block_kernels`)."""
from __future__ import annotations

import torch


class CpuStepUnavailable(RuntimeError):
    """Raised by cpu_decode_step where the C++ step would serve but cannot be built or loaded."""


def configure(*, triton: bool = True, pdl: bool = True, precompile: bool = True, fp8_prefill: str = "tensor",
              fp8_gemv: str = "f16", cache_dir: str | None = None, compiler: str = "g++") -> None:
    """The process-wide switches of the kernels (models.configure: the engine's Environment,
    engine/config.py): the Triton kernels on CUDA at all, programmatic dependent launch, the
    kernels compiled ahead of a graph capture, the FP8 prefill's and GEMV's forms, and where the
    C++ library is cached and what compiles it. Each takes effect for the models loaded after it."""
    switch(triton=triton, pdl=pdl, precompile=precompile, fp8_prefill=fp8_prefill, fp8_gemv=fp8_gemv,
           compiler=compiler, **({"cache_dir": cache_dir} if cache_dir else {}))


def switches() -> dict:
    """The process-wide switches as they are now (configure's names; `triton` False where Triton
    is absent, whatever was asked)."""
    from .cpu import step
    from .cuda import base, fp8, fp8_gemm
    return dict(triton=base.ENABLED, pdl=base.PDL_ENABLED, precompile=base.PRECOMPILE_ENABLED,
                fp8_prefill=fp8_gemm.MODE, fp8_gemv=fp8.FORM, cache_dir=step.CACHE_DIR, compiler=step.COMPILER)


def switch(**changes) -> dict:
    """Some of configure's switches changed, the others kept (a test's or a benchmark's form of a
    switch: the process's API, not the kernels' module globals); returns the switches as they
    were, for `switch(**before)` to put back. An unknown name or value raises ValueError and
    changes nothing."""
    from .cpu import step
    from .cuda import base, fp8, fp8_gemm
    before = switches()
    unknown = sorted(set(changes) - set(before))
    if unknown:
        raise ValueError(f"unknown kernel switch {', '.join(unknown)}: one of {', '.join(before)}")
    new = {**before, **changes}
    if new["fp8_prefill"] not in ("tensor", "dequant") or new["fp8_gemv"] not in ("f16", "f32"):
        raise ValueError(f"fp8_prefill {new['fp8_prefill']!r} / fp8_gemv {new['fp8_gemv']!r}: "
                         "tensor | dequant, f16 | f32")
    base.ENABLED = base.triton is not None and bool(new["triton"])
    base.PDL_ENABLED, base.PRECOMPILE_ENABLED = bool(new["pdl"]), bool(new["precompile"])
    fp8_gemm.MODE, fp8.FORM = new["fp8_prefill"], new["fp8_gemv"]
    step.CACHE_DIR, step.COMPILER = new["cache_dir"], new["compiler"]
    return before


def _step_module(model):
    """The module of the C++ step for this model's architecture (its `cpu_step_kind`): the DeltaNet
    hybrids', the Mamba2 hybrids' or the dense GQA models' (and LFM2's)."""
    from .cpu import hybrid_step, mamba2_hybrid_step, step
    kinds = {"hybrid": hybrid_step, "mamba2": mamba2_hybrid_step}
    return kinds.get(getattr(model, "cpu_step_kind", "dense"), step)


def cpu_step_serves(model, dtype: torch.dtype) -> bool:
    """Whether the C++ step serves decode of this model in `dtype` (built or not)."""
    return _step_module(model).serves(model, dtype)


def select_cpu_isa(isa: str) -> None:
    """The instruction set the C++ library is built for in this process (the `cpu_isa` setting:
    native, avx2, avx512). Raises CpuStepUnavailable where this CPU lacks it."""
    from .cpu import step
    try:
        step.select_isa(isa)
    except step.Unavailable as e:
        raise CpuStepUnavailable(str(e)) from None


def cpu_isa_label() -> str:
    """What the C++ library's vector code is built for, in words (/show)."""
    from .cpu import step
    return step.isa_label()


def cpu_step_built() -> bool:
    """Whether the C++ step's library is already compiled for this machine (cached)."""
    from .cpu import step
    return step.is_built()


def cpu_blocks_served(model, dtype: torch.dtype) -> bool:
    """Whether the C++ library's per-linear kernels serve this model's GGUF blocks (built or not):
    switched on (step.ENABLED), fp32, CPU weights in blocks (or a Q8_0 head)."""
    from .cpu import step
    return step.ENABLED and dtype == torch.float32 and step.has_blocks(model)


def cpu_block_kernels(model, dtype: torch.dtype) -> bool:
    """The C++ library's per-linear kernels attached to the model's GGUF blocks where they serve
    (`cpu_blocks_served`): whether they were. Raises CpuStepUnavailable where they would serve
    but the library cannot be built or loaded here."""
    from .cpu import step
    if not cpu_blocks_served(model, dtype):
        return False
    try:
        step.attach_block_kernels(model, norms=True)
    except step.Unavailable as e:
        raise CpuStepUnavailable(str(e)) from None
    return True


def cpu_kernels_off(model) -> None:
    """The per-linear kernels detached: the torch forms again (cpu_kernel off)."""
    from .cpu import step
    step.detach_block_kernels(model)


def cpu_decode_step(model, dtype: torch.dtype):
    """The C++ one-token step for this model (dense GQA, LFM2, the DeltaNet and Mamba2 hybrids: the
    model's `cpu_step_kind` names which), or None where it does not serve it (the caller then attaches
    the per-linear kernels: `cpu_block_kernels`). Raises CpuStepUnavailable where it would serve
    but cannot be built or loaded here."""
    from .cpu import step
    module = _step_module(model)
    if not module.serves(model, dtype):
        return None
    try:
        return module.STEP(model)
    except step.Unavailable as e:
        raise CpuStepUnavailable(str(e)) from None
