"""A hybrid model's GGUF as people download one, for the CPU benchmark: a random checkpoint of a
published shape (bench/shapes.py: qwen3.5-0.8b, lfm2-1.2b, ...), converted by llama.cpp's own
converter and quantized by llama.cpp's own quantizer (Q4_K_M by default), then bench/cpu_bench.py
on that file: ours against llama.cpp on the same file, thread count and prompt.

    python bench/hybrid_gguf.py --shape qwen3.5-0.8b [--llama-python PYTHON] [--type Q4_K_M]
        [--layers N] [--mtp] [--out FILE] [--only-file] [-- cpu_bench.py's options]

--layers N: the shape's first N layers (its layer types cut to them), for shapes too large to
convert whole here (the default file name says so: bench-SHAPE-Nl.TYPE.gguf). --mtp: a Qwen3.5
shape with its multi-token-prediction layer (random, as tests/support/tiny.py add_mtp makes one; the
converter writes it as the nextn block; bench-SHAPE-mtp.TYPE.gguf), for bench/spec_bench.py --mtp.

The weights are random (transformers' initialisation, seed 0, saved in bf16); the tokenizer is the
tests' tiny byte-level BPE (tests/support/tiny.py), the converter padding the vocabulary to the shape's
size, so the embedding and the LM head have their published sizes. Speed and memory depend on the
shapes and the types, not on the values. The file is written once (default
~/.cache/chat/bench-SHAPE.TYPE.gguf, atomically) and reused. llama.cpp's converter
(tests/support/llama_cpp_tree.py) and quantizer (llama-cpp-python 0.3.36, in PYTHON) are bench-time
references, never dependencies.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# llama.cpp's ftype names of the files people download
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
          "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}

# converter options per model_type (a Qwen3.5 checkpoint without its MTP layers), and the
# pre-tokenizer name it writes for the tiny tokenizer (the tests' conversions name the same)
CONVERT_OPTIONS = {"qwen3_5_text": ("--no-mtp",), "qwen3_5_moe_text": ("--no-mtp",), "qwen3_next": ("--no-mtp",)}
PRE = {"lfm2": "gpt-2", "granitemoehybrid": "gpt-2"}

QUANTIZE = """import ctypes, sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def hf_checkpoint(shape: str, out_dir: str, layers: int | None = None, mtp: bool = False) -> tuple[str, str]:
    """The shape's random HF checkpoint (bf16) with the tests' tiny tokenizer: (its dir, model_type).
    layers: that many of its layers instead of all; mtp: with an MTP layer."""
    import torch
    import transformers

    from shapes import SHAPES
    from tests.support.tiny import add_mtp, as_released, write_checkpoint
    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    if layers:
        kw["num_hidden_layers"] = layers
        if "layer_types" in kw:
            kw["layer_types"] = kw["layer_types"][:layers]
    cfg = transformers.AutoConfig.for_model(model_type, **kw, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = write_checkpoint(model_type, out_dir, model=model)
    as_released(path, model_type)  # (Granite 4.0-H's layer names as the converter reads them)
    if mtp:
        add_mtp(path)
    return path, model_type


def build(shape: str, qtype: str, python: str | None, out: str, quantize: str | None = None,
          layers: int | None = None, mtp: bool = False) -> str:
    """`out`: the shape's checkpoint converted (F16) and quantized to `qtype` by llama.cpp (Q8_0:
    by the converter itself, no llama-cpp-python needed): by llama-cpp-python's quantizer in
    `python`, or by the `quantize` binary (llama-quantize) where given. layers: as hf_checkpoint."""
    from tests.support.llama_cpp_tree import convert
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as d:
        hf_dir, model_type = hf_checkpoint(shape, os.path.join(d, "hf"), layers, mtp)
        direct = qtype == "Q8_0"
        f16 = convert(hf_dir, os.path.join(d, "f16.gguf"), "q8_0" if direct else "f16", pre=PRE.get(model_type, "qwen2"),
                      options=() if mtp else CONVERT_OPTIONS.get(model_type, ()))
        if direct:
            os.replace(f16, out)
            return out
        part = os.path.join(d, "out.gguf")
        if quantize is not None:
            proc = subprocess.run([quantize, f16, part, qtype, str(os.cpu_count() or 2)], capture_output=True, text=True)
        elif python is None:
            raise SystemExit(f"{qtype} needs llama.cpp's quantizer: --llama-python PYTHON (one that imports llama_cpp)")
        else:
            proc = subprocess.run([python, "-c", QUANTIZE, f16, part, FTYPES[qtype]], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"llama_model_quantize failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        os.replace(part, out)
    return out


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.5-0.8b")
    p.add_argument("--type", default="Q4_K_M", choices=sorted(FTYPES))
    p.add_argument("--llama-python", default=None,
                   help="a Python that can import llama_cpp (its quantizer; Q8_0 needs none; cpu_bench's llama.cpp run)")
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=None, help="the shape with this many of its layers (its first ones)")
    p.add_argument("--mtp", action="store_true", help="with the MTP layer (a Qwen3.5 shape)")
    p.add_argument("--only-file", action="store_true", help="write the file, do not benchmark")
    a = p.parse_args(argv)
    depth = (f"-{a.layers}l" if a.layers else "") + ("-mtp" if a.mtp else "")
    out = a.out or os.path.expanduser(f"~/.cache/chat/bench-{a.shape}{depth}.{a.type}.gguf")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if not os.path.exists(out):
        build(a.shape, a.type, a.llama_python, out, layers=a.layers, mtp=a.mtp)
    import gguf
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(out).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    print(f"{out}: {os.path.getsize(out) / 1e6:.1f} MB;", ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
          flush=True)
    if not a.only_file:
        sys.exit(subprocess.call([sys.executable, os.path.join(HERE, "cpu_bench.py"), "--model", out,
                                  *(("--llama-python", a.llama_python) if a.llama_python else ()), *rest]))


if __name__ == "__main__":
    main()
