"""Models: architectures (models/architectures), checkpoint formats (models/formats), quantized
weights as modules (models/quant), device kernels (models/kernels), the kernel plan (models/plan)
and the loader (models/loader.py). This package's names are the API that the
engine and the front end use: `load(path_or_alias)` → LoadedModel, `resolve`, `native_dtype`,
the registry and aliases, `configure` (the process's switches and folders, from the engine), `use_int8_inputs` and `int8_by_default` (the `cpu_int8` setting on a
loaded model, and what its `auto` chooses),
the kernel plan (`KernelConfig`, `Plan`: models/plan), `cpu_step_pending` (whether a model's C++ decode step still has
to be compiled, for a start-up notice), `build_cpu_step` (compile it ahead), `select_cpu_isa` (the `cpu_isa` setting: what the C++
library is built for), and the tensor-parallel plan of a checkpoint or a config
(`sharding_plan`, `config_plan`, `local_model`: models/sharding.py)."""
from __future__ import annotations

from .formats.checkpoints import CheckpointError
from . import loader as _loader
from .loader import (ALIASES, DEFAULT_ALIAS, REGISTRY, LoadedModel, build_model, config_plan, fuse,
                             local_model, materialize, native_dtype, read_checkpoint, resolve, sharding_plan,
                             text_config)
from .quant.layers import cpu_rounding, int8_by_default, rounding_by_default, use_int8_inputs
from .kernels import CpuStepUnavailable, cpu_isa_label, cpu_step_built, select_cpu_isa
from .plan import KernelConfig, Plan

__all__ = ["ALIASES", "DEFAULT_ALIAS", "REGISTRY", "CheckpointError", "LoadedModel", "build_model", "fuse", "load",
           "materialize", "native_dtype", "read_checkpoint", "resolve", "text_config", "cpu_step_pending",
           "sharding_plan", "config_plan", "local_model", "use_int8_inputs", "int8_by_default", "rounding_by_default", "cpu_rounding", "select_cpu_isa", "cpu_isa_label",
           "CpuStepUnavailable", "KernelConfig", "Plan", "configure", "build_cpu_step"]


def configure(*, triton: bool = True, pdl: bool = True, precompile: bool = True, fp8_prefill: str = "tensor",
              fp8_gemv: str = "f16", cache_dir: str | None = None, compiler: str = "g++") -> None:
    """This process's switches and folders, as the engine reads them from the environment
    (engine/config.py's Environment; engine/device.py's configure_process): the kernels' (see
    models.kernels.configure) and the folder of the GGUF indexes (`cache_dir`/gguf-index). A
    process that never calls it runs the defaults, with ~/.cache/chat as its cache folder."""
    import os

    from .formats import checkpoints
    from .kernels import configure as configure_kernels
    configure_kernels(triton=triton, pdl=pdl, precompile=precompile, fp8_prefill=fp8_prefill, fp8_gemv=fp8_gemv,
                      cache_dir=cache_dir, compiler=compiler)
    if cache_dir:
        checkpoints.INDEX_DIR = os.path.join(cache_dir, "gguf-index")


def load(path_or_alias: str, device="cpu", dtype=None, quantized: bool = False, shard=None,
         kernels: KernelConfig | None = None) -> LoadedModel:
    """loader.load (see there: `quantized`, `shard`), then the kernel plan bound to the
    model (models/plan: the weights its rules read in another layout repacked, once): the
    LoadedModel's `plan`. `kernels`: the KernelConfig the plan follows (its defaults where None)."""
    import torch

    from . import plan as kernel_plan
    dtype = torch.float32 if dtype is None else dtype
    config = kernels or kernel_plan.DEFAULT
    loaded = _loader.load(path_or_alias, device, dtype, quantized=quantized, shard=shard,
                          q4_blocks=kernel_plan.q4_in_blocks(device, dtype, config))
    loaded.plan = kernel_plan.bind(loaded.model, device, dtype, config)
    _loader.release_freed_memory()  # (what a repack replaced)
    return loaded


def build_cpu_step() -> int:
    """Build (or find in the cache) the C++ decode step's library for this machine; prints its path
    or why it was not built, and returns the exit status (engine/prepare.py, `make chat`)."""
    from .kernels.cpu import step
    return step.main()


def cpu_step_pending(model, dtype) -> bool:
    """Whether decoding `model` in `dtype` on the CPU would first compile the C++ step."""
    serves = getattr(model, "cpu_step_serves", None)
    return serves is not None and serves(dtype) and not cpu_step_built()
