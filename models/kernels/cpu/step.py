"""The CPU decode step of dense GQA models and LFM2 in C++ (step.cpp), built once and cached.

Contract: `CpuStep(model)(tokens, positions, state)` computes what `model(tokens, positions,
state)` computes for one token on the CPU in fp32 (the same weights: 4-bit `Int4Linear`, GGUF
blocks read as stored `BlockLinear`, or fp32 `Linear`; the same state buffers, written at the
token's position), up to float summation order:
tests/kernels/test_cpu_step.py compares the logits and the greedy tokens with the torch step. Supported:
the dense GQA models (SmolLM2, Llama, Qwen2, Qwen3 with its per-head q/k norms) and LFM2 (its
short-convolution layers update their conv window in the state in place, as the torch step
does); `supports(model)` says.

Why: the embedded SmolLM2's eager torch step is bound by the overhead of hundreds of small ops,
not by its int4 matmuls (bench/cpu_bench.py --cpu-kernel off); this step runs them as loops in one
call. LFM2's torch step spends dozens of small ops a layer around its block products
(bench/hybrid_gguf.py --shape lfm2-1.2b).

The library is compiled with the system's C++ compiler on first use (~10-20 s, once) into
$XDG_CACHE_HOME/chat (default ~/.cache/chat), named by a hash of the source, torch's and Python's
versions, the compiler flags and the CPU's instruction-set flags (it is built for this CPU:
-march=native, or for the AVX2 level with `cpu_isa: avx2`: `select_isa`), written atomically; later processes load it in milliseconds. `make chat` and
`make test` build it during set-up. `CHAT_CPU_KERNEL=0` turns it off (the torch step runs).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile

import torch

from ...quant import rows16
from ...quant.layers import BlockEmbedding, BlockExperts, BlockLinear, Int4Linear, Q8Embedding

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step.cpp")
HEADERS = [os.path.join(os.path.dirname(SOURCE), name)  # what SOURCE includes
           for name in ("blocks_avx2.h", "blocks_int8.h", "blocks_int8_avx2.h", "delta_step.h", "hybrid_step.h",
                         "kquant_tiles_avx2.h", "mamba2_hybrid_step.h", "mamba2_step.h", "rows16_int8.h")]
K_QUANTS = (12, 13, 14)  # GGMLQuantizationType Q4_K, Q5_K, Q6_K: int8 rows rounded per 256 weights
INT8_INPUTS = 256  # step.cpp's kInt8Inputs
# Whether the library's kernels serve at all (the `cpu_kernel` setting reaches the planner and the
# session through the engine's config; a test or a benchmark switches them off here)
ENABLED = True
# Where the library is cached, and what compiles it: models.configure sets them from the engine's
# Environment ($XDG_CACHE_HOME/chat, $CXX: engine/config.py)
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "chat")
COMPILER = "g++"


class Unavailable(RuntimeError):
    """The C++ step could not be built or loaded here (the message names the cause)."""


# The instruction sets the library is built for (the `cpu_isa` setting): native takes every
# instruction this CPU has (-march=native); avx2 the AVX2 + FMA + F16C level (x86-64-v3, as
# llama.cpp's GGML_AVX2 build), so its AVX2 forms run, and are tested, on an AVX-512 machine too;
# avx512 is native on a CPU that has AVX-512F, refused elsewhere. One per process: the library's
# ops register once.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"],
             "avx512": ["-march=native"]}
ISA_NEEDS = {"native": (), "avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}
_isa = "native"


def _cpu_flags() -> set[str]:
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") else set()


def select_isa(isa: str) -> None:
    """The instruction set this process's library is built for. Raises Unavailable where the CPU
    lacks it, or where the library is already loaded for another (a process holds one)."""
    global _isa
    if isa not in ISA_FLAGS:
        raise Unavailable(f"cpu_isa {isa!r} is not one of {', '.join(ISA_FLAGS)}")
    missing = [f for f in ISA_NEEDS[isa] if f not in _cpu_flags()]
    if missing:
        raise Unavailable(f"cpu_isa {isa} needs {', '.join(missing).upper()}, which this CPU lacks; "
                          "use cpu_isa: native")
    if _loaded is not None and isa != _isa:
        raise Unavailable(f"the library is already loaded for cpu_isa {_isa} in this process")
    _isa = isa


def isa_label() -> str:
    """What the library's vector code is built for, in words (/show): e.g. "native: AVX-512 VNNI"."""
    flags = _cpu_flags()
    if _isa == "avx2":
        return "avx2: AVX2 + FMA + F16C"
    if "avx512f" in flags:
        return f"{_isa}: AVX-512" + (" VNNI" if "avx512_vnni" in flags else "")
    return f"{_isa}: " + ("AVX2" if "avx2" in flags else "no AVX2 (portable loops)")


def avx512_forms() -> bool:
    """Whether the library's AVX-512 forms run here (the CPU has AVX-512F, cpu_isa is not avx2)."""
    return _isa != "avx2" and "avx512f" in _cpu_flags()


def rows16_forms() -> bool:
    """Whether the library's rows16 products (rows16_int8.h) are built here: they need AVX2 with
    FMA and F16C (its AVX2 forms) or AVX-512 VNNI; a portable build has none."""
    return all(f in _cpu_flags() for f in ISA_NEEDS["avx2"])


def rows16_types() -> tuple[int, ...]:
    """The GGUF types the kernel plan puts in rows16 here: every rows16 type where the library has
    AVX-512 VNNI's forms; with its AVX2 forms all but Q8_0, whose signed codes (a row's 32 in one
    vector) multiply faster row by row there (bench/cpu_block_bench.py --rows16 --cpu-isa avx2);
    none without them (rows16_forms)."""
    if not rows16_forms():
        return ()
    vnni = _isa != "avx2" and "avx512_vnni" in _cpu_flags()
    return rows16.TYPES if vnni else rows16.EVERYWHERE


def bf16_gemm() -> bool:
    """Whether a prefill's block products may take bf16 GEMMs here (block_linear_bf16): the CPU
    multiplies bf16 natively (AVX512-BF16) and the library is not held to the AVX2 level."""
    return _isa != "avx2" and "avx512_bf16" in _cpu_flags()


def prefill_form(ggml_type: int | None = None) -> str:
    """How a prefill's many rows of a GGUF type on rounded inputs (cpu_int8) are multiplied here
    (BlockLinear's `prefill_form`): "bf16" where bf16_gemm; else "int8" (VNNI's tiles) with the
    AVX-512 forms, and with the AVX2 forms for the K-quants, whose tiles sum a super-block's 256
    codes in integers before one fp32 scale; "fp32" (x itself, the dequantized weights, torch's
    GEMM) for the AVX2 forms of the 32-weight types, whose tiles scale each 32 codes and ran
    slower than the fp32 GEMM (bench/cpu_block_bench.py --rows 512 --cached --cpu-isa avx2)."""
    if bf16_gemm():
        return "bf16"
    return "int8" if avx512_forms() or ggml_type in K_QUANTS else "fp32"


def _flags() -> list[str]:
    # ATen's and torch/library.h's headers are all under torch/include (torch.utils.cpp_extension
    # would say the same, but importing it costs ~0.1 s of every chat start)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    # -fopenmp: at::parallel_for is inline OpenMP in ATen's headers; without it every parallel_for
    # here ran on one thread. -L torch/lib first: the link takes torch's own libgomp, the runtime
    # (and thread pool) torch.set_num_threads already drives.
    return (["-O3", "-std=c++20", "-shared", "-fPIC", *ISA_FLAGS[_isa], "-fopenmp", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{os.path.join(root, 'include')}", f"-L{lib}", "-lc10",
             "-ltorch_cpu", f"-Wl,-rpath,{lib}"])


@functools.cache
def _cpu_signature() -> str:
    """-march=native code runs only where the same instructions exist: the CPU's flags are in the key.
    Read once a process: the flags do not change, and the library's checks ask for them often."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def library_path() -> str:
    h = hashlib.sha256()
    for source in [SOURCE] + HEADERS:
        with open(source, "rb") as f:
            h.update(f.read())
    for part in (torch.__version__, sys.version, " ".join(_flags()), _cpu_signature()):
        h.update(part.encode())
    return os.path.join(CACHE_DIR, f"cpu_step-{h.hexdigest()[:16]}.so")


def is_built() -> bool:
    return os.path.exists(library_path())


def serves(model, dtype: torch.dtype) -> bool:
    """Whether the C++ step serves this model's decode: switched on, fp32, and `supports`."""
    return ENABLED and dtype == torch.float32 and supports(model)


def build(path: str | None = None) -> str:
    """Compile the library (if not cached yet); returns its path. Raises Unavailable. A failed
    or interrupted build leaves nothing behind."""
    path = path or library_path()
    if os.path.exists(path):
        return path
    compiler = COMPILER
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as e:
        raise Unavailable(f"its cache folder {folder} is not writable ({e.strerror})") from None
    try:
        try:
            r = subprocess.run([compiler, SOURCE, "-o", tmp] + _flags(), capture_output=True, text=True)
        except OSError as e:
            raise Unavailable(f"no C++ compiler ({compiler}: {e.strerror})") from None
        if r.returncode != 0:
            first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:200])
            raise Unavailable(f"{compiler} failed: {first[:200]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


_loaded: str | None = None


def load() -> None:
    """Build if needed and load the library into this process (once). Raises Unavailable. A
    cached file that does not load (truncated, say) is rebuilt once."""
    global _loaded
    if _loaded is not None:
        return
    path = build()
    try:
        torch.ops.load_library(path)
    except OSError:
        try:
            os.unlink(path)
            torch.ops.load_library(build())
        except OSError as e:
            raise Unavailable(f"could not load {path}: {str(e)[:200]}") from None
    _loaded = path


def _linear_params(m: torch.nn.Module) -> list[torch.Tensor | None]:
    if isinstance(m, Int4Linear):
        return [m.packed, m.scale_zero, m.bias]
    if isinstance(m, BlockLinear):  # GGUF blocks as stored: their type rides in the scale slot
        # (+ INT8_INPUTS where the module rounds its input to int8: step.cpp's kInt8Inputs; then
        # the rows16 layout where the plan made one, its code above the GGUF types')
        w, code = m.int8_operand() if m.int8_inputs else (m.blocks, m.ggml_type)
        code += INT8_INPUTS if m.int8_inputs else 0
        return [w, torch.tensor([code], dtype=torch.int64), m.bias]
    return [m.weight, None, m.bias]


def _linear_ok(m) -> bool:
    return (isinstance(m, (Int4Linear, BlockLinear)) or
            (isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32)) and \
        (m.bias is None or m.bias.dtype == torch.float32)


def _parts(module, fused: str, names: tuple[str, ...]) -> list:
    return [getattr(module, fused)] if hasattr(module, fused) else [getattr(module, n) for n in names]


def qkv_linears(attn) -> list:
    """An attention's q/k/v linears as the steps read them: one fused, or three."""
    return _parts(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))


def linears_params(linears) -> list:
    """The parameters of these linears, one after another, as the steps take them."""
    return [p for m in linears for p in _linear_params(m)]


def _short_conv(layer):
    """The layer's short convolution (LFM2's conv layers: in_proj, conv, out_proj), else None."""
    return layer.conv if getattr(layer, "attention", True) is False and hasattr(layer, "conv") else None


def _projections(layer) -> tuple[list, list]:
    """A layer's q/k/v linears (one fused or three; none in a conv layer) and its gate/up linears
    (one fused or two)."""
    qkv = [] if _short_conv(layer) else qkv_linears(layer.self_attn)
    return qkv, _parts(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))


def supports(model) -> bool:
    """Whether a dense GQA model (Llama, Qwen2, Qwen3) or an LFM2 (the architectures that offer
    this step ask) has the weights the step reads: 4-bit, GGUF-block or fp32 linears, fp32 norms
    and conv weights."""
    cfg = model.config
    if cfg.head_dim > 512 or model.rope.rotary_dim % 2:
        return False
    for layer in model.model.layers:
        m, conv = layer.mlp, _short_conv(layer)
        qkv, gu = _projections(layer)
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if conv is not None:
            mixer = [conv.in_proj, conv.out_proj]
            if conv.conv.weight.dtype != torch.float32 or conv.kernel < 2 or \
                    (conv.conv.bias is not None and conv.conv.bias.dtype != torch.float32):
                return False
        else:
            if not hasattr(layer, "self_attn"):
                return False
            mixer = qkv + [layer.self_attn.o_proj]
            if cfg.qk_norm:
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        if not all(_linear_ok(x) for x in mixer + gu + [m.down_proj]):
            return False
        if any(n.weight.dtype != torch.float32 or n.offset != 0.0 or n.eps != cfg.rms_eps for n in norms):
            return False
    return isinstance(model.model.embed_tokens, (torch.nn.Embedding, Q8Embedding, BlockEmbedding))


def main() -> int:
    """Build (or find) the library; prints its path or why not (engine/prepare.py, which
    configures the cache folder and compiler first; `python -m models.kernels.cpu.step` alone
    takes the defaults)."""
    try:
        path = library_path()
        cached = os.path.exists(path)
        build(path)
    except Unavailable as e:
        print(f"CPU decode kernel not built: {e}; chat will decode with the torch step", file=sys.stderr)
        return 1
    print(f"CPU decode kernel {'cached' if cached else 'built'}: {path}")
    return 0


def _q8_head(model):
    """The model's LM head where it is a Q8_0 head the library sums in fp32 (not bf16), else None."""
    head = getattr(model, "lm_head", None)
    return head if hasattr(head, "fp32_kernel") and hasattr(head, "codes") else None


def has_blocks(model) -> bool:
    """Whether the model holds CPU weights the library's per-linear kernels read: GGUF blocks
    (BlockLinear, BlockExperts) or a Q8_0 head."""
    return _q8_head(model) is not None or any(
        (isinstance(m, BlockLinear) and not m.stored()[0].is_cuda) or
        (isinstance(m, BlockExperts) and not m.gate_blocks.is_cuda) for m in model.modules())


def int8_reference(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """x~ in fp64: x [T, K] fp32 rounded to int8 as block_linear(..., int8=True) rounds it for
    blocks of `ggml_type` (blocks_int8.h's contract, llama.cpp's rule): K-quants per 256 inputs
    (Q8_K: iscale = -127 / the input of largest |x|, q = min(127, round(iscale x)), x~ = q / iscale),
    the 32-weight types per 32 (q = round(x 127 / max|x|), x~ = q fp16(max|x| / 127)). For
    benchmarks' error columns; tests/kernels/test_block_int8.py writes its own."""
    x = x.float()
    if ggml_type in K_QUANTS:
        g = x.reshape(x.shape[0], -1, 256)
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True))
        nz = m != 0
        iscale = torch.where(nz, torch.full_like(m, -127.0) / torch.where(nz, m, 1.0), 0.0)
        d = torch.where(nz, torch.ones_like(m) / torch.where(nz, iscale, 1.0), 0.0)
        return (torch.round(iscale * g).clamp(max=127).double() * d.double()).reshape(x.shape)
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    d = (amax / torch.full_like(amax, 127.0)).half().double()
    return (torch.round(g * inv).clamp(-127, 127).double() * d).reshape(x.shape)


def attach_block_kernels(model, norms: bool = False) -> None:
    """The library's per-linear kernels on the model's modules, in place (loads the library;
    raises Unavailable): GGUF blocks read directly for a few rows, or for any number on int8
    inputs (BlockLinear's and BlockExperts' `fp32_kernel`: decode, and prefill with cpu_int8) or
    dequantized by it (fp32 prefill: `dequant_kernel`, gguf-py's values bit for bit), a Q8_0
    head's fp32 sums. The whole step serves dense GQA models;
    for the others (hybrids, MoE) this is what the C++ library does, and with `norms` their
    RMS norms of a few rows too (`cpu_kernel`: rms_norm_rows, one call where F.rms_norm is
    about seven ops) and their Gated DeltaNet steps (delta_decode, one call for ~40 ops): the
    same values to fp32 summation order."""
    load()
    if norms:  # the modules that name a library op as their `cpu_kernel_name` (RMSNorm, GatedDeltaNet, ...)
        for m in model.modules():
            name = getattr(type(m), "cpu_kernel_name", None)
            if name is not None:
                m.cpu_kernel = getattr(torch.ops.chat_cpu, name)
    head = _q8_head(model)
    if head is not None:
        head.fp32_kernel = torch.ops.chat_cpu.q8_linear
    bf16 = torch.ops.chat_cpu.block_linear_bf16 if bf16_gemm() else None
    for m in model.modules():
        if isinstance(m, (BlockLinear, BlockExperts)):
            m.fp32_kernel = torch.ops.chat_cpu.block_linear
            m.dequant_kernel = torch.ops.chat_cpu.block_dequant
            m.bf16_kernel = bf16
            forms = {t: prefill_form(t) for t in (m.types if isinstance(m, BlockExperts) else (m.ggml_type,))}
            m.prefill_form = next(iter(forms.values())) if len(set(forms.values())) == 1 else forms


def detach_block_kernels(model) -> None:
    """attach_block_kernels undone: the modules' torch forms again (a session with cpu_kernel off
    after one with it on, over the same model)."""
    for m in model.modules():
        for name in ("fp32_kernel", "dequant_kernel", "bf16_kernel", "prefill_form", "cpu_kernel"):
            m.__dict__.pop(name, None)


def kv_dtype_of(model) -> torch.dtype:
    """The KV cache's dtype under a C++ step of this model. With 4-bit weights (activations already
    rounded to bf16 at every matmul) or GGUF blocks, fp16, as llama.cpp keeps it: a long context's
    step reads half the bytes. (bf16 was tried: it changed a reply tests/formats/test_quant.py
    guards.) fp32 weights keep an fp32 cache, so that path stays the exact reference."""
    quantized = any(isinstance(m, (Int4Linear, BlockLinear)) for m in model.model.layers.modules())
    return torch.float16 if quantized else torch.float32


class CpuStep:
    """The decode step (one token) through the C++ library; call as the model is called."""

    def __init__(self, model):
        attach_block_kernels(model)
        self.model = model
        cfg = model.config
        params: list[torch.Tensor | None] = []
        meta = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.rope.rotary_dim, int(cfg.qk_norm)]
        for layer in model.model.layers:
            m, conv = layer.mlp, _short_conv(layer)
            qkv, gu = _projections(layer)
            params.append(layer.input_layernorm.weight)
            if conv is not None:  # (qkv parts 0 marks it in meta)
                params += _linear_params(conv.in_proj)
                params += [conv.conv.weight[:, 0].contiguous(), conv.conv.bias]
                params += _linear_params(conv.out_proj)
            else:
                a = layer.self_attn
                for x in qkv:
                    params += _linear_params(x)
                if cfg.qk_norm:
                    params += [a.q_norm.weight, a.k_norm.weight]
                params += _linear_params(a.o_proj)
            params.append(layer.post_attention_layernorm.weight)
            for x in gu:
                params += _linear_params(x)
            params += _linear_params(m.down_proj)
            meta += [len(qkv), len(gu)]
        self.params = [p.detach() if p is not None else None for p in params]
        self.meta = meta
        self.eps = float(cfg.rms_eps)
        self.op = torch.ops.chat_cpu.llama_step
        self.kv_dtype = kv_dtype_of(model)
        self._caches: tuple[object, list[torch.Tensor]] = (None, [])  # (state, its KV tensors)
        # the layers whose fixed state a verify keeps after each row, and its tensors' names
        self._fixed_layers = [(i, ("conv",)) for i, layer in enumerate(model.model.layers) if _short_conv(layer)]
        self._row_states: list[torch.Tensor] = []  # the last verify's, in _fixed_layers' order

    def _run(self, x, cos, sin, state, row_states: list[torch.Tensor]) -> torch.Tensor:
        """The library's step over x's rows (the op's call: HybridStep has its own)."""
        return self.op(x, cos, sin, self.params, self._state_tensors(state), self.meta, state.length, self.eps,
                       row_states)

    def _state_tensors(self, state) -> list[torch.Tensor]:
        if self._caches[0] is not state:  # the state's buffers never move: list them once
            fixed = dict(self._fixed_layers)
            self._caches = (state, [t for i in range(len(self.model.model.layers))
                                    for t in ([state.fixed(i)[n] for n in fixed[i]] if i in fixed else state.kv(i))])
        return self._caches[1]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, state, all_logits: bool = False) -> torch.Tensor:
        if tokens.shape[0] != 1:
            raise ValueError("CpuStep decodes one token; prefill runs the model itself")
        model = self.model
        x = model.embed(tokens)
        cos, sin = model.rope.cos_sin(positions, x.dtype)
        x = self._run(x, cos, sin, state, [])
        if model.hidden_sink is None:
            return model.logits(x)
        normed = model.model.norm(x, torch.float32)  # (model.logits' norm on the CPU, once for both)
        model.hidden_sink(positions, normed)
        return model.normed_logits(normed)

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, state) -> torch.Tensor:
        """Logits [T, vocab] for T tokens fed at once at positions state.length.. (a speculative
        verify), each row bit for bit what `__call__` gives for that token after the ones before
        it, the state written as T calls write it; the weights are read once. The embeddings, RoPE
        tables and final norms are taken a row at a time, as the one-token step takes them; the
        head's rows through the library's row-exact forms (llama_step's contract)."""
        model = self.model
        n = tokens.shape[0]
        x = torch.cat([model.embed(tokens[t:t + 1]) for t in range(n)])
        tables = [model.rope.cos_sin(positions[t:t + 1], x.dtype) for t in range(n)]
        cos = torch.cat([c for c, _ in tables])
        sin = torch.cat([s for _, s in tables])
        self._row_states = [torch.empty((n, *state.fixed(i)[name].shape), dtype=state.fixed(i)[name].dtype)
                            for i, names in self._fixed_layers for name in names]
        x = self._run(x, cos, sin, state, self._row_states)
        # the final norm a row at a time, as the one-token step norms its row (CausalLM.logits on the
        # CPU: add_norm is the norm), once for the head and the MTP layer's rows both
        normed = torch.cat([model.model.norm(x[t:t + 1], torch.float32) for t in range(x.shape[0])])
        if model.hidden_sink is not None:
            model.hidden_sink(positions, normed)
        return self._head_rows(normed)

    def fixed_after(self, rows: int) -> list[dict[str, torch.Tensor] | None]:
        """The fixed state after the first `rows` rows of the last verify, per layer as the state
        holds it (None for an attention layer): the conv windows (and DeltaNet's recurrent
        states) it kept row by row. What StateManager.unfeed copies in when rejected drafts are
        unfed."""
        out: list[dict[str, torch.Tensor] | None] = [None] * len(self.model.model.layers)
        kept = iter(self._row_states)
        for i, names in self._fixed_layers:
            out[i] = {name: next(kept)[rows - 1] for name in names}
        return out

    def _head_rows(self, normed: torch.Tensor) -> torch.Tensor:
        """model.normed_logits of each final-normed row (the head as layers.head_logits takes a CPU
        head: its module's own product in fp32), the head's rows in one call where its kernel sums
        each row as a one-row call does."""
        model = self.model
        head = model.lm_head
        if isinstance(head, BlockLinear) and head.fp32_kernel is not None:  # (BlockLinear.forward's, by rows)
            w, code = head.int8_operand() if head.int8_inputs else (head.blocks, head.ggml_type)
            y = torch.ops.chat_cpu.block_linear_rows(normed.contiguous(), w, code, head.int8_inputs)
            return model.scale_logits((y if head.bias is None else y + head.bias).float())
        if _q8_head(model) is not None or isinstance(head, Int4Linear):  # their kernels sum each row alike
            return model.scale_logits(head(normed).float())
        # (an fp32 GEMM's rows are not)
        return torch.cat([model.normed_logits(normed[t:t + 1]) for t in range(normed.shape[0])])


STEP = CpuStep

if __name__ == "__main__":
    sys.exit(main())
