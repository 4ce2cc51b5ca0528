"""Checkpoints → one {hf_name: tensor} dict + an HF-style config dict + tokenizer + template.

Two sources:
- an HF checkpoint directory: config.json, model.safetensors or sharded safetensors with their
  index, tokenizer.json, tokenizer_config.json or chat_template.jinja, generation_config.json;
- a GGUF file: metadata → config, tensors dequantized to gguf-py's values (gguf_blocks' torch
  form where it knows the type, else the `gguf` package; ggml order
  reversed, llama.cpp's Q/K row permutation undone, its converter's value changes on the hybrid
  and MoE architectures undone), the tokenizer rebuilt from its arrays.
Weights are never unpickled. Every failure raises `CheckpointError` with a one-line message:
only regular files are read (a FIFO or a device would block or never end), JSON must decode as
UTF-8 objects, config values are type- and range-checked (`check_config`) before anything is
built from them, and a GGUF header is walked with bounds checks before gguf's reader parses it.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
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
    # the model's own sampling defaults (SamplingConfig keys → values as the file gives them,
    # unchecked: the front end validates them) and the file that says so
    sampling: dict = field(default_factory=dict)
    sampling_source: str = ""


# generation_config.json's sampling keys (transformers' names) → SamplingConfig's
HF_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
               "repetition_penalty": "repetition_penalty"}
# a GGUF's general.sampling.* keys (llama.cpp's) → SamplingConfig's
GGUF_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty", "penalty_last_n": "penalty_last_n"}


def hf_sampling(gen: dict) -> dict:
    """The sampling defaults a generation_config.json states: its values as given; `do_sample:
    false` (the model decodes greedily by default) is temperature 0."""
    out = {ours: gen[theirs] for theirs, ours in HF_SAMPLING.items() if gen.get(theirs) is not None}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


# Tokens that end a turn in the chat formats we know; llama.cpp treats them as end-of-generation too.
END_OF_TURN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|end|>", "<|eom_id|>", "<reponame>")


# --- files and JSON -----------------------------------------------------------------------------

_SPECIAL_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a stat mode that is not a regular file's is, in words."""
    return next((name for test, name in _SPECIAL_FILES if test(mode)), "not a regular file")


def os_problem(path: str, e: OSError) -> str:
    """An OSError on `path` in a few words (a link loop or a dangling link said as such)."""
    if e.errno == errno.ELOOP:
        return "a symbolic link loop"
    if e.errno in (errno.ENOENT, errno.ENOTDIR) and os.path.islink(path):
        try:
            return f"a broken symbolic link (to {_clip(os.readlink(path))})"
        except OSError:
            return "a broken symbolic link"
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return "no such file or directory"
    return (e.strerror or type(e).__name__).lower()


def _clip(value, limit: int = 80, as_json: bool = False) -> str:
    """repr(value) (or its JSON), at most about `limit` characters: messages quote bad values,
    never whole files."""
    try:
        text = json.dumps(value, ensure_ascii=False) if as_json else repr(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def regular_file(path: str, required: bool = True) -> bool:
    """Whether `path` is a regular file (links followed); False where nothing is there and it is
    not required. Anything else there is a CheckpointError: a FIFO or a device would block a
    read forever or never end."""
    try:
        st = os.stat(path)
    except OSError as e:
        if not required and e.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.islink(path):
            return False
        raise CheckpointError(f"{path}: {os_problem(path, e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {file_kind(st.st_mode)}, not a regular file")
    return True


def read_bytes(path: str, limit: int = -1) -> bytes:
    """A regular file's bytes (the first `limit`). Opened without blocking and checked again on
    the open descriptor, so a FIFO put there after the check cannot hang the read either."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {os_problem(path, e)}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: {file_kind(mode)}, not a regular file")
        try:
            return f.read(limit)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {os_problem(path, e)}") from None


def read_text(path: str) -> str:
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _json_kind(value) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")


def _read_json(path: str) -> dict:
    """A JSON file that must hold an object (every JSON file of a checkpoint does)."""
    text = read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting past the stack
        raise CheckpointError(f"{path}: invalid JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object {{...}}, found {_json_kind(value)}")
    return value


# --- config values ----------------------------------------------------------------------------

# The config key that says how many MTP layers the checkpoint's tensors hold (set at load by
# models/loader.py's count_mtp_layers; read by the families that build the layer: qwen3_5.py)
MTP_LOADED = "mtp_layers_loaded"

# Sizes the architectures build tensors and loops from: integers (never bool, float or string)
# from a lower bound to SIZE_LIMIT, so that no absurd value reaches torch or a Python loop.
SIZE_LIMIT = 1 << 24
_POSITIVE_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "attention_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
    "n_groups", "conv_kernel", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
    "conv_L_cache", "decoder_sparse_step", "full_attention_interval", "block_multiple_of")
# 0 means none (no experts, no shared expert, head_dim derived from the hidden size)
_ZERO_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
               "shared_intermediate_size", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
               "block_ff_dim", "mamba_expand")
_NUMBERS = ("rms_norm_eps", "norm_eps", "layer_norm_epsilon", "rope_theta", "partial_rotary_factor", "time_step_min",
            "mamba_dt_min", "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
            "block_ffn_dim_multiplier")
_BOOLS = ("tie_word_embeddings", "tie_embedding", "attention_bias", "mlp_bias", "norm_topk_prob", "use_conv_bias",
          "use_bias", "mamba_conv_bias", "mamba_proj_bias", "conv_bias", "block_auto_adjust_ff_dim",
          "linear_allow_neg_eigval")
_OBJECTS = ("text_config", "rope_parameters", "rope_scaling", "quantization_config")
_LISTS = ("layer_types", "layers_block_type", "mlp_only_layers", "full_attn_idxs", "time_step_limit")
_STRINGS = ("model_type", "hybrid_override_pattern", "position_embedding_type")


def check_config(config: dict, source: str) -> dict:
    """`config` (an HF-style config, or one made from GGUF metadata) with every value the
    architectures read checked for its type and range, the text model's nested config too;
    `source` names the file in the message. Absent and null values are the architecture's to
    default or report."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: the config must be an object, found {_json_kind(config)}")
    _check_values(config, source, "")
    if "text_config" in config:
        _check_values(config["text_config"], source, "text_config.")
    return config


def _check_values(c: dict, source: str, where: str) -> None:
    def bad(key, what):
        raise CheckpointError(f"{source}: {where}{key} must be {what}, not {_clip(c[key], as_json=True)}")

    for key in _OBJECTS:  # (a null text_config would silently make the top level the text model's)
        if (c.get(key) is not None or key == "text_config" and key in c) and not isinstance(c[key], dict):
            bad(key, "an object {...}")
    for key in _LISTS:
        if c.get(key) is not None and not isinstance(c[key], list):
            bad(key, "a list")
    for key in _STRINGS:
        if c.get(key) is not None and not isinstance(c[key], str):
            bad(key, "a string")
    for key in _BOOLS:
        if c.get(key) is not None and not isinstance(c[key], bool):
            bad(key, "true or false")
    for key in _NUMBERS:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            bad(key, "a finite number")
    for keys, low in ((_POSITIVE_SIZES, 1), (_ZERO_SIZES, 0)):
        for key in keys:
            v = c.get(key)
            if key == "mamba_d_head" and v == "auto":
                continue
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not low <= v < SIZE_LIMIT):
                bad(key, f"an integer from {low} to {SIZE_LIMIT - 1}")
    v = c.get("max_position_embeddings")  # a context length, not a size: nothing is allocated from it
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 1 << 40):
        bad("max_position_embeddings", "a positive integer")
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise CheckpointError(f"{source}: {where}num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv})")
    experts, used = c.get("num_experts") or c.get("num_local_experts"), c.get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(used, int) and experts and used > experts:
        raise CheckpointError(f"{source}: {where}num_experts_per_tok ({used}) exceeds the {experts} experts")
    qc = c.get("quantization_config")
    if qc is not None:
        for key in ("bits", "w_bit", "group_size", "q_group_size"):
            v = qc.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < SIZE_LIMIT):
                raise CheckpointError(f"{source}: {where}quantization_config.{key} must be an integer, "
                                      f"not {_clip(v, as_json=True)}")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


# --- HF directories ---------------------------------------------------------------------------

def load_hf_dir(path: str, lazy: bool = False) -> Checkpoint:
    """lazy: the tensors are LazyTensor (read when and as far as indexed: a tensor-parallel rank
    reads only its slices)."""
    cfg_path = os.path.join(path, "config.json")
    if not regular_file(cfg_path, required=False):
        raise CheckpointError(f"{path}: no config.json (expected an HF checkpoint directory or a .gguf file)")
    config = check_config(_read_json(cfg_path), cfg_path)
    tensors, files = (_open_safetensors if lazy else _read_safetensors)(path)
    tok_path = os.path.join(path, "tokenizer.json")
    if not regular_file(tok_path, required=False):
        raise CheckpointError(f"{path}: no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises plain Exception subclasses with long messages
        raise CheckpointError(f"{tok_path}: not a valid tokenizer file ({str(e).splitlines()[0]})") from None
    tok_cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = _read_json(tok_cfg_path) if regular_file(tok_cfg_path, required=False) else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{tok_cfg_path}: chat_template must be a string, not {_clip(template, as_json=True)}")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if regular_file(jinja_path, required=False):
        template = read_text(jinja_path)
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if regular_file(gen_path, required=False) else {}
    eos_token = _token_text(tok_cfg.get("eos_token"))
    bos_token = _token_text(tok_cfg.get("bos_token"))
    for key, value in (("eos_token", eos_token), ("bos_token", bos_token)):
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{tok_cfg_path}: {key} must be a string, not {_clip(value, as_json=True)}")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else [] if eos is None else None
    if eos_ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise CheckpointError(f"{gen_path if 'eos_token_id' in gen else cfg_path}: eos_token_id must be a token id "
                              f"or a list of them, not {_clip(eos, as_json=True)}")
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        eos_ids.append(tokenizer.token_to_id(eos_token))
    files = [cfg_path, tok_path] + files
    sampling = hf_sampling(gen)
    return Checkpoint(config, tensors, tokenizer, template, bos_token, eos_token,
                      tuple(dict.fromkeys(eos_ids)), files, sampling=sampling,
                      sampling_source="generation_config.json" if sampling else "")


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if regular_file(index, required=False):
        weight_map = _read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must be an object of tensor name → file name")
        shards = sorted(set(weight_map.values()))
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
        if not regular_file(file, required=False):
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
# a nextn (MTP) block's own tensors; its decoder layer's are named as the model's layers'
_GGUF_MTP_NAMES = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                   "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head_norm.weight": "mtp.norm.weight"}
# what some converters add to a nextn block and the Qwen MTP shares with the model: not read
_GGUF_MTP_UNUSED = ("embed_tokens.", "shared_head_head.")
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




def _hf_name(name: str, model_type: str = "", n_layers: int | None = None) -> str:
    """The HF name of a GGUF tensor; a block at `n_layers` or past it (the nextn block a Qwen
    hybrid's index keeps) is the MTP layer's."""
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    if n_layers is not None and m and int(m.group(1)) >= n_layers:
        nextn = m.group(2).removeprefix("nextn.")
        if nextn in _GGUF_MTP_NAMES:
            return _GGUF_MTP_NAMES[nextn]
        return "mtp." + _hf_name(f"blk.0.{m.group(2)}", model_type).removeprefix("model.")
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
    from . import gguf_tensors
    if all(isinstance(x, gguf_tensors.GgufTensor) for x in (gate, up, down)):
        tensors[base[:-1]] = gguf_tensors.GgufExperts(gate, up, down)
        return
    gate, up, down = [x.dequantize() if isinstance(x, gguf_tensors.GgufTensor) else x for x in (gate, up, down)]
    tensors[base + "gate_up_proj"] = torch.cat([gate, up], dim=1)
    tensors[base + "down_proj"] = down


def _tiled_to_grouped(t, dim: int, nk: int, nv: int, head: int):
    """Undo the converter's reordering of linear-attention value heads (qwen35, qwen35moe): it
    stores them tiled ([v0 of every key head, v1 of every key head, ...]) for ggml's broadcast;
    HF groups them by key head. `t` is a torch tensor or a gguf_tensors.GgufTensor (rows only)."""
    r = nv // nk
    n = nv * head
    perm = torch.arange(n).reshape(r, nk, head).transpose(0, 1).reshape(n)  # grouped slot → tiled slot
    from . import gguf_tensors
    if isinstance(t, gguf_tensors.GgufTensor):
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
    from . import gguf_tensors
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_proj")]:
        base = name[: -len("gate_proj")]
        _join_experts(tensors, base, tensors.pop(name), tensors.pop(base + "up_proj"), tensors.pop(base + "down_proj"))
    if config["model_type"] not in _HYBRIDS:
        return
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    reorder = config["model_type"] != "qwen3_next" and nk != nv
    tiled_out = reorder and any(n.endswith("linear_attn.out_proj.weight") and isinstance(t, gguf_tensors.GgufTensor)
                                for n, t in tensors.items())
    if tiled_out:
        config["linear_out_proj_tiled"] = True
    for name in list(tensors):
        t = tensors[name]
        if ((name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_"))  # (the MTP's enorm, hnorm)
                and not name.endswith("linear_attn.norm.weight")):
            tensors[name] = t = t - 1.0
        elif name.endswith("A_log"):
            tensors[name] = t = torch.log(-t)
        if not reorder or ".linear_attn." not in name:
            continue
        if name.endswith("in_proj_qkv.weight"):
            split = 2 * nk * dk
            if isinstance(t, gguf_tensors.GgufTensor):  # whole rows move: the blocks are kept
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
    try:
        if len(f.types) == 1 and f.types[0].name == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        if f.types[0].name == "ARRAY":
            if f.types[-1].name == "STRING":
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return np.concatenate([f.parts[i] for i in f.data]).tolist() if f.data else []
    except UnicodeDecodeError:
        raise CheckpointError(f"GGUF key {_clip(key)} holds text that is not UTF-8") from None
    return f.parts[f.data[0]].tolist()[0]


# --- GGUF layout ------------------------------------------------------------------------------

# bytes of each GGUF metadata value type that has a fixed size (the others: 8 string, 9 array)
_GGUF_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_IMPLAUSIBLE = 1 << 50  # a length past this is damage, not a file cut short


class _GgufCursor:
    """Reads a GGUF header front to back, every read checked against the end of the file."""

    def __init__(self, path: str, buf, order: str, pos: int):
        self.path, self.buf, self.size, self.order, self.pos = path, buf, len(buf), order, pos

    def past_end(self, need: int, what: str) -> CheckpointError:
        if need >= _IMPLAUSIBLE:
            return CheckpointError(f"{self.path}: damaged GGUF header: {what}, from byte {self.pos}, "
                                   f"claims {need - self.pos} bytes")
        return CheckpointError(f"{self.path}: truncated at byte {self.size} of at least {need} "
                               f"({what}, from byte {self.pos}, runs past the end)")

    def skip(self, n: int, what: str) -> int:
        if self.pos + n > self.size:
            raise self.past_end(self.pos + n, what)
        self.pos += n
        return self.pos - n

    def uint(self, fmt: str, what: str) -> int:
        start = self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)[0]

    def text(self, what: str) -> str:
        n = self.uint("Q", what)
        start = self.skip(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: damaged GGUF header: {what}, at byte {start}, is not UTF-8") \
                from None

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _GGUF_VALUE_BYTES:
            self.skip(_GGUF_VALUE_BYTES[vtype], what)
        elif vtype == _GGUF_STRING:
            self.skip(self.uint("Q", what), what)
        elif vtype == _GGUF_ARRAY and depth < 2:
            itype, count = self.uint("I", what), self.uint("Q", what)
            if itype in _GGUF_VALUE_BYTES:
                self.skip(count * _GGUF_VALUE_BYTES[itype], what)
                return
            # each string or nested array takes at least 8 bytes: a count the file cannot hold
            # fails here, not after a loop over it
            if self.pos + 8 * count > self.size:
                raise self.past_end(self.pos + 8 * count, what)
            for _ in range(count):
                self.value(itype, what, depth + 1)
        else:
            raise CheckpointError(f"{self.path}: damaged GGUF header: {what} has the unknown value type {vtype}")


def check_gguf_layout(path: str) -> None:
    """Walk a GGUF file's header with every read bounds-checked, and check that the tensor data it
    describes lies inside the file. gguf's reader, given a truncated file, indexes past its end
    (IndexError, reshape errors) and, given a garbled array count, loops without end; this names
    the byte where the file ends and the size its header implies."""
    import mmap

    from gguf.constants import GGML_QUANT_SIZES

    regular_file(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:  # magic, version and the two counts
            raise CheckpointError(f"{path}: truncated at byte {size} of at least 24 (the GGUF header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
            order = "<"
            version = struct.unpack_from("<I", buf, 4)[0]
            if version & 0xFFFF == 0:  # written on a big-endian machine
                order, version = ">", struct.unpack_from(">I", buf, 4)[0]
            if version not in (2, 3):
                raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            r = _GgufCursor(path, buf, order, 8)
            n_tensors, n_kv = r.uint("Q", "the tensor count"), r.uint("Q", "the key count")
            if 13 * n_kv + 32 * n_tensors > size:  # the fewest bytes a key and a tensor's info take
                raise r.past_end(r.pos + 13 * n_kv + 32 * n_tensors, f"the metadata of {n_kv} keys and {n_tensors} "
                                 "tensors")
            alignment = 32
            for i in range(n_kv):
                key = r.text(f"metadata key {i}'s name")
                what = f"key {_clip(key)}"
                vtype = r.uint("I", what)
                if key == "general.alignment" and vtype == _GGUF_UINT32:
                    alignment = struct.unpack_from(order + "I", buf, r.pos)[0] if r.pos + 4 <= size else 32
                    if alignment == 0 or alignment & (alignment - 1):
                        raise CheckpointError(f"{path}: damaged GGUF header: general.alignment {alignment} "
                                              "is not a power of two")
                r.value(vtype, what)
            ends = []
            for i in range(n_tensors):
                name = r.text(f"tensor {i}'s name")
                what = f"the info of tensor {_clip(name)}"
                n_dims = r.uint("I", what)
                if not 1 <= n_dims <= 4:
                    raise CheckpointError(f"{path}: damaged GGUF header: tensor {_clip(name)} has {n_dims} dims")
                dims = [r.uint("Q", what) for _ in range(n_dims)]
                ttype, offset = r.uint("I", what), r.uint("Q", what)
                if ttype not in GGML_QUANT_SIZES:
                    raise CheckpointError(f"{path}: tensor {_clip(name)} has the unknown GGML type {ttype}")
                block, type_bytes = GGML_QUANT_SIZES[ttype]
                if dims[0] % block or offset % alignment:
                    raise CheckpointError(f"{path}: damaged GGUF header: tensor {_clip(name)} of shape {dims} "
                                          f"at data offset {offset} (type {ttype}: {block}-weight blocks, "
                                          f"alignment {alignment})")
                ends.append((offset + math.prod(dims) // block * type_bytes, name))
            start = -(-r.pos // alignment) * alignment
            end, _ = max(ends, default=(0, ""))
            if ends and start + end > size:  # (a vocabulary-only file ends with its header, unpadded)
                first = min(e for e in ends if start + e[0] > size)[1]
                if start + end >= _IMPLAUSIBLE:
                    raise CheckpointError(f"{path}: damaged GGUF header: the data of tensor {_clip(first)} would "
                                          f"end at byte {start + end}")
                raise CheckpointError(f"{path}: truncated at byte {size} of {start + end} "
                                      f"(the data of tensor {_clip(first)} runs past the end)")


def load_gguf(path: str, keep_quantized: bool = False) -> Checkpoint:
    """A GGUF file → Checkpoint. Parsing the metadata (gguf's reader: seconds for a large vocab)
    is done once per file version and cached as an index; tensors are read through a memmap.
    keep_quantized: matrices of the types `gguf_tensors.keeps` names come back as `gguf_tensors.GgufTensor`, a
    view of the file's mapped pages (copy-on-write, never written: no copy is made; llama's Q/K
    rows, which must be reordered, are the exception); everything else is dequantized to fp32,
    and a note names the types that could have been kept but for their type."""
    from gguf.quants import dequantize

    from . import gguf_blocks, gguf_tensors

    index = _cached_index(path)
    if index is None:
        index = _read_gguf_index(path)
        _store_index(path, index)
    check_config(index["config"], path)  # here, not in the index: a cached index is checked too
    tensors = {}
    widened: dict[str, int] = {}
    try:
        # mode "c": a private mapping, so torch.from_numpy gets a writable array over the file's pages
        data = np.memmap(path, dtype=np.uint8, mode="c")
        for name, ttype, shape, dtype, offset in index["tensors"]:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if offset + n > data.shape[0]:  # (check_gguf_layout found it whole when the index was made)
                raise CheckpointError(f"{path}: truncated at byte {data.shape[0]} of {offset + n} "
                                      f"(tensor {name!r}'s data runs past the end)")
            raw = data[offset:offset + n].view(dtype).reshape(shape)
            unpermute = None
            model_type, n_layers = index["config"]["model_type"], index["config"]["num_hidden_layers"]
            if (model_type in _GGUF_PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight"))
                    and int(name.split(".")[1]) not in index["config"].get("qk_rows_as_hf", ())):
                heads = index["config"]["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
                unpermute = lambda a, h=heads: np.ascontiguousarray(unpermute_qk(a, h))  # noqa: E731
            if keep_quantized and gguf_tensors.keeps(ttype) and len(shape) in (2, 3):  # 3D: MoE experts
                qt = gguf_tensors.GgufTensor(ttype, raw)
                tensors[_hf_name(name, model_type, n_layers)] = qt if unpermute is None else qt.permute_rows(unpermute)
                continue
            if keep_quantized and len(shape) in (2, 3) and ttype not in (0, 1, 30):  # F32, F16, BF16
                kind = gguf_type(ttype).name
                widened[kind] = widened.get(kind, 0) + 1
            if raw.dtype == np.uint8 and gguf_blocks.dequantizes(ttype):
                # (torch's form: gguf-py's values bit for bit, and faster: tests/formats/test_gguf_blocks.py)
                w = gguf_blocks.dequantize(torch.from_numpy(raw), ttype).numpy()
            else:
                w = np.array(dequantize(raw, gguf_type(ttype)), dtype=np.float32)  # owned, writable
            if unpermute is not None:
                w = unpermute(w)
            tensors[_hf_name(name, model_type, n_layers)] = torch.from_numpy(np.ascontiguousarray(w))
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
             f"{', '.join(gguf_type(t).name for t in gguf_tensors.kept_types())})"
             for kind, count in sorted(widened.items())]
    tokenizer = Tokenizer.from_str(index["tokenizer"])
    sampling = index.get("sampling") if isinstance(index.get("sampling"), dict) else {}
    return Checkpoint(config, tensors, tokenizer, index["chat_template"], index["bos_token"],
                      index["eos_token"], tuple(index["eos_ids"]), [path], notes, sampling=sampling,
                      sampling_source="GGUF general.sampling keys" if sampling else "")


def gguf_type(value: int):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(value)


def _read_gguf_index(path: str) -> dict:
    import gguf

    check_gguf_layout(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on damage
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})".splitlines()[0]) from None
    try:
        return _gguf_index(path, reader)
    except CheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError) as e:  # a value of the wrong type
        detail = (str(e).splitlines() or [""])[0][:80]
        raise CheckpointError(f"{path}: bad GGUF metadata ({type(e).__name__}: {detail})") from None


def _gguf_index(path: str, reader) -> dict:
    from .gguf_tokenizer import TokenizerError, build

    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in _GGUF_ARCHS:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(_GGUF_ARCHS)})")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    for key in ("block_count", "attention.head_count", "embedding_length"):  # the sizes computed with below
        v = a(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < SIZE_LIMIT):
            raise CheckpointError(f"{path}: GGUF key {arch}.{key} must be an integer from 1 to {SIZE_LIMIT - 1}, "
                                  f"not {_clip(v)}")
    held = max((int(m.group(1)) + 1 for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))),
               default=0)
    # refused before any loop over the blocks (a vocabulary-only file has the metadata, no tensors)
    blocks = a("block_count")
    if reader.tensors and blocks is not None and blocks > held:
        raise CheckpointError(f"{path}: {arch}.block_count is {blocks}, the file's tensors hold {held} blocks")
    # multi-token-prediction blocks (llama.cpp's nextn layers) come after the model's own: the
    # first is the Qwen hybrids' MTP layer (`mtp.*`: models/architectures/mtp.py), the rest skipped
    n_layers = a("block_count") - a("nextn_predict_layers", 0)
    mtp = (_GGUF_ARCHS[arch] in _HYBRIDS and n_layers < held
           and f"blk.{n_layers}.nextn.eh_proj.weight" in {t.name for t in reader.tensors})
    own = [t for t in reader.tensors
           if not ((m := re.match(r"blk\.(\d+)\.", t.name)) and int(m.group(1)) >= n_layers + mtp)
           and not (mtp and t.name.startswith(tuple(f"blk.{n_layers}.nextn.{x}" for x in _GGUF_MTP_UNUSED)))]
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
    if mtp:
        config["mtp_num_hidden_layers"] = 1
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
        _hf_name(t.name, config["model_type"], n_layers)  # unknown tensor names fail now, not after caching
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    for key, i in (("bos", bos), ("eos", eos), ("eot", eot)):
        if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
            raise CheckpointError(f"{path}: tokenizer.ggml.{key}_token_id must be a token id, not {_clip(i)}")
    # an id past the vocabulary is no special token: llama.cpp warns and keeps its default
    bos, eos, eot = [i if i is not None and 0 <= i < len(tokens) else None for i in (bos, eos, eot)]
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: tokenizer.chat_template must be a string, not {_clip(template)}")
    eos_ids = [i for i in (eos, eot) if i is not None]
    # llama.cpp also ends generation on its end-of-turn control tokens (and the FIM repo-name token)
    eos_ids += [i for i, tt in enumerate(types) if tt == 3 and tokens[i] in END_OF_TURN_TEXTS]
    return {
        "config": config, "tokenizer": tokenizer.to_str(), "chat_template": template,
        "bos_token": tokens[bos] if bos is not None else None, "eos_token": tokens[eos] if eos is not None else None,
        "eos_ids": list(dict.fromkeys(eos_ids)),
        "sampling": {ours: float(f"{value:.7g}") if isinstance(value, float) else value  # (stored as float32)
                     for theirs, ours in GGUF_SAMPLING.items()
                     if (value := _field(reader, f"general.sampling.{theirs}")) is not None},
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


INDEX_VERSION = 6
# Where a GGUF's index is cached: models.configure sets it from the engine's Environment
# ($XDG_CACHE_HOME/chat/gguf-index: engine/config.py)
INDEX_DIR = os.path.join(os.path.expanduser("~"), ".cache", "chat", "gguf-index")


def _index_path(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    import hashlib
    key = f"{INDEX_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return os.path.join(INDEX_DIR, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


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
