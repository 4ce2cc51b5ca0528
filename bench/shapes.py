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
    # transformers' Qwen3NextConfig defaults (160 GB in bf16: two H200s)
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                               vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=262144),
    # LiquidAI LFM2-1.2B's published config (16 layers, attention at 2, 5, 8, 10, 12, 14; the MLP
    # is 2/3 of block_ff_dim 12288 = 8192); ../shared/bench/hf_baseline.py builds the same
    "lfm2-1.2b": dict(model_type="lfm2", hidden_size=2048, intermediate_size=12288, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14],
                      vocab_size=65536, tie_word_embeddings=True, norm_eps=1e-5, conv_L_cache=3,
                      block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                      rope_theta=1000000.0, max_position_embeddings=128000),
    # Granite-4.0-H-Tiny's published sizes (as shared/bench/hf_baseline.py builds it): 40 layers, attention
    # at 5, 15, 25, 35 (no positional encoding), Mamba2 elsewhere (48 heads of 64, state 128, one
    # group), 64 routed experts of 512 (top 6) and a shared SwiGLU of 1024 in every layer; the muP
    # multipliers are left at 1 (speed does not depend on them)
    "granite-4.0-h-tiny": dict(model_type="granitemoehybrid", hidden_size=1536, num_hidden_layers=40,
                               num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
                               layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
                               num_local_experts=64, num_experts_per_tok=6, shared_intermediate_size=1024,
                               mamba_n_heads=48, mamba_n_groups=1, mamba_d_state=128, mamba_d_head=64,
                               mamba_d_conv=4, mamba_expand=2, vocab_size=100352, tie_word_embeddings=True,
                               rms_norm_eps=1e-5, max_position_embeddings=131072),
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
def random_model(name: str, device, dtype, seed: int = 0, shard=None):
    """shard (models.sharding.Shard): that rank's slices of the shape, with its collectives."""
    if shard is None:
        model, _ = models.build_model(dict(SHAPES[name]))
    else:
        full, _, plan = models.config_plan(dict(SHAPES[name]), shard.world)
        model = models.local_model(full, plan, shard)
        seed += shard.rank
    # one device tensor per weight, assigned as models.materialize assigns a checkpoint's (Module.to_empty
    # took 2.1 s for the 0.8B-like model's 321 weights on an H200 host, this 0.01 s)
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[leaf] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    # norms at their neutral value: 0 where the weight is zero-centred (applied as 1 + w), else 1
    centred = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "offset", 0.0) != 0.0}
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.fill_(0.0 if pname in centred else 1.0)
        elif pname.endswith("A_log"):
            p.uniform_(0.0, 2.0, generator=gen)
        elif pname.endswith("dt_bias"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if model.config.tie_embeddings and shard is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    models.fuse(model)
    if shard is not None:
        from models.sharding import install_collectives
        install_collectives(model, plan, shard)
    return model.eval()
