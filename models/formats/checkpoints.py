"""Checkpoints → one {hf_name: tensor} dict + an HF-style config dict + tokenizer + template.

Two sources:
- an HF checkpoint directory: config.json, model.safetensors or sharded safetensors with their
  index, tokenizer.json, tokenizer_config.json or chat_template.jinja, generation_config.json;
- a GGUF file: metadata → config, tensors dequantized to gguf-py's values (gguf_blocks' torch
  form where it knows the type, else the `gguf` package; ggml order
  reversed, llama.cpp's Q/K row permutation undone, its converter's value changes on the hybrid
  and MoE architectures undone), the tokenizer rebuilt from its arrays.
Weights are never unpickled. Every failure raises `CheckpointError` with a one-line message.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer


class CheckpointError(ValueError):
    """A missing, unreadable, corrupt or unsupported checkpoint; the message is for the user."""


@dataclass
class Checkpoint:
    config: dict                      # HF-style config.json contents
    tensors: dict[str, torch.Tensor]  # HF names
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_ids: tuple[int, ...]
    files: list[str] = field(default_factory=list)  # what the fingerprint hashes
    notes: list[str] = field(default_factory=list)  # one line each, for the user (e.g. types dequantized)


# Tokens that end a turn in the chat formats we know; llama.cpp treats them as end-of-generation too.
END_OF_TURN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|end|>", "<|eom_id|>", "<reponame>")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


# --- HF directories ---------------------------------------------------------------------------

def load_hf_dir(path: str, lazy: bool = False) -> Checkpoint:
    """lazy: the tensors are LazyTensor (read when and as far as indexed: a tensor-parallel rank
    reads only its slices)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (expected an HF checkpoint directory or a .gguf file)")
    config = _read_json(cfg_path)
    tensors, files = (_open_safetensors if lazy else _read_safetensors)(path)
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"{path}: no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises plain Exception subclasses with long messages
        raise CheckpointError(f"{tok_path}: not a valid tokenizer file ({str(e).splitlines()[0]})") from None
    tok_cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = _read_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos_token = _token_text(tok_cfg.get("eos_token"))
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        eos_ids.append(tokenizer.token_to_id(eos_token))
    files = [cfg_path, tok_path] + files
    return Checkpoint(config, tensors, tokenizer, template, _token_text(tok_cfg.get("bos_token")), eos_token,
                      tuple(dict.fromkeys(eos_ids)), files)


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index}: the weight_map is empty")
    else:
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no .safetensors weights (other formats are not loaded: "
                                  "they could run code)")
    files = []
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: shard listed in the index is missing")
        files.append(file)
    return files


def _read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    files = _shard_files(path)
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    return tensors, files


class LazyTensor:
    """A tensor of a safetensors file, not read yet: its shape from the header, `part()` a
    slice object that reads only what it is indexed with, `read()` the whole tensor."""

    def __init__(self, handle, name: str):
        self._handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def meta(self) -> torch.Tensor:
        """A meta tensor of this shape (for renames that only need shapes)."""
        return torch.empty(self.shape, device="meta")

    def part(self):
        return self._handle.get_slice(self.name)

    def read(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


def _open_safetensors(path: str) -> tuple[dict[str, LazyTensor], list[str]]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, LazyTensor] = {}
    files = _shard_files(path)
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
            tensors.update({name: LazyTensor(handle, name) for name in handle.keys()})
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    return tensors, files


# --- GGUF files -------------------------------------------------------------------------------

# ggml tensor names → HF names (the one place renames live); N is the layer index. The hybrids'
# and MoE names are llama.cpp's (qwen35, qwen35moe, qwen3next, qwen3moe); `_gguf_values` undoes
# what its converter changed in their values.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Gated DeltaNet (the converter writes Qwen3-Next's in_proj_qkvz as attn_qkv + attn_gate)
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b", "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    # MoE: the router, the experts as 3D tensors ([E, rows, cols] once reversed), the shared expert
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# tensors whose whole name changes (no .weight in one of the two)
_GGUF_LEAF_NAMES = {
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
               "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next", "lfm2": "lfm2",
               "granitehybrid": "granitemoehybrid", "nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h"}
_HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_LAYER_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")
# Families whose HF names differ from the llama ones above (by model type): their names, over
# those defaults; whole-tensor names (LFM2's token_embd_norm) are looked up first.
# Mamba2 hybrids: a Mamba2 mixer's tensors (ssm_a holds A = -exp(A_log), ssm_d and ssm_norm are
# reshaped: _mamba2_fixups), and the names that differ by family (Nemotron-H's blocks hold one
# `mixer` under one `norm`; Granite's routed experts are stacked gate and up: ours concatenate them)
_MAMBA2 = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_dt": "dt_bias", "ssm_a": "A_log", "ssm_d": "D",
           "ssm_norm": "norm", "ssm_out": "out_proj"}
_GGUF_FAMILY_NAMES = {
    "lfm2": {
        "token_embd_norm.weight": "model.embedding_norm.weight",  # LFM2's final norm, despite the name
        "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
        "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
        "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
        "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    },
    "granitemoehybrid": {**{k: "mamba." + v for k, v in _MAMBA2.items()},
                         "ffn_gate_inp": "block_sparse_moe.router", "ffn_gate_exps": "block_sparse_moe.experts.gate",
                         "ffn_up_exps": "block_sparse_moe.experts.up", "ffn_down_exps": "block_sparse_moe.experts.down",
                         "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
                         "ffn_down_shexp": "shared_mlp.down_proj", "ffn_gate": "shared_mlp.gate_proj",
                         "ffn_up": "shared_mlp.up_proj", "ffn_down": "shared_mlp.down_proj"},
    "nemotron_h": {**{k: "mixer." + v for k, v in _MAMBA2.items()},
                   "attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
                   "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"},
}
_GGUF_BARE = {"ssm_dt", "ssm_a", "ssm_d", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
# families whose converter permutes attn_q / attn_k rows for llama.cpp's RoPE layout
_GGUF_PERMUTED_QK = {"llama", "granitemoehybrid", "nemotron_h"}
_LEAF_RE = re.compile(r"blk\.(\d+)\.(\w+(?:\.weight|\.bias)?)$")




def _hf_name(name: str, model_type: str = "") -> str:
    family = _GGUF_FAMILY_NAMES.get(model_type, {})
    if name in family:
        return family[name]
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = _LEAF_RE.match(name)
    if not family and m and m.group(2) in _GGUF_LEAF_NAMES:  # llama.cpp's Qwen hybrid and MoE leaves
        return f"model.layers.{m.group(1)}.{_GGUF_LEAF_NAMES[m.group(2)]}"
    m = _LAYER_RE.match(name)
    names = {**_GGUF_LAYER_NAMES, **family}
    if not m or m.group(2) not in names:
        raise CheckpointError(f"GGUF tensor {name!r} is not one this architecture has")
    leaf = names[m.group(2)]
    bare = m.group(2) in _GGUF_BARE  # HF holds these as parameters of the layer itself
    return f"model.layers.{m.group(1)}.{leaf}" + (f".{m.group(3)}" if m.group(3) and not bare else "")


def _lfm2_config(config: dict, a) -> None:
    """LFM2: a KV head count per layer, 0 marking a short-conv layer; the MLP width as stored."""
    kv = config["num_key_value_heads"]
    kv = kv if isinstance(kv, list) else [kv] * config["num_hidden_layers"]
    config.update(num_key_value_heads=max(kv), layer_types=["full_attention" if h else "conv" for h in kv],
                  conv_L_cache=a("shortconv.l_cache", 3), norm_eps=config["rms_norm_eps"],
                  block_auto_adjust_ff_dim=False)


# Families whose config needs more than the llama keys read in _read_gguf_index (by model type).
_GGUF_FAMILY_CONFIG = {"lfm2": _lfm2_config}
_MAMBA2_FAMILIES = {"granitemoehybrid", "nemotron_h"}


def _mamba2_fixups(tensors: dict) -> None:
    """In place: llama.cpp's Mamba2 tensors → the HF forms (A_log from A, D and the gated norm's
    weight flat), and Granite's stacked routed experts' gate and up → one gate_up_proj."""
    for name in list(tensors):
        t = tensors.get(name)
        if t is None:  # an expert's up or down, consumed with its gate
            continue
        if name.endswith(".A_log"):
            tensors[name] = (-t.reshape(-1).double()).log().float()
        elif name.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
            tensors[name] = t.reshape(-1)
        elif name.endswith("block_sparse_moe.experts.gate"):
            base = name[: -len("gate")]
            del tensors[name]
            _join_experts(tensors, base, t, tensors.pop(base + "up"), tensors.pop(base + "down"))


def _join_experts(tensors: dict, base: str, gate, up, down) -> None:
    """Into `tensors`: a layer's routed experts stored apart as GGUF writes them (gate and up
    [E, I, H], down [E, H, I]; `base` ends with "experts."): one GgufExperts entry named after the
    module, its blocks kept, where all three are GGUF tensors; else gate_up_proj [E, 2I, H]
    and down_proj, dequantized."""
    from . import quant
    if all(isinstance(x, quant.GgufTensor) for x in (gate, up, down)):
        tensors[base[:-1]] = quant.GgufExperts(gate, up, down)
        return
    gate, up, down = [x.dequantize() if isinstance(x, quant.GgufTensor) else x for x in (gate, up, down)]
    tensors[base + "gate_up_proj"] = torch.cat([gate, up], dim=1)
    tensors[base + "down_proj"] = down


def _tiled_to_grouped(t, dim: int, nk: int, nv: int, head: int):
    """Undo the converter's reordering of linear-attention value heads (qwen35, qwen35moe): it
    stores them tiled ([v0 of every key head, v1 of every key head, ...]) for ggml's broadcast;
    HF groups them by key head. `t` is a torch tensor or a quant.GgufTensor (rows only)."""
    r = nv // nk
    n = nv * head
    perm = torch.arange(n).reshape(r, nk, head).transpose(0, 1).reshape(n)  # grouped slot → tiled slot
    from . import quant
    if isinstance(t, quant.GgufTensor):
        if dim != 0:
            t = t.dequantize()
        else:
            return t.permute_rows(lambda a: np.ascontiguousarray(a[perm.numpy()]))
    return t.index_select(dim, perm)


def _tiled_slots(split: int, nk: int, nv: int, head: int) -> np.ndarray:
    """The row order that puts a [q; k; v] projection's tiled value rows (after `split` rows of
    q and k) back in HF's grouped order, q and k rows unmoved: for GGUF blocks, whose rows move
    whole."""
    r, n = nv // nk, nv * head
    perm = np.arange(n).reshape(r, nk, head).transpose(1, 0, 2).reshape(n)
    return np.concatenate([np.arange(split), split + perm])


def _gguf_values(config: dict, tensors: dict) -> None:
    """In place: the values llama.cpp's converter changed, back to HF's (hybrids: zero-centred
    norms stored as 1 + w, A_log stored as -exp(A_log), value heads tiled; MoE: gate and up
    experts stored apart). A Gated DeltaNet out_proj kept in GGUF blocks keeps the converter's
    tiled column order (its columns cannot move within blocks: a value head of 128 columns is
    half a K-quant block): `config["linear_out_proj_tiled"]` then tells the model to feed it
    its value heads in that order (qwen3_5.GatedDeltaNet.out_tiled), and every layer's
    out_proj stays as stored."""
    from . import quant
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_proj")]:
        base = name[: -len("gate_proj")]
        _join_experts(tensors, base, tensors.pop(name), tensors.pop(base + "up_proj"), tensors.pop(base + "down_proj"))
    if config["model_type"] not in _HYBRIDS:
        return
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    reorder = config["model_type"] != "qwen3_next" and nk != nv
    tiled_out = reorder and any(n.endswith("linear_attn.out_proj.weight") and isinstance(t, quant.GgufTensor)
                                for n, t in tensors.items())
    if tiled_out:
        config["linear_out_proj_tiled"] = True
    for name in list(tensors):
        t = tensors[name]
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensors[name] = t = t - 1.0
        elif name.endswith("A_log"):
            tensors[name] = t = torch.log(-t)
        if not reorder or ".linear_attn." not in name:
            continue
        if name.endswith("in_proj_qkv.weight"):
            split = 2 * nk * dk
            if isinstance(t, quant.GgufTensor):  # whole rows move: the blocks are kept
                slots = _tiled_slots(split, nk, nv, dv)
                tensors[name] = t.permute_rows(lambda a, s=slots: np.ascontiguousarray(a[s]))
            else:
                tensors[name] = torch.cat([t[:split], _tiled_to_grouped(t[split:], 0, nk, nv, dv)])
        elif name.endswith("conv1d.weight"):
            split = 2 * nk * dk
            tensors[name] = torch.cat([t[:split], _tiled_to_grouped(t[split:], 0, nk, nv, dv)])
        elif name.endswith("in_proj_z.weight"):
            tensors[name] = _tiled_to_grouped(t, 0, nk, nv, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            tensors[name] = _tiled_to_grouped(t, 0, nk, nv, 1)
        elif name.endswith("out_proj.weight") and not tiled_out:
            tensors[name] = _tiled_to_grouped(t, 1, nk, nv, dv)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's rows for its RoPE layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    if len(f.types) == 1 and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if f.types[0].name == "ARRAY":
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return np.concatenate([f.parts[i] for i in f.data]).tolist() if f.data else []
    return f.parts[f.data[0]].tolist()[0]


def load_gguf(path: str, keep_quantized: bool = False) -> Checkpoint:
    """A GGUF file → Checkpoint. Parsing the metadata (gguf's reader: seconds for a large vocab)
    is done once per file version and cached as an index; tensors are read through a memmap.
    keep_quantized: matrices of the types `quant.keeps` names come back as `quant.GgufTensor`, a
    view of the file's mapped pages (copy-on-write, never written: no copy is made; llama's Q/K
    rows, which must be reordered, are the exception); everything else is dequantized to fp32,
    and a note names the types that could have been kept but for their type."""
    from gguf.quants import dequantize

    from . import gguf_blocks, quant

    index = _cached_index(path)
    if index is None:
        index = _read_gguf_index(path)
        _store_index(path, index)
    tensors = {}
    widened: dict[str, int] = {}
    try:
        # mode "c": a private mapping, so torch.from_numpy gets a writable array over the file's pages
        data = np.memmap(path, dtype=np.uint8, mode="c")
        for name, ttype, shape, dtype, offset in index["tensors"]:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if offset + n > data.shape[0]:
                raise CheckpointError(f"{path}: truncated: tensor {name!r} ends past the end of the file")
            raw = data[offset:offset + n].view(dtype).reshape(shape)
            unpermute = None
            model_type = index["config"]["model_type"]
            if (model_type in _GGUF_PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight"))
                    and int(name.split(".")[1]) not in index["config"].get("qk_rows_as_hf", ())):
                heads = index["config"]["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
                unpermute = lambda a, h=heads: np.ascontiguousarray(unpermute_qk(a, h))  # noqa: E731
            if keep_quantized and quant.keeps(ttype) and len(shape) in (2, 3):  # 3D: MoE experts
                qt = quant.GgufTensor(ttype, raw)
                tensors[_hf_name(name, model_type)] = qt if unpermute is None else qt.permute_rows(unpermute)
                continue
            if keep_quantized and len(shape) in (2, 3) and ttype not in (0, 1, 30):  # F32, F16, BF16
                kind = gguf_type(ttype).name
                widened[kind] = widened.get(kind, 0) + 1
            if raw.dtype == np.uint8 and gguf_blocks.dequantizes(ttype):
                # (torch's form: gguf-py's values bit for bit, ~5x faster: tests/test_gguf_blocks.py)
                w = gguf_blocks.dequantize(torch.from_numpy(raw), ttype).numpy()
            else:
                w = np.array(dequantize(raw, gguf_type(ttype)), dtype=np.float32)  # owned, writable
            if unpermute is not None:
                w = unpermute(w)
            tensors[_hf_name(name, model_type)] = torch.from_numpy(np.ascontiguousarray(w))
        config = dict(index["config"])  # this load's own: _gguf_values may add to it
        _gguf_values(config, tensors)
    except CheckpointError:
        raise
    except NotImplementedError as e:  # gguf-py cannot dequantize this type either
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt tensor data ({type(e).__name__}: {e})".splitlines()[0]) from None
    if index["config"].get("mamba2"):
        _mamba2_fixups(tensors)
    notes = [f"{count} {kind} tensor{'s' * (count > 1)} dequantized to fp32 (kept in blocks: "
             f"{', '.join(gguf_type(t).name for t in quant.kept_types())})"
             for kind, count in sorted(widened.items())]
    tokenizer = Tokenizer.from_str(index["tokenizer"])
    return Checkpoint(config, tensors, tokenizer, index["chat_template"], index["bos_token"],
                      index["eos_token"], tuple(index["eos_ids"]), [path], notes)


def gguf_type(value: int):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(value)


def _read_gguf_index(path: str) -> dict:
    import gguf

    from .gguf_tokenizer import TokenizerError, build

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on damage
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})".splitlines()[0]) from None
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(_GGUF_ARCHS)})")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    # multi-token-prediction blocks (llama.cpp's nextn layers) come after the model's own: skipped
    n_layers = a("block_count") - a("nextn_predict_layers", 0)
    own = [t for t in reader.tensors
           if not ((m := re.match(r"blk\.(\d+)\.", t.name)) and int(m.group(1)) >= n_layers)]
    heads = a("attention.head_count")
    kv_heads = a("attention.head_count_kv", heads)
    hidden = a("embedding_length")
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": _GGUF_ARCHS[arch], "hidden_size": hidden, "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": a("attention.key_length", hidden // heads), "rope_theta": a("rope.freq_base", 10000.0),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": a("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if config["model_type"] in _GGUF_FAMILY_CONFIG:
        _GGUF_FAMILY_CONFIG[config["model_type"]](config, a)
    if config["model_type"] in _MAMBA2_FAMILIES:
        config.update(_mamba2_hybrid_config(config["model_type"], a, reader))
    if a("expert_count") and config["model_type"] not in _GGUF_FAMILY_NAMES:
        config.update(num_experts=a("expert_count"), num_experts_per_tok=a("expert_used_count"),
                      moe_intermediate_size=a("expert_feed_forward_length"),
                      shared_expert_intermediate_size=a("expert_shared_feed_forward_length", 0),
                      # llama.cpp renormalises the top-k weights of these architectures unconditionally
                      norm_topk_prob=True)
    if config["model_type"] in _HYBRIDS:
        n, interval = config["num_hidden_layers"], a("full_attention_interval", 4)
        recurrent = a("attention.recurrent_layers") or [(i + 1) % interval != 0 for i in range(n)]
        nv = a("ssm.time_step_rank")
        config.update(layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:n]],
                      linear_conv_kernel_dim=a("ssm.conv_kernel"), linear_key_head_dim=a("ssm.state_size"),
                      linear_num_key_heads=a("ssm.group_count"), linear_num_value_heads=nv,
                      linear_value_head_dim=a("ssm.inner_size") // nv,
                      partial_rotary_factor=a("rope.dimension_count") / config["head_dim"])
    if config["intermediate_size"] is None:
        del config["intermediate_size"]  # MoE everywhere (qwen35moe); a dense family then names it missing
    missing = [k for k, v in config.items() if v is None]
    if missing and config["model_type"] not in _GGUF_FAMILY_NAMES:
        raise CheckpointError(f"{path}: the GGUF metadata lacks what {arch!r} needs ({', '.join(missing)})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{path}: the GGUF file has no tokenizer")
    config["vocab_size"] = a("vocab_size", len(tokens))
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    try:
        tokenizer = build(tokens, types, _field(reader, "tokenizer.ggml.merges") or [],
                          _field(reader, "tokenizer.ggml.pre", "default"), _field(reader, "tokenizer.ggml.model"))
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e}") from None
    for t in own:
        _hf_name(t.name, config["model_type"])  # unknown tensor names fail now, not after caching
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [i for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None]
    # llama.cpp also ends generation on its end-of-turn control tokens (and the FIM repo-name token)
    eos_ids += [i for i, tt in enumerate(types) if tt == 3 and tokens[i] in END_OF_TURN_TEXTS]
    return {
        "config": config, "tokenizer": tokenizer.to_str(), "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": tokens[bos] if bos is not None else None, "eos_token": tokens[eos] if eos is not None else None,
        "eos_ids": list(dict.fromkeys(eos_ids)),
        "tensors": [(t.name, int(t.tensor_type), list(t.data.shape), t.data.dtype.str, int(t.data_offset))
                    for t in own],
    }


def _mamba2_hybrid_config(model_type: str, a, reader) -> dict:
    """The HF config keys of a Granite 4.0-H or Nemotron-H GGUF. Each layer's kind comes from its
    tensors (ssm_in: Mamba2, attn_q: attention, else an MLP). llama.cpp steps Mamba2 without
    transformers' time_step_min clamp and runs Granite's attention without RoPE unless
    rope.scaling.finetuned says otherwise (the converter sets it only for all-attention models)."""
    names = {t.name for t in reader.tensors}
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    if any(n.endswith("_exps.weight") for n in names) and model_type == "nemotron_h":
        raise CheckpointError("Nemotron-H routed-expert (MoE) GGUF files are not supported (dense Nemotron-H is)")
    n_layers = a("block_count")
    kinds = ["mamba" if f"blk.{i}.ssm_in.weight" in names else "attention" if f"blk.{i}.attn_q.weight" in names
             else "mlp" for i in range(n_layers)]
    kv_layers = a("attention.head_count_kv", 0)
    kv_layers = kv_layers if isinstance(kv_layers, list) else [kv_layers] * n_layers
    heads, inner, n_heads = a("attention.head_count"), a("ssm.inner_size"), a("ssm.time_step_rank")
    # The converter permutes q/k rows, and counts KV heads, only in the layers its config's layer
    # types call attention: one it missed (Granite's as transformers 5 names it, "full_attention")
    # has head_count_kv 0 and HF's rows, and its KV heads are attn_k's rows over the head width
    attn = [i for i in range(n_layers) if kinds[i] == "attention"]
    as_hf = [i for i in attn if not kv_layers[i]]
    kv = max(kv_layers) or (shapes[f"blk.{attn[0]}.attn_k.weight"][1] * heads
                            // shapes[f"blk.{attn[0]}.attn_q.weight"][1] if attn else heads)
    mamba = {"mamba2": True, "num_key_value_heads": kv, "qk_rows_as_hf": as_hf, "num_hidden_layers": n_layers,
             "rms_norm_eps": a("attention.layer_norm_rms_epsilon", a("attention.layer_norm_epsilon", 1e-5)),
             "time_step_limit": [0.0, float("inf")]}
    first_ssm = kinds.index("mamba") if "mamba" in kinds else None
    conv_bias = first_ssm is not None and f"blk.{first_ssm}.ssm_conv1d.bias" in names
    proj_bias = first_ssm is not None and f"blk.{first_ssm}.ssm_in.bias" in names
    if model_type == "nemotron_h":
        ffn = [shapes[f"blk.{i}.ffn_up.weight"][1] for i in range(n_layers) if kinds[i] == "mlp"]
        return {**mamba, "layers_block_type": kinds, "layer_norm_epsilon": mamba["rms_norm_eps"],
                "head_dim": a("attention.key_length", 0) or None, "intermediate_size": ffn[0] if ffn else 0,
                "mamba_num_heads": n_heads, "mamba_head_dim": inner // n_heads, "ssm_state_size": a("ssm.state_size"),
                "n_groups": a("ssm.group_count", 1), "conv_kernel": a("ssm.conv_kernel"), "use_conv_bias": conv_bias,
                "use_bias": proj_bias, "time_step_min": 0.0}
    experts = a("expert_count", 0)
    return {**mamba, "layer_types": kinds, "position_embedding_type":
            "rope" if a("rope.scaling.finetuned", False) else "nope",
            "num_local_experts": experts, "num_experts_per_tok": a("expert_used_count", 0),
            "shared_intermediate_size": a("expert_shared_feed_forward_length", 0) or a("feed_forward_length"),
            "mamba_n_heads": n_heads, "mamba_d_head": inner // n_heads, "mamba_d_state": a("ssm.state_size"),
            "mamba_n_groups": a("ssm.group_count", 1), "mamba_d_conv": a("ssm.conv_kernel"),
            "mamba_conv_bias": conv_bias, "mamba_proj_bias": proj_bias, "mamba_expand": inner // a("embedding_length"),
            "attention_multiplier": a("attention.scale", 1.0), "embedding_multiplier": a("embedding_scale", 1.0),
            "residual_multiplier": a("residual_scale", 1.0), "logits_scaling": a("logit_scale", 1.0)}


INDEX_VERSION = 4


def _index_path(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    import hashlib
    key = f"{INDEX_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "chat", "gguf-index", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _cached_index(path: str) -> dict | None:
    cache = _index_path(path)
    if cache is None or not os.path.isfile(cache):
        return None
    try:
        with open(cache, encoding="utf-8") as f:
            index = json.load(f)
        return index if index.get("version") == INDEX_VERSION else None
    except (OSError, ValueError):
        return None  # a damaged cache entry is rebuilt, never trusted


def _store_index(path: str, index: dict) -> None:
    """Best effort (a read-only home still loads, only slower); written atomically."""
    cache = _index_path(path)
    if cache is None:
        return
    try:
        import tempfile
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dict(index, version=INDEX_VERSION), f)
        os.replace(tmp, cache)
    except OSError:
        pass
