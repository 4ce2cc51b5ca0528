"""The planner's rules as data: for each op kind and device, which kernel serves an op of a given
weight format and shape, into which layout its weights are repacked at load, and why. planner.py
reads the first rule whose conditions all hold; the thresholds are KernelConfig fields, so a
benchmark moves a threshold by building a config, not by editing a rule.

A rule's `when` is a tuple of conditions, each a tuple:
  ("gt", FIELD) / ("le", FIELD)   the matrix has more / at most KernelConfig.FIELD weights
  ("on", FIELD) / ("off", FIELD)  the KernelConfig switch FIELD is on / off
  ("k", N) / ("not_k", N)         the input features are / are not a multiple of N
  ("tied",) / ("untied",)         the matrix shares its blocks with the embedding (a tied head)
  ("group", N) / ("not_group", N) an AWQ/GPTQ matrix's groups are / are not multiples of N weights
  ("fits",) / ("not_fits",)       qlinear.py's block GEMV takes this format and row length
  ("half",) / ("fp32",)           the model computes in bf16/fp16 / in fp32
  ("triton",) / ("no_triton",)    the Triton kernels serve this CUDA device (KernelConfig.triton)
  ("step",) / ("no_step",)        the C++ decode step serves this CPU model (and cpu_kernel is on)
  ("no_offer",)                   the model's family has no C++ decode step at all
  ("blocks",)                     the C++ library's per-linear kernels serve its GGUF blocks
  ("int8",)                       cpu_int8: those kernels round their inputs (int8 rows; a prefill's in bf16)
  ("rows16",)                     a 32-weight-block matrix (ROWS16_LAYOUT's types) of whole 16-row groups, on
                                  the CPU, with cpu_rows16 on
  ("head",)                       the op is the LM head
  ("int4pack",)                   the matrix is packed for torch's int4 kernel (quant.Int4Linear)
  ("planar",)                     routed experts held in the planar layouts (a GGUF's K-quant halves)
  ("attention_fits",) / ("delta_fits",) / ("ssd_fits",)  the mixer's sizes are ones its kernel takes
Formats are the checkpoint's ("Q4_K", "AWQ", "FP8", "bfloat16", ...); "*" is any.
"""
from __future__ import annotations

from dataclasses import dataclass

GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
RUNS_TYPES = ("Q4_K", "Q5_0", "Q5_1")  # the GGUF types quant/runs.py repacks (Q5_0/Q5_1 with five_bit_runs)
DENSE = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Rule:
    op: str                      # "linear" (the LM head too), "experts", "attention", ...
    device: str                  # "cuda" or "cpu"
    formats: tuple[str, ...]     # checkpoint formats it covers, or ("*",)
    when: tuple[tuple, ...]      # conditions, all of which hold
    kernel: str                  # what serves one decode token
    reason: str
    layout: dict | None = None   # checkpoint format → the layout the weights are repacked into at load

    def covers(self, op: str, device: str, fmt: str) -> bool:
        return self.op == op and self.device == device and ("*" in self.formats or fmt in self.formats)


R = Rule
RUNS_LAYOUT = {"Q4_K": "Q4KR", "Q5_0": "Q50R", "Q5_1": "Q51R"}
PLANAR_LAYOUT = {"Q4_K": "Q4KP", "Q5_K": "Q5KP", "Q6_K": "Q6KP"}
# the GGUF types quant/rows16.py interleaves, and their layouts' names
ROWS16_LAYOUT = {"Q4_0": "Q40X16", "Q4_1": "Q41X16", "Q5_0": "Q50X16", "Q5_1": "Q51X16", "Q8_0": "Q80X16"}

RULES: tuple[Rule, ...] = (
    # ---- linears on CUDA (decode: one row; prefill: the kernels' matmul where it takes the format,
    # else chunks of rows dequantized to the compute dtype and cuBLAS) ----
    R("linear", "cuda", ("*",), (("no_triton",),), "torch (cuBLAS; quantized: dequantized per call)",
      "the Triton kernels are off or absent on this device"),
    R("linear", "cuda", ("Q4_K",), (("tied",), ("on", "tied_runs"), ("on", "runs"), ("k", 256),
                                   ("gt", "runs_min_weights")), "qruns GEMV",
      "a tied head in runs, its embedding reading them (tied_runs on)", RUNS_LAYOUT),
    R("linear", "cuda", ("Q5_0", "Q5_1"), (("tied",), ("on", "tied_runs"), ("on", "runs"), ("on", "five_bit_runs"),
                                         ("k", 32), ("gt", "runs_min_weights")), "qruns GEMV", "a tied head in runs, its embedding reading them (tied_runs on)", RUNS_LAYOUT),
    R("linear", "cuda", GGUF, (("tied",), ("fits",)), "qlinear block GEMV",
      "tied to the embedding: one copy of the table, as stored (tied_runs off)"),
    R("linear", "cuda", ("Q4_K",), (("on", "runs"), ("k", 256), ("gt", "runs_min_weights")), "qruns GEMV",
      "4-bit weights in 32-weight runs on an int8 input row (runs on)", RUNS_LAYOUT),
    R("linear", "cuda", ("Q5_0", "Q5_1"), (("on", "runs"), ("on", "five_bit_runs"), ("k", 32),
                                         ("gt", "runs_min_weights")), "qruns GEMV",
      "5-bit blocks in runs on an int8 input row (five_bit_runs on)", RUNS_LAYOUT),
    R("linear", "cuda", ("Q4_K",), (("on", "runs"), ("k", 256)), "qlinear block GEMV",
      "at most runs_min_weights weights: the blocks as stored"),
    R("linear", "cuda", ("Q4_K", "Q5_K", "Q6_K"), (("k", 256), ("gt", "planar_min_weights")), "qplanar GEMV",
      "more than planar_min_weights weights: repacked for the planar GEMV", PLANAR_LAYOUT),
    R("linear", "cuda", ("Q4_K", "Q5_K", "Q6_K"), (("k", 256), ("fits",)), "qlinear block GEMV",
      "at most planar_min_weights weights: read in one step before the PDL wait, on the 16-bit row "
      "(no int8 input launch), where a small model's step is bound by launches"),
    R("linear", "cuda", GGUF, (("fits",),), "qlinear block GEMV", "the file's blocks as stored"),
    R("linear", "cuda", GGUF, (), "torch (dequantized per call)", "rows not whole blocks of this type"),
    R("linear", "cuda", ("AWQ", "GPTQ"), (("not_group", 8),), "torch (dequantized per call)",
      "groups that are not whole bytes of codes: kept as stored"),
    R("linear", "cuda", ("AWQ", "GPTQ"), (("on", "runs"), ("group", 32)), "qruns GEMV",
      "groups of whole 32-weight runs: read as stored (runs on)"),
    R("linear", "cuda", ("AWQ", "GPTQ"), (), "qplanar GEMV", "groups that are not whole runs: repacked as INT4P",
      {"AWQ": "INT4P", "GPTQ": "INT4P"}),
    R("linear", "cuda", ("FP8",), (("fits",),), "qlinear FP8 GEMV (prefill: FP8 tensor-core GEMM on Hopper)",
      "FP8 blocks with 128x128 scales as stored"),
    R("linear", "cuda", ("FP8",), (), "torch (dequantized per call)", "rows not whole 128-weight blocks"),
    R("linear", "cuda", ("bfloat16", "float16"), (("half",),), "Triton GEMV (prefill: cuBLAS)",
      "cuBLAS's one-row kernels leave bandwidth unused"),
    R("linear", "cuda", ("*",), (), "torch (cuBLAS)", "fp32 keeps torch's exact forms (no TF32 dots)"),

    # ---- linears on the CPU (the decode step is the C++ library's where it serves the model) ----
    R("linear", "cpu", ("*",), (("step",), ("int4pack",)), "C++ step: int4 GEMV",
      "within the C++ decode step (one call a token); rows packed at load"),
    R("linear", "cpu", tuple(ROWS16_LAYOUT), (("step",), ("int8",), ("rows16",)), "C++ step: rows16 GEMV (rounded inputs)",
      "within the C++ decode step; cpu_int8: inputs rounded to 16 bits (wide: auto's choice where every block "
      "is in rows16) or to int8 as llama.cpp's; 16 rows interleaved at load, a dot product takes codes of each "
      "(a prefill's rows too)",
      ROWS16_LAYOUT),
    R("linear", "cpu", GGUF, (("step",), ("int8",)), "C++ step: block GEMV (int8 inputs)",
      "within the C++ decode step; cpu_int8: input rows rounded to int8 as llama.cpp's (a prefill's "
      "many in bf16 where the CPU has AVX512-BF16)"),
    R("linear", "cpu", GGUF, (("step",),), "C++ step: block GEMV", "within the C++ decode step; the file's blocks"),
    R("linear", "cpu", ("*",), (("step",),), "C++ step: fp32 GEMV", "within the C++ decode step"),
    R("linear", "cpu", ("*",), (("int4pack",),), "torch int4 mm",
      "Q4_0/Q4_1 rows packed at load for torch's int4 kernel (whole 16-row groups)"),
    R("linear", "cpu", tuple(ROWS16_LAYOUT), (("blocks",), ("int8",), ("rows16",)), "C++ rows16 GEMV (rounded inputs)",
      "cpu_int8: inputs rounded to 16 bits (wide) or to int8 as llama.cpp's; 16 rows interleaved at load",
      ROWS16_LAYOUT),
    R("linear", "cpu", GGUF, (("blocks",), ("int8",)), "C++ block GEMV (int8 inputs)",
      "cpu_int8: input rows rounded to int8 as llama.cpp's CPU kernels round them (a prefill's many "
      "in bf16 where the CPU has AVX512-BF16)"),
    R("linear", "cpu", GGUF, (("blocks",),), "C++ block GEMV", "the file's blocks as mapped, read directly"),
    R("linear", "cpu", ("Q8_0",), (("head",),), "torch int4 mm (two planes)",
      "a Q8_0 head as a high and a low 4-bit plane for torch's int4 kernel"),
    R("linear", "cpu", ("*",), (("off", "cpu_kernel"),), "torch",
      "cpu_kernel: off (or compile: on, or a tensor-parallel rank): torch's forms"),
    R("linear", "cpu", ("*",), (("no_offer",),), "torch",
      "no C++ decode step for this family (its MoE layers run in torch)"),
    R("linear", "cpu", ("*",), (), "torch", "no C++ kernel serves this format or dtype here"),

    # ---- routed experts ----
    R("experts", "cuda", ("*",), (("no_triton",),), "torch (per expert)", "the Triton kernels are off"),
    R("experts", "cuda", ("*",), (("planar",),), "qplanar expert GEMVs", "only the chosen experts' rows read, from the planar layouts"),
    R("experts", "cuda", ("*",), (("half",),), "Triton expert GEMVs (prefill: grouped GEMM)",
      "only the chosen experts' rows read"),
    R("experts", "cuda", ("*",), (), "torch (per expert)", "fp32 keeps torch's exact forms"),
    R("experts", "cpu", ("*",), (("step",),), "C++ step: chosen experts (experts_decode)",
      "within the C++ decode step: only the chosen experts' blocks read, the router's top k in the step"),
    R("experts", "cpu", ("*",), (("blocks",),), "C++ block GEMV per chosen expert",
      "only the chosen experts' blocks read from the mapping; a token's experts in one call (experts_decode)"),
    R("experts", "cpu", ("*",), (), "torch (per chosen expert)", "no C++ kernel serves these experts here"),

    # ---- sequence mixers (decode) ----
    R("attention", "cuda", ("*",), (("triton",), ("half",), ("attention_fits",)), "Triton flash-decoding",
      "the live length read on the device: one graph for every context length"),
    R("attention", "cuda", ("*",), (), "torch SDPA", "head size or dtype the Triton kernel does not take"),
    R("attention", "cpu", ("*",), (("step",),), "C++ step: flash-decoding (fp16 KV)",
      "within the C++ decode step"),
    R("attention", "cpu", ("*",), (), "torch SDPA", "no C++ step for this model"),
    R("gated_delta", "cuda", ("*",), (("triton",), ("half",), ("delta_fits",)), "Triton delta step",
      "projection, conv, recurrent update and gated norm in one launch"),
    R("gated_delta", "cuda", ("*",), (), "torch recurrent step", "head sizes or dtype the kernel does not take"),
    R("gated_delta", "cpu", ("*",), (("step",),), "C++ step: delta rule", "within the C++ decode step"),
    R("gated_delta", "cpu", ("*",), (("blocks",),), "torch step: C++ delta_decode",
      "the torch step with the library's per-linear kernels (no C++ step for this model)"),
    R("gated_delta", "cpu", ("*",), (), "torch recurrent step", "no C++ step for this model"),
    R("mamba2", "cuda", ("*",), (("triton",), ("half",), ("ssd_fits",)), "Triton SSD step",
      "conv, scan update and gate in one launch"),
    R("mamba2", "cuda", ("*",), (), "torch recurrent step", "head or state sizes the kernel does not take"),
    R("mamba2", "cpu", ("*",), (("step",),), "C++ step: Mamba2 mixer", "within the C++ decode step"),
    R("mamba2", "cpu", ("*",), (("blocks",),), "torch step: C++ mamba2_decode",
      "the torch step with the library's per-linear kernels (no C++ step for this model)"),
    R("mamba2", "cpu", ("*",), (), "torch recurrent step", "no C++ step for this model"),
    R("short_conv", "cuda", ("*",), (("triton",), ("half",)), "Triton short-conv step", "one launch a layer"),
    R("short_conv", "cuda", ("*",), (), "torch", "fp32 keeps torch's exact forms"),
    R("short_conv", "cpu", ("*",), (("step",),), "C++ step: short conv", "within the C++ decode step"),
    R("short_conv", "cpu", ("*",), (), "torch", "no C++ step for this model"),

    # ---- embeddings: one row a token ----
    R("embedding", "cuda", GGUF + ("Q4KR", "Q50R", "Q51R"), (), "block row decode", "the row decoded on the device"),
    R("embedding", "cpu", ("*",), (("step",),), "C++ step: row decode", "within the C++ decode step"),
    R("embedding", "*", ("*",), (), "torch gather", "one row a token"),
)


def rules_for(op: str, device: str, fmt: str) -> list[Rule]:
    """The rules that cover an op of this kind and format on this device, in order."""
    op = "linear" if op == "lm_head" else op
    return [r for r in RULES if (r.device in (device, "*") and r.op == op
                                 and ("*" in r.formats or fmt in r.formats))]
