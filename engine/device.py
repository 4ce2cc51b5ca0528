"""Device, dtype and thread choices from EngineConfig; `auto` resolved once, loudly."""
from __future__ import annotations

import os

import torch

from .config import ConfigError, EngineConfig, Environment, environment

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but no CUDA device is available; use --device cpu")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: EngineConfig, device: torch.device, native: tuple[str | None, str] = (None, "")
                  ) -> tuple[torch.dtype, str]:
    """(the compute dtype, why, in words for the load line and /show). `native`: the checkpoint's
    own dtype and what says so (models.native_dtype). `auto`: float32 on the CPU (its kernels
    compute in fp32; the 4-bit ones round inside); on CUDA the checkpoint's own dtype, where it
    names a float type, else bfloat16."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype], "set by dtype"
    if device.type != "cuda":
        return torch.float32, "auto: the CPU computes in float32"
    name, source = native
    if name in _DTYPES:
        return _DTYPES[name], f"auto: {source}"
    return torch.bfloat16, "auto: the checkpoint names no dtype"


def physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        n = len(cores)
    except OSError:
        n = 0
    return max(1, min(n or (os.cpu_count() or 1), len(os.sched_getaffinity(0))))


def configure_threads(cfg: EngineConfig) -> int:
    n = cfg.threads or physical_cores()
    torch.set_num_threads(n)
    return n


_configured: Environment | None = None  # (what configure_process last handed down)


def configure_process(env: Environment | None = None) -> Environment:
    """Hand this process's Environment (engine/config.py: the environment's diagnosis switches,
    cache folder and compiler) to the models and their kernels, before a model loads; returns it.
    A bad diagnosis value is a ConfigError."""
    import models
    global _configured
    env = environment() if env is None else env
    _configured = env
    models.configure(triton=env.triton, pdl=env.pdl, precompile=env.precompile, fp8_prefill=env.fp8_prefill,
                     fp8_gemv=env.fp8_gemv, cache_dir=env.cache_dir, compiler=env.compiler)
    return env


def kernel_config(cfg: EngineConfig, env: Environment | None = None):
    """The kernel plan's config (models/plan) for these engine settings and this environment: the
    C++ CPU kernels where cpu_kernel is not off and nothing else takes the step (compile: on,
    tensor-parallel ranks), their rounded inputs with cpu_int8: on (auto: None, the planner's
    int8_by_default); no Triton kernels where CHAT_TRITON switches them off (a plan for CUDA made
    on a host without one then says so too). `env`: where None, the one configure_process
    handed down, else this process's environment."""
    from models.plan import KernelConfig
    env = env or _configured or environment()
    return KernelConfig(cpu_kernel=cfg.cpu_kernel != "off" and cfg.compile == "off" and cfg.tensor_parallel == 1,
                        cpu_int8=None if cfg.cpu_int8 == "auto" else cfg.cpu_int8 in ("on", "wide"),
                        cpu_wide=cfg.cpu_int8 == "wide",
                        triton=None if env.triton else False)


# Peak memory bandwidth of the GPUs whose name torch reports, bytes a second (the vendors' sheets);
# another GPU is measured (measure_bandwidth)
GPU_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12,
                 "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100-SXM4-40GB": 1.555e12,
                 "A100-PCIE-40GB": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "RTX 4090": 1.008e12}


def memory_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes a second a decode step can read at best, where that figure comes from): a CUDA
    device's peak from GPU_BANDWIDTH by its name, else measured by a copy (`measure_bandwidth`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_BANDWIDTH.items():
            if key in name:
                return peak, f"{name}'s peak"
    return measure_bandwidth(device), f"measured: a {_COPY_BYTES >> 20} MiB copy on {_where(device)}"


_COPY_BYTES = 256 << 20


def _where(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()} CPU threads"


def measure_bandwidth(device: torch.device, rounds: int = 5) -> float:
    """Bytes a second read and written by the fastest of `rounds` copies of 256 MiB (a copy reads
    and writes each byte once: what a decode step's streaming reads get at best, near enough)."""
    import time
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * _COPY_BYTES / best
