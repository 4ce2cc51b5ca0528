"""Engine and sampling settings: small frozen dataclasses validated on construction.

Each field carries its own domain (type, lower and upper bound or allowed values) and a human
description of it, declared once beside its default: every entry (config file, flag, CHAT_*
variable, `/set`, a recording's settings) is checked against it, and every error names the key,
the bad value (at most ~80 characters of it: `quote`) and the allowed values. `coerce()` turns the
strings that come from environment variables and flags into the field's type.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A setting has an unknown key or a bad value; the message is one line for the user. `key`
    names the setting where one is at fault (so a caller can say where its value came from)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


_REPR = reprlib.Repr()  # (its limits as attributes: Python 3.10 and 3.11 take no arguments)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 4, 6, 6, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 70, 40, 70
QUOTE_CHARS = 80


def quote(value: Any) -> str:
    """A bad value for an error line: its repr, bounded before it is built (a YAML alias bomb
    expands to megabytes of repr) and cut to QUOTE_CHARS."""
    text = " ".join(_REPR.repr(value).split())
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 1] + "…"


def key_text(key: Any) -> str:
    """A key as an error line names it: plain where it is a short string, else quoted."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 40 else quote(key)


def _choice(*values: str):
    return dict(check=lambda v: v in values, allowed=" | ".join(values), kind=str)


def _int(lo: int, hi: int, allowed: str | None = None):
    """An integer in [lo, hi]: every integer setting has an upper bound (the engine sizes windows,
    buffers and C integers from them)."""
    return dict(check=lambda v: lo <= v <= hi, allowed=allowed or f"an integer in [{lo}, {hi}]", kind=int)


def _int_or_auto(lo: int, hi: int, allowed: str):
    """"auto" or an integer in [lo, hi] (the engine sizes what auto leaves to it)."""
    return dict(check=lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi),
                allowed=allowed, kind=(int, str))


def _float(lo: float, hi: float, lo_open: bool = False, allowed: str | None = None):
    def ok(v):
        return math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    text = allowed or f"a number {'>' if lo_open else '>='} {lo} and <= {hi}"
    return dict(check=ok, allowed=text, kind=float)


def _bool():
    return dict(check=lambda v: isinstance(v, bool), allowed="true | false", kind=bool)


def _str(max_chars: int, allowed: str | None = None):
    """Text of at most max_chars characters, without NUL (no path or prompt holds one)."""
    return dict(check=lambda v: isinstance(v, str) and len(v) <= max_chars and "\0" not in v,
                allowed=allowed or f"a string of at most {max_chars} characters", kind=str)


PATH_CHARS = 4096  # (Linux's PATH_MAX)


def _path(allowed: str):
    return _str(PATH_CHARS, allowed)


def _str_list(max_items: int, max_chars: int):
    return dict(check=lambda v: isinstance(v, list) and len(v) <= max_items
                and all(isinstance(s, str) and s and len(s) <= max_chars for s in v),
                allowed=f"a list of at most {max_items} non-empty strings of at most {max_chars} characters",
                kind=list)


def setting(default: Any, rule: dict) -> Any:
    return field(default=default, metadata=rule)


_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.I)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce(cls, key: str, raw: Any) -> Any:
    """Convert a raw value (often a string from the environment or a flag) to the field's type."""
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    kind = f.metadata["kind"]
    if not isinstance(raw, str):
        if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, bool) and kind is str and ("on" if raw else "off") in f.metadata["allowed"].split(" | "):
            return "on" if raw else "off"  # YAML 1.1 reads an unquoted on/off as a boolean
        return raw
    text = raw.strip()
    try:
        if kind == (int, str):
            return "auto" if text.lower() == "auto" else int(text)
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if kind is int:
            if not _INT_TEXT.fullmatch(text):  # (int() also takes 1_000 and other scripts' digits)
                raise ValueError
            return int(text)
        if kind is float:
            if not _FLOAT_TEXT.fullmatch(text):
                raise ValueError
            return float(text)
        if kind is list:
            return [s for s in text.split(",") if s] if text else []
        choices = f.metadata["allowed"].split(" | ")
        if text.lower() in _TRUE and "on" in choices:  # CHAT_CPU_KERNEL=0, CHAT_CUDA_GRAPH=1, ...
            return "on"
        if text.lower() in _FALSE and "off" in choices:
            return "off"
        return text
    except ValueError:
        raise ConfigError(f"{key}: {quote(raw)} is not valid; allowed: {f.metadata['allowed']}", key) from None


class _Validated:
    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.metadata["kind"]
            type_ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                value, type_ok = float(value), True
            if not type_ok or not f.metadata["check"](value):
                raise ConfigError(f"{f.name}: {quote(value)} is not valid; allowed: {f.metadata['allowed']}", f.name)
        if hasattr(self, "_check"):
            self._check()

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EngineConfig(_Validated):
    model: str = setting("smollm2", dict(check=lambda v: bool(v) and len(v) <= PATH_CHARS and "\0" not in v,
                                         allowed="an alias (smollm2) or a path", kind=str))
    device: str = setting("auto", _choice("auto", "cpu", "cuda"))
    dtype: str = setting("auto", _choice("auto", "float32", "bfloat16", "float16"))
    max_context: int = setting(8192, _int(16, 1 << 20))
    cuda_graph: str = setting("auto", _choice("auto", "on", "off"))
    compile: str = setting("off", _choice("off", "on"))
    cpu_kernel: str = setting("auto", _choice("auto", "on", "off"))
    # a GGUF's block products on the CPU on rounded inputs: decode's rows in int8, as llama.cpp's
    # (models/kernels/cpu/blocks_int8.h), a prefill's many rows in bf16 where the CPU has AVX512-BF16;
    # wide: only the linears the plan interleaves (rows16: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) round, to 16
    # bits (rows16_int8.h), nearly the fp32 product; auto: wide where every block is in rows16 (a
    # Q4_0/Q4_1 file), on where other layers hold blocks, off elsewhere (models.rounding_by_default)
    cpu_int8: str = setting("auto", _choice("auto", "off", "on", "wide"))
    # what the C++ CPU library is built for: every instruction this CPU has, or the AVX2 level
    # (x86-64-v3, as llama.cpp's AVX2 build), or AVX-512 where the CPU has it (models/kernels/cpu/step.py)
    cpu_isa: str = setting("native", _choice("native", "avx2", "avx512"))
    # a GGUF's blocks: kept on the CPU by auto; on CUDA by on (the Triton block kernels)
    quantized: str = setting("auto", _choice("auto", "on", "off"))
    # turn-boundary checkpoints of hybrid state: on the device, then spilled to (pinned) host memory
    checkpoint_mib: Any = setting("auto", _int_or_auto(0, 1 << 20, "auto, 0 (no checkpoints) or a size in MiB"))
    checkpoint_host_mib: Any = setting("auto", _int_or_auto(0, 1 << 20, "auto, 0 (no spilling) or a size in MiB"))
    verify_reuse: bool = setting(False, _bool())
    threads: int = setting(0, _int(0, 1024, "0 (auto) or a number of threads"))
    # processes (one device each on CUDA) the model is split over: engine/tensor_parallel.py
    tensor_parallel: int = setting(1, _int(1, 64, "1 (one device) or a number of ranks, up to 64"))
    # speculative decoding (engine/speculative.py): prompt-lookup or MTP drafts, verified exactly
    speculative: str = setting("auto", _choice("auto", "off", "lookup", "mtp"))

    def _check(self):
        if self.tensor_parallel > 1 and self.compile == "on":
            raise ConfigError("compile: 'on' does not run with tensor_parallel > 1; use compile: off")
        if self.tensor_parallel > 1 and self.cpu_kernel == "on":
            raise ConfigError("cpu_kernel: 'on' does not run with tensor_parallel > 1 (the C++ step has no "
                              "collectives); use cpu_kernel: auto or off")


SEED_MAX = 2**63 - 1  # (the draws key on a signed 64-bit seed)


@dataclass(frozen=True)
class SamplingConfig(_Validated):
    temperature: float = setting(0.7, _float(0.0, 100.0))
    top_k: int = setting(40, _int(0, 1 << 24, "0 (off) or a positive integer up to 16777216"))
    top_p: float = setting(0.95, _float(0.0, 1.0, lo_open=True))
    min_p: float = setting(0.05, _float(0.0, 1.0))
    repetition_penalty: float = setting(1.0, _float(0.0, 100.0, lo_open=True))
    frequency_penalty: float = setting(0.0, _float(-2.0, 2.0))
    presence_penalty: float = setting(0.0, _float(-2.0, 2.0))
    penalty_last_n: int = setting(64, _int(-1, 1 << 20, "-1 (whole context), 0 (off) or a count up to 1048576"))
    seed: int = setting(-1, _int(-1, SEED_MAX, f"-1 (random) or an integer in [0, {SEED_MAX}]"))
    max_new_tokens: int = setting(1024, _int(1, 1 << 20))
    stop: list = field(default_factory=list, metadata=_str_list(64, 1024))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def allowed(cls, key: str) -> str:
    return {f.name: f for f in dataclasses.fields(cls)}[key].metadata["allowed"]


def build(cls, values: dict[str, Any], section: str):
    """Construct `cls` from a dict, rejecting unknown keys with the list of known ones."""
    known = field_names(cls)
    for key in values:
        if key not in known:
            raise ConfigError(f"{section}.{key_text(key)}: unknown setting; known keys: {', '.join(known)}",
                              key if isinstance(key, str) else None)
    return cls(**{k: coerce(cls, k, v) for k, v in values.items()})



# ---- the process's environment: read here and nowhere else below the front end ----

@dataclass(frozen=True)
class Environment:
    """What this process's environment sets for the engine and the models, read once by
    `environment()` and handed down by engine/device.py's `configure_process` (models.configure):
    README's diagnosis switches, the cache folder and the C++ compiler. The settings' own CHAT_*
    variables (CHAT_MAX_CONTEXT, ...) are the front end's: chat/settings.py."""
    triton: bool = True          # CHAT_TRITON=0: the torch forms instead of the Triton kernels
    pdl: bool = True             # CHAT_PDL=0: no programmatic dependent launch
    precompile: bool = True      # CHAT_PRECOMPILE=0: kernels compiled one at a time, as first launched
    fp8_prefill: str = "tensor"  # CHAT_FP8_PREFILL=dequant: FP8 prefill dequantized, then torch's GEMM
    fp8_gemv: str = "f16"        # CHAT_FP8_GEMV=f32: FP8 decode GEMVs in the fp32-product form
    cache_dir: str = ""          # $XDG_CACHE_HOME/chat (~/.cache/chat): the C++ library, GGUF indexes
    compiler: str = "g++"        # $CXX: the C++ step's compiler


# CHAT_* diagnosis variable -> (Environment field, allowed values: the first is the default)
_DIAGNOSIS = {"CHAT_TRITON": ("triton", None), "CHAT_PDL": ("pdl", None), "CHAT_PRECOMPILE": ("precompile", None),
              "CHAT_FP8_PREFILL": ("fp8_prefill", ("tensor", "dequant")), "CHAT_FP8_GEMV": ("fp8_gemv", ("f16", "f32"))}


def environment(env: Any = None) -> Environment:
    """The Environment of `env` (os.environ where None). A diagnosis switch with a value it does not
    take is a ConfigError naming the variable and what it takes."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, (key, choices) in _DIAGNOSIS.items():
        raw = env.get(name)
        if raw is None or not raw.strip():  # (an exported but empty variable: unset)
            continue
        text = raw.strip().lower()
        if choices is None:
            if text not in _TRUE | _FALSE:
                raise ConfigError(f"{name}: {quote(raw)} is not valid; allowed: 1 | 0 (true | false, on | off)", name)
            values[key] = text in _TRUE
        elif text in choices:
            values[key] = text
        else:
            raise ConfigError(f"{name}: {quote(raw)} is not valid; allowed: {' | '.join(choices)}", name)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Environment(**values, cache_dir=os.path.join(base, "chat"), compiler=env.get("CXX") or "g++")
