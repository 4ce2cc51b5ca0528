"""Tiny GGUF files written from a tiny transformers model, the way llama.cpp's converter lays them out.

`write_gguf(kind, path, model, linear_type)`: metadata for our loader (architecture, sizes, the
tiny byte-level tokenizer, a ChatML template), 2-D weights quantized to `linear_type` (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0 or F32), the token embedding (and an untied output) in Q8_0, norms and
biases in F32, and Llama's Q/K rows permuted as the converter permutes them. `types` overrides the
type per tensor (GGUF name suffix → type), as llama.cpp's Q4_K_M mix does.

gguf-py cannot quantize the K-quants (Q4_K, Q5_K, Q6_K): their tensors are random blocks with
fp16 scales set so the weights have the model's scale (the file, not the HF model, is then the
reference: tests compare our quantized path with our dequantized path on the same file).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from tests.support.tiny import CHATML, SPECIALS, tiny_tokenizer

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (the inverse of checkpoints.unpermute_qk)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{i}.{_LAYER[module]}.{leaf}"


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def random_k_blocks(qtype: Q, rows: int, cols: int, std: float, seed: int) -> np.ndarray:
    """Random K-quant blocks [rows, row bytes] whose weights spread about ±2-3 std."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)

    def f16(values):
        return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(rows, cols // 256, 2)
    shape = (rows, cols // 256)
    if qtype == Q.Q6_K:  # w = d * sc * (q - 32), sc int8 (random), q - 32 in [-32, 31]
        raw[:, :, 208:210] = f16(rng.uniform(0.5, 1.5, shape) * 3 * std / (32 * 128))
    else:  # w = d * sc * q - dmin * m, sc and m 6-bit, q 4 or 5 bits
        top = 15 if qtype == Q.Q4_K else 31
        raw[:, :, 0:2] = f16(rng.uniform(0.5, 1.5, shape) * 6 * std / (63 * top))
        raw[:, :, 2:4] = f16(rng.uniform(0.5, 1.5, shape) * 3 * std / 63)
    return raw.reshape(rows, -1)


def write_gguf(kind: str, path: str, model, linear_type: Q, types: dict[str, Q] | None = None,
               embed_type: Q = Q.Q8_0, metadata: dict | None = None) -> str:
    """`metadata`: more keys ("general.sampling.temp": 0.6, ...), float32 or int32 as their values."""
    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[kind]
    w = GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_int32)(key, value)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    tok = tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in _merges(tok)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i, (name, t) in enumerate(state.items()):
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = permute_qk(t, heads)
        qtype = Q.F32
        if t.ndim == 2:
            qtype = embed_type if name in ("model.embed_tokens.weight", "lm_head.weight") else linear_type
            qtype = next((q for suffix, q in (types or {}).items() if gguf_name(name).endswith(suffix)), qtype)
        data = np.ascontiguousarray(t, dtype=np.float32)
        if qtype == Q.F32:
            w.add_tensor(gguf_name(name), data)
        elif qtype in K_QUANTS:
            raw = random_k_blocks(qtype, data.shape[0], data.shape[1], float(data.std()), seed=i)
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _merges(tok) -> list[tuple[str, str]]:
    import json
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def requantize(src: str, dst: str, types: dict[str, Q], flat: tuple[str, ...] = ()) -> str:
    """A copy of the GGUF file `src` (metadata and tensors) with the F32 tensors whose names end
    with a key of `types` quantized to its type (gguf-py's quantizers: Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0), e.g. a converter's F32 output with its experts in 4 bits. The tensors whose names end
    with one of `flat` lose their outer dims of 1, as llama.cpp's quantizer writes them."""
    from gguf import GGUFReader, GGUFValueType
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name.endswith(flat):
            while data.ndim > 1 and data.shape[0] == 1:
                data = data[0]
        qtype = next((q for suffix, q in types.items() if t.name.endswith(suffix)), None)
        if qtype is not None and t.tensor_type == Q.F32:
            w.add_tensor(t.name, quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def mapped_spans(path: str) -> list[tuple[int, int]]:
    """The address ranges where this process maps the file `path` (/proc/self/maps): a tensor
    whose data lies inside one is a view of the file's pages, not a copy."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    return spans
