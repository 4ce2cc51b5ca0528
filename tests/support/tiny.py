"""Tiny random HF checkpoints written by the tests, with transformers as the reference.

`write_checkpoint(kind, path)` saves a transformers model of a tiny config (safetensors), a small
byte-level BPE tokenizer.json with ChatML control tokens, a tokenizer_config.json with a chat
template, and a generation_config.json, i.e. everything our HF-directory loader reads.
"""
from __future__ import annotations

import json
import os

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: specials 0-2, the 256 byte symbols, then a few merges (< VOCAB ids)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("Ġ", "a"), ("e", "r"), ("o", "n")]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() <= VOCAB
    return tok


def hf_config(kind: str, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
    elif kind == "qwen3_5":
        common["num_hidden_layers"] = 4
        cfg = tf.Qwen3_5TextConfig(**common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=True,
                                   layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"])
    elif kind == "qwen3_next":
        common["num_hidden_layers"] = 4
        cfg = tf.Qwen3NextConfig(**common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
                                 layer_types=["linear_attention", "linear_attention", "full_attention",
                                              "linear_attention"])
    elif kind == "lfm2":
        common["num_hidden_layers"] = 4
        common["intermediate_size"] = 192  # the MLP is 2/3 of it, rounded up to block_multiple_of
        common["norm_eps"] = common.pop("rms_norm_eps")
        # initializer_range: the default 0.02 gives logits of ~0.1, too flat for a 1e-4 parity to mean much
        cfg = tf.Lfm2Config(**common, conv_L_cache=3, conv_bias=True, block_multiple_of=32, initializer_range=0.15,
                            layer_types=["conv", "full_attention", "conv", "conv"], tie_word_embeddings=True)
    elif kind == "olmo_hybrid":
        common["num_hidden_layers"] = 4
        cfg = tf.OlmoHybridConfig(**common, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=16, tie_word_embeddings=False, initializer_range=0.1,
                                  layer_types=["linear_attention", "linear_attention", "full_attention",
                                               "linear_attention"])
    elif kind == "nemotron_h":
        cfg = tf.NemotronHConfig(**{k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
                                 head_dim=16, layer_norm_epsilon=1e-5, mamba_num_heads=8, mamba_head_dim=16,
                                 ssm_state_size=16, n_groups=2, chunk_size=32, tie_word_embeddings=False,
                                 initializer_range=0.1,
                                 layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"])
    elif kind == "granitemoehybrid":
        common["num_hidden_layers"] = 4
        cfg = tf.GraniteMoeHybridConfig(**{**common, "intermediate_size": 32}, shared_intermediate_size=48,
                                        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                                        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=32,
                                        embedding_multiplier=3.0, logits_scaling=2.5, residual_multiplier=0.5,
                                        attention_multiplier=0.2, position_embedding_type="rope",
                                        tie_word_embeddings=True, initializer_range=0.1,
                                        layer_types=["mamba", "attention", "mamba", "mamba"])
    elif kind == "granitemoehybrid_e5":  # the shared MLP beside five routed experts; 6 query heads over 2 KV heads
        common.update(num_hidden_layers=4, hidden_size=96, num_attention_heads=6, intermediate_size=32)
        cfg = tf.GraniteMoeHybridConfig(**common, shared_intermediate_size=48, num_local_experts=5,
                                        num_experts_per_tok=2, mamba_n_heads=12, mamba_d_head=16, mamba_d_state=16,
                                        mamba_n_groups=2, mamba_chunk_size=32, embedding_multiplier=3.0,
                                        logits_scaling=2.5, residual_multiplier=0.5, attention_multiplier=0.2,
                                        position_embedding_type="nope", tie_word_embeddings=True,
                                        initializer_range=0.1, layer_types=["mamba", "attention", "mamba", "mamba"])
    elif kind == "qwen3_5_moe":  # every layer routes; no dense MLP size
        common["num_hidden_layers"] = 4
        del common["intermediate_size"]
        cfg = tf.Qwen3_5MoeTextConfig(**common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
                                      num_experts_per_tok=3, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, tie_word_embeddings=False,
                                      layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"])
    elif kind == "qwen3_moe":  # layer 1 keeps a dense MLP; top-k weights not renormalised (the default)
        cfg = tf.Qwen3MoeConfig(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
                                num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)
        cfg.num_hidden_layers = 3
    else:
        raise ValueError(kind)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def hf_model(kind: str, seed: int = 0, **over):
    import transformers as tf

    cfg = hf_config(kind, **over)
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "qwen3_5": tf.Qwen3_5ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
           "lfm2": tf.Lfm2ForCausalLM, "olmo_hybrid": tf.OlmoHybridForCausalLM,
           "nemotron_h": tf.NemotronHForCausalLM, "granitemoehybrid": tf.GraniteMoeHybridForCausalLM,
           "granitemoehybrid_e5": tf.GraniteMoeHybridForCausalLM,
           "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[kind]
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases/norms too, so a missed bias or norm shows up in parity
        for name, p in model.named_parameters():
            if name.endswith(("bias", "dt_bias")) or "norm" in name or name.endswith("A_log"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2 and p.std() == 0:  # e.g. zero-initialised routers
                p.normal_(0, 0.5)
            if name.endswith("mixer.dt_bias") or name.endswith("mamba.dt_bias"):
                # Mamba2 steps of order 1 (the released init gives 0.001-0.1: a state that barely
                # moves in a tiny test), so a wrong decay or state update shows in the logits
                p.uniform_(-1.0, 1.0)
            elif name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.5)
    return model


def as_released(path: str, kind: str) -> None:
    """config.json as the released Granite 4.0-H checkpoints write it (transformers 5 saves its own
    layer-type names, which llama.cpp's converter does not read): "mamba" / "attention"."""
    p = os.path.join(path, "config.json")
    with open(p) as f:
        c = json.load(f)
    if kind.startswith("granitemoehybrid"):
        c["layer_types"] = ["mamba" if t in ("mamba", "linear_attention") else "attention" for t in c["layer_types"]]
    with open(p, "w") as f:
        json.dump(c, f)


def write_checkpoint(kind: str, path: str, seed: int = 0, model=None, **over) -> str:
    model = model if model is not None else hf_model(kind, seed, **over)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2]}, f)
    return path


def add_mtp(path: str, seed: int = 7) -> str:
    """A multi-token-prediction layer for the tiny Qwen3.5 checkpoint at `path`, as the released
    Qwen3.5 checkpoints hold one: `mtp.*` tensors in their own shard (model-mtp.safetensors, which
    llama.cpp's converter reads too) shaped as the model's full-attention layer, random, and
    `mtp_num_hidden_layers: 1` in config.json."""
    from safetensors.torch import load_file, save_file

    weights = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors") and f != "model-mtp.safetensors":
            weights.update(load_file(os.path.join(path, f)))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    full = text["layer_types"].index("full_attention")
    prefix = next(n for n in weights if f"layers.{full}." in n).split(f"layers.{full}.")[0]
    g = torch.Generator().manual_seed(seed)
    mtp = {}
    for name, t in weights.items():
        if name.startswith(f"{prefix}layers.{full}."):
            mtp["mtp.layers.0." + name[len(f"{prefix}layers.{full}."):]] = t.clone()
    hidden = text["hidden_size"]
    mtp["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = torch.zeros(hidden)
    for name, t in mtp.items():  # new values throughout (norms near their zero centre)
        scale = 0.1 if "norm" in name else (t.float().std().item() or 0.05)
        mtp[name] = (torch.randn(t.shape, generator=g) * scale).to(t.dtype).contiguous()
    save_file(mtp, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path
