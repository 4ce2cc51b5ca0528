"""HF safetensors checkpoints quantized by their makers, read from config.json's `quantization_config`.

Contract: `collect(tensors, config)` replaces each quantized linear's stored pieces by one
QuantizedTensor under `<linear>.weight` (its `.shape` is the linear's [out, in]); `.dequantize()`
is the oracle, in torch on any device: the fp32 weights the format encodes. On the CPU the loader
widens them (the dequantized fp32 forward); on CUDA it keeps them quantized for the Triton kernels
of models.kernels.cuda.qlinear, as models/quant/hf_layers.py's modules (`module(t, device)`;
tests/formats/test_quant.py compares the two).
- FP8 (`quant_method: fp8`, the official Qwen FP8 layout): `weight` float8_e4m3fn [N, K] and
  `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]; W = weight * scale of its 128 x 128 block.
- AWQ (`awq`, AutoAWQ's GEMM layout, 4 bits): `qweight` int32 [K, N/8] (eight columns a word, in
  the order 0 2 4 6 1 3 5 7), `qzeros` int32 [K/G, N/8] alike, `scales` fp16 [K/G, N];
  W[n, k] = (q - z) * s of k's group.
- GPTQ (`gptq`, GPTQModel's layout, 4 bits, sym or asym): `qweight` int32 [K/8, N] (eight rows of
  K a word, low bits first), `qzeros` int32 [K/G, N/8] (eight columns a word), `scales` fp16
  [K/G, N], `g_idx` [K]; the v1 format (`checkpoint_format`/`format` "gptq", the default) stores
  each zero minus one, v2 ("gptq_v2") as is. Act-order (a g_idx other than k // G) is refused.
AWQ and GPTQ are repacked at load into one 4-bit layout (models/quant's QWeight "INT4": per row, codes
two to a byte, an fp16 scale and a uint8 zero per group), exactly: its dequantization is the same.
"""
from __future__ import annotations

import torch

from .checkpoints import CheckpointError

SUPPORTED = ("awq", "fp8", "gptq")
_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column c of a packed word sits in nibble REVERSE[c]


def method(config: dict) -> dict | None:
    """The checked quantization_config, or None for an unquantized checkpoint; a method, bit width
    or layout these kernels do not read is a one-line error naming it."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    name = str(qc.get("quant_method", "")).lower()
    if name not in SUPPORTED:
        raise CheckpointError(f"quantization method {name or qc!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED)}); use an unquantized or GGUF checkpoint")
    if name == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        block = list(qc.get("weight_block_size") or [])
        if fmt != "e4m3" or block != [128, 128]:
            raise CheckpointError(f"FP8 checkpoint with fmt {fmt!r} and weight_block_size {block}: only e4m3 "
                                  "with 128 x 128 blocks is supported")
    else:
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if bits != 4 or not isinstance(group, int) or group <= 0 or group % 32:
            raise CheckpointError(f"{name.upper()} checkpoint with {bits} bits and group size {group}: only 4 bits "
                                  "with groups of a multiple of 32 weights (128, as usual) are supported")
        if name == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise CheckpointError(f"AWQ version {qc.get('version')!r} is not supported (supported: gemm)")
    return qc


class QuantizedTensor:
    """A quantized linear's weight as the checkpoint stores it (subclasses per format)."""
    fmt = ""
    shape: torch.Size

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError


class Fp8Tensor(QuantizedTensor):
    fmt = "FP8"

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor):
        n, k = weight.shape
        if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != (-(-n // 128), -(-k // 128)):
            raise CheckpointError(f"FP8 weight {tuple(weight.shape)} {weight.dtype} with weight_scale_inv "
                                  f"{tuple(scale_inv.shape)}: expected float8_e4m3fn and one scale per 128 x 128 block")
        self.weight, self.scale = weight, scale_inv.float()
        self.shape = weight.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k = self.shape
        s = self.scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return (self.weight.float() * s).to(dtype)


def _unpack_cols(packed: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """int32 [R, C/8] → uint8 [R, C]: eight 4-bit columns a word (nibble i = column i, or the
    column `order` says)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = ((packed[:, :, None] >> shifts) & 15).to(torch.uint8)
    if order is not None:
        q = q[:, :, order]
    return q.reshape(packed.shape[0], -1)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] → uint8 [R, C]: eight 4-bit rows a word, low bits first."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = ((packed[:, None, :] >> shifts[None, :, None]) & 15).to(torch.uint8)
    return q.reshape(-1, packed.shape[1])


class Int4GroupTensor(QuantizedTensor):
    """AWQ or GPTQ 4-bit weights as codes [N, K] uint8, zeros and fp16 scales [N, K/G] (decoded
    from the checkpoint's words at load: the packed words are not kept)."""

    def __init__(self, fmt: str, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int):
        self.fmt, self.codes, self.zeros, self.scales, self.group = fmt, codes, zeros, scales, group
        self.shape = codes.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k = self.shape
        z = self.zeros.float().repeat_interleave(self.group, 1)
        s = self.scales.float().repeat_interleave(self.group, 1)
        return ((self.codes.float() - z) * s).to(dtype)


def awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4GroupTensor:
    k = qweight.shape[0]
    codes = _unpack_cols(qweight, _AWQ_REVERSE_ORDER)  # [K, N]
    zeros = _unpack_cols(qzeros, _AWQ_REVERSE_ORDER)   # [K/G, N]
    if k % group or zeros.shape[0] != k // group or tuple(scales.shape) != tuple(zeros.shape):
        raise CheckpointError(f"AWQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                              f"{tuple(scales.shape)} do not fit group size {group}")
    return Int4GroupTensor("AWQ", codes.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous().half(), group)


def gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
         group: int, v1: bool) -> Int4GroupTensor:
    codes = _unpack_rows(qweight)  # [K, N]
    k = codes.shape[0]
    zeros = _unpack_cols(qzeros, None)  # [K/G, N]
    if v1:  # v1 stores z - 1 (in 4 bits: a zero of 0 is stored as 15)
        zeros = (zeros + 1) & 15
    if k % group or zeros.shape[0] != k // group or tuple(scales.shape) != tuple(zeros.shape):
        raise CheckpointError(f"GPTQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                              f"{tuple(scales.shape)} do not fit group size {group}")
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // group):
        raise CheckpointError("GPTQ with act-order (desc_act: a g_idx other than k // group_size) is not "
                              "supported; use a checkpoint quantized with desc_act false")
    return Int4GroupTensor("GPTQ", codes.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous().half(),
                           group)


def collect(tensors: dict[str, torch.Tensor], config: dict) -> None:
    """In place: each quantized linear's pieces → one QuantizedTensor at `<prefix>.weight`."""
    qc = method(config)
    if qc is None:
        return
    name = qc["quant_method"].lower()
    if name == "fp8":
        for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
            prefix = key[: -len(".weight_scale_inv")]
            if prefix + ".weight" not in tensors:
                raise CheckpointError(f"{key} has no {prefix}.weight")
            tensors[prefix + ".weight"] = Fp8Tensor(tensors[prefix + ".weight"], tensors.pop(key))
        stray = next((k for k, t in tensors.items()
                      if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn), None)
        if stray is not None:
            raise CheckpointError(f"FP8 tensor {stray} has no weight_scale_inv")
        return
    group = qc.get("group_size", qc.get("q_group_size"))
    v1 = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower() != "gptq_v2"
    for key in [k for k in tensors if k.endswith(".qweight")]:
        prefix = key[: -len(".qweight")]
        try:
            parts = [tensors.pop(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")]
        except KeyError as e:
            raise CheckpointError(f"{name.upper()} linear {prefix} lacks {e.args[0]}") from None
        g_idx = tensors.pop(f"{prefix}.g_idx", None)
        tensors[prefix + ".weight"] = awq(*parts, group) if name == "awq" else gptq(*parts, g_idx, group, v1)
