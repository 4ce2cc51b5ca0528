"""The benchmark shapes of PERFORMANCE.md as HF-style configs, built with random weights.

Speed does not depend on weight values; random normal weights (std 0.02, norms at their neutral
value) keep activations finite so every kernel does real work.
"""
from __future__ import annotations

import torch

import models

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True,
                         max_position_embeddings=262144),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False,
                        max_position_embeddings=262144),
    # transformers' Qwen3_5MoeTextConfig defaults: 3 Gated DeltaNet : 1 attention, 256 experts, top 8
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, vocab_size=248320, tie_word_embeddings=False,
                            max_position_embeddings=262144),
    # as hf_baseline.py's qwen3-30b-a3b: Qwen3's attention, 128 experts, top 8, no shared expert
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6),
}


@torch.no_grad()
def random_model(name: str, device, dtype, seed: int = 0):
    model, _ = models.build_model(dict(SHAPES[name]))
    # one device tensor per weight, assigned as models.materialize assigns a checkpoint's (Module.to_empty
    # took 2.1 s for the 0.8B-like model's 321 weights on an H200 host, this 0.01 s)
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[leaf] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.fill_(0.0 if getattr(model.config, "layer_types", None) and not pname.endswith("linear_attn.norm.weight")
                    else 1.0)
        elif pname.endswith("A_log"):
            p.uniform_(0.0, 2.0, generator=gen)
        elif pname.endswith("dt_bias"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    models.fuse(model)
    return model.eval()
