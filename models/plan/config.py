"""KernelConfig: the switches and thresholds that decide which kernel serves each op, frozen, one
value a load. The planner (planner.py) reads it and nothing else does; a benchmark or a test that
compares kernels builds another config and loads with it, instead of patching module globals.
The defaults are the engine's choices; each field says which benchmark variant times it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    # 4-bit linears on CUDA in 32-weight runs for kernels/cuda/qruns.py (Q4_K repacked as Q4KR,
    # AWQ/GPTQ groups of a multiple of 32 as stored); False: qplanar.py's layouts (Q4KP, INT4P),
    # which decode slower (bench/ab_decode.py's planar4 variant)
    runs: bool = True
    # With runs, GGUF Q5_0 / Q5_1 linears (a K-quant mix's fallback for rows that are not whole
    # 256-weight super-blocks) in runs too (Q50R / Q51R); False: in their blocks for qlinear.py's
    # GEMV, slower on the 0.5B-like and SmolLM2-like Q4_K decode (bench/ab_decode.py's blocks5
    # variant; bench/quant_bench.py --sweep-runs times the gate/up pair)
    five_bit_runs: bool = True
    # A tied LM head of a runs type repacked too, its embedding then reading the runs (one copy);
    # False: both keep the file's blocks, which measured even or faster (ab_decode.py's tiedruns)
    tied_runs: bool = False
    # Linears of a runs type are repacked above this many weights, the smaller ones staying in their
    # blocks; 0: every one, faster on the 0.5B-like, LFM2-1.2B-like and SmolLM2-like shapes
    # (ab_decode.py's rmin4 variant)
    runs_min_weights: int = 0
    # Q5_K / Q6_K linears of at most this many weights keep their blocks: qlinear.py's GEMV reads
    # such a matrix in one step before its PDL wait, on the 16-bit input (no int8 input launch),
    # where a small model's step is bound by launches; larger ones are repacked for qplanar.py's
    # GEMV (ab_decode.py's pmin variants on the 0.8B-like, SmolLM2-like and 30B-A3B-like shapes)
    planar_min_weights: int = 4 << 20
    # Whether the Triton kernels serve CUDA at all; None: as this process has them (Triton importable
    # and not switched off by CHAT_TRITON, engine/config.py)
    triton: bool | None = None
    # The C++ library's kernels on the CPU (the `cpu_kernel` setting): off, torch's forms only
    cpu_kernel: bool = True
    # Their GGUF-block products on rounded inputs (the `cpu_int8` setting: int8 rows, a prefill's
    # many in bf16); None (the engine's `auto`): where the model's layers hold such blocks
    # (quant.int8_by_default), as the engine then sets them (models.use_int8_inputs)
    cpu_int8: bool | None = False
    # With int8 inputs, 32-weight-block linears (step.rows16_types) of whole 16-row groups interleaved
    # 16 rows at a time at load (quant/rows16.py) for the library's rows16 products; False: the row-by-row block
    # products (bench/cpu_block_bench.py --rows16, bench/cpu_bench.py --rows16 off)
    cpu_rows16: bool = True
    # `cpu_int8: wide`: only the rows16 matrices round their inputs (to 16 bits); the others' products
    # take fp32 inputs (what the plan then names)
    cpu_wide: bool = False

    def but(self, **changes) -> "KernelConfig":
        """This config with some fields changed (dataclasses.replace, checked)."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self):
        for name in ("runs_min_weights", "planar_min_weights"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KernelConfig.{name} must be a whole number of weights >= 0, not {value!r}")


DEFAULT = KernelConfig()
