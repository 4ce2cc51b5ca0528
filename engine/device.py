"""Device, dtype and thread choices from EngineConfig; `auto` resolved once, loudly."""
from __future__ import annotations

import os

import torch

from .config import ConfigError, EngineConfig

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
