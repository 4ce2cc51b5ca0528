"""Requantize a GGUF into llama.cpp's Q4_K_M mix:
`python bench/requantize.py [--model smollm2] [--out FILE] [--llama-python PYTHON]`.

With `--llama-python` (a Python that can import llama_cpp, a test- and bench-time reference,
never a dependency), llama.cpp's own quantizer writes the file: the source's dequantized weights
go into an F32 GGUF (every tensor F32, the metadata as it is), which `llama_model_quantize`
(after `llama_backend_init()`) turns into Q4_K_M in a child process, with llama.cpp's searched
scales. Without it, the rules below write it here:

The type of each tensor follows llama.cpp's rules for Q4_K_M (llama-quant.cpp): Q4_K by
default; Q6_K for the output (the token embedding when the head is tied) and for attn_v and
ffn_down in the "more bits" layers (the first and last eighth, and every third between); a
tensor whose rows are not whole 256-weight super-blocks falls back as llama.cpp falls back
(Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0). Q5_0 and Q8_0 come from gguf-py's quantizer (ggml's
reference); Q4_K and Q6_K from the plain absmax quantizers below, not llama.cpp's searched
scales: the file has the layout, types and bytes of a Q4_K_M file (what speed and memory depend
on), with somewhat larger rounding errors. The weights requantized are the source file's
dequantized values.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 → Q4_K blocks [rows, K / 256 * 144]: w = d sc q - dmin m per 32 weights."""
    rows, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    span = x.max(-1) - lo
    d = span.max(-1) / (15 * 63)
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(span / 15 / d16[:, None])), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(-lo / dmin16[:, None])), 0, 63).astype(np.uint8)
        step = d16[:, None] * sc
        q = np.nan_to_num(np.round((x + (dmin16[:, None] * m)[..., None]) / step[..., None]))
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16(d16), _f16(dmin16), scales, qs], -1)
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 → Q6_K blocks [rows, K / 256 * 210]: w = d sc (q - 32) per 16 weights."""
    rows, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d16[:, None])), 0, 127).astype(np.int8)
        step = d16[:, None] * sc
        q = np.nan_to_num(np.round(x / step[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, h, r, lane]
    ql = np.zeros((q.shape[0], 2, 2, 32), dtype=np.uint8)  # [block, h, r & 1, lane]
    for r in range(4):
        ql[:, :, r & 1] |= (q[:, :, r] & 0xF) << (4 * (r >> 1))
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for r in range(4):
        qh |= ((q[:, :, r] >> 4) & 3) << (2 * r)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d16)], -1)
    return out.reshape(rows, -1)


FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, n_layers: int, tied: bool) -> str:
    def more_bits(i: int) -> bool:
        return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if more_bits(int(name.split(".")[1])) else "Q4_K"
    return "Q4_K"


def requantize(src: str, out: str, f32: bool = False) -> dict[str, int]:
    """Writes `out` from the GGUF `src`: in the Q4_K_M mix, or with f32 every tensor in F32 (the
    input llama.cpp's quantizer takes). Returns how many tensors of each type it wrote."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():  # every metadata key, as it is
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], vtype)
    names = {t.name for t in reader.tensors}
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    counts: dict[str, int] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.ndim != 2 or f32:
            writer.add_tensor(t.name, w)
            counts["F32"] = counts.get("F32", 0) + 1
            continue
        kind = q4_k_m_type(t.name, n_layers, "output.weight" not in names)
        if w.shape[1] % 256:
            kind = FALLBACK[kind]
        if kind == "Q4_K":
            raw = quantize_q4_k(w)
        elif kind == "Q6_K":
            raw = quantize_q6_k(w)
        else:
            raw = quantize(w, getattr(Q, kind))
        writer.add_tensor(t.name, raw, raw_dtype=getattr(Q, kind))
        counts[kind] = counts.get(kind, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


LLAMA_QUANTIZE = """
import ctypes, sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def llama_quantize(python: str, src: str, out: str) -> None:
    """llama.cpp's quantizer (in `python`, a child process) writes `out` in Q4_K_M from `src`'s weights."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f32 = os.path.join(d, "f32.gguf")
        requantize(src, f32, f32=True)
        tmp = out + ".part"
        proc = subprocess.run([python, "-c", LLAMA_QUANTIZE, f32, tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"llama_model_quantize failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default=None, help="default ~/.cache/chat/SmolLM2-135M-Instruct.Q4_K_M.gguf "
                   "(.llama-Q4_K_M.gguf with --llama-python)")
    p.add_argument("--llama-python", default=None, help="quantize with llama.cpp's quantizer, in this Python")
    a = p.parse_args()
    from models import resolve
    src = resolve(a.model)
    if a.llama_python:
        out = a.out or os.path.expanduser("~/.cache/chat/SmolLM2-135M-Instruct.llama-Q4_K_M.gguf")
        llama_quantize(a.llama_python, src, out)
        import gguf
        counts: dict[str, int] = {}
        for t in gguf.GGUFReader(out).tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    else:
        out = a.out or os.path.expanduser("~/.cache/chat/SmolLM2-135M-Instruct.Q4_K_M.gguf")
        counts = requantize(src, out)
    print(f"{out}: {os.path.getsize(out) / 1e6:.1f} MB;", ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
