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


def _random_parameters(model, device, dtype, gen) -> None:
    """Every parameter still on the meta device (or left unquantized) becomes one device tensor,
    assigned as models.materialize assigns a checkpoint's (Module.to_empty took 2.1 s for the
    0.8B-like model's 321 weights on an H200 host, this 0.01 s), filled: norms at their neutral
    value (0 where the weight is zero-centred, applied as 1 + w, else 1), A_log uniform in [0, 2),
    dt_bias 1, the rest normal with std 0.02."""
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[leaf] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
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


@torch.no_grad()
def random_model(name: str, device, dtype, seed: int = 0, shard=None):
    """shard (models.sharding.Shard): that rank's slices of the shape, with its collectives."""
    if shard is None:
        model, _ = models.build_model(dict(SHAPES[name]))
    else:
        full, _, plan = models.config_plan(dict(SHAPES[name]), shard.world)
        model = models.local_model(full, plan, shard)
        seed += shard.rank
    _random_parameters(model, device, dtype, torch.Generator(device=device).manual_seed(seed))
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


# Random quantized weights, built on the device as the loader would hold them (no files): fp16
# block scales set so the weights' spread is about the bf16 models' (std ~0.02).
_GGUF_SCALES = {"Q4_K": {0: 1.5e-4, 2: 1.1e-3}, "Q5_K": {0: 7.5e-5, 2: 1.1e-3}, "Q6_K": {208: 1.5e-5},
                "Q5_0": {0: 2e-3}, "Q5_1": {0: 2e-3, 2: -3.2e-2}, "Q8_0": {0: 2e-4}}
# llama.cpp's types for rows that are not whole 256-weight super-blocks, in its K-quant mixes
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _random_blocks(kind: str, n: int, k: int, device, gen) -> torch.Tensor:
    from models.formats import gguf_blocks
    layout = gguf_blocks.LAYOUTS[gguf_blocks.TYPES[kind]]
    raw = torch.randint(0, 256, (n, k // layout.block, layout.bytes), dtype=torch.uint8, device=device, generator=gen)
    for at, value in _GGUF_SCALES[kind].items():
        raw[..., at:at + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)
    return raw.reshape(n, -1)


def random_quant_linear(fmt: str, n: int, k: int, device, gen) -> torch.nn.Module:
    """A linear of `fmt` ("Q4_K" / "Q5_K": Q5_0 / Q5_1 where K is not whole 256-weight blocks, as
    llama.cpp's Q4_K_M / Q5_K_M fall back; "Q6_K"; "AWQ": 4-bit groups of 128; "FP8": e4m3,
    128 x 128 block scales)."""
    from models.formats import gguf_blocks
    from models.quant import hf_layers
    from models.quant import layers as quant
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):  # (llama.cpp's fallbacks for rows not whole super-blocks)
        kind = fmt if k % 256 == 0 else _FALLBACK[fmt]
        return quant.BlockLinear(_random_blocks(kind, n, k, device, gen), gguf_blocks.TYPES[kind])
    if fmt == "AWQ":
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        scales = torch.full((n, k // 128), 5e-3, dtype=torch.float16, device=device)
        zeros = torch.full((n, k // 128), 8, dtype=torch.uint8, device=device)
        return hf_layers.GroupInt4Linear("AWQ", packed, scales, zeros, 128)
    if fmt == "FP8":
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
        for i in range(0, n, 8192):  # (a bf16 draw of at most 8192 rows at a time)
            w[i:i + 8192] = torch.randn(min(8192, n - i), k, device=device, dtype=torch.bfloat16, generator=gen) * 2
        return hf_layers.Fp8Linear(w, torch.full((-(-n // 128), k // 128), 1e-2, device=device))
    raise ValueError(f"unknown random format {fmt!r}")


@torch.no_grad()
def _k_experts(model, fmt: str, device, gen) -> None:
    """In place: each moe.Experts as the loader leaves a Q4_K (Q5_K) GGUF's experts on CUDA
    (quant.PlanarExperts, both halves Q4KP (Q5KP)), from random `fmt` blocks; experts whose sizes
    are not whole super-blocks stay dense (random_model's weights)."""
    from models.architectures.moe import Experts
    from models.formats import gguf_blocks
    from models.quant import layers as quant
    repack = quant.BlockLinear.repack_for(gguf_blocks.TYPES[fmt], runs=False)[0]  # the planar layouts
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, Experts):
                continue
            e, i2, h = child.gate_up_proj.shape
            if h % 256 or (i2 // 2) % 256:
                continue
            ex = quant.PlanarExperts(e, h, i2 // 2)
            for half, (n, k) in (("gate_up", (i2, h)), ("down", (h, i2 // 2))):
                ex.keep_planar(half, repack(quant.QWeight(fmt, _random_blocks(fmt, e * n, k, device, gen), e * n, k)), fmt)
            setattr(module, child_name, ex)


def random_quantized_model(name: str, fmt: str, device, dtype, seed: int = 0):
    """The shape with every linear in `fmt` (see random_quant_linear), the rest as random_model.
    Q4_K, as a Q4_K_M file: the LM head in Q6_K and the embedding table in Q4_K blocks, routed
    experts as PlanarExperts (Q4KP, as the loader repacks a Q4_K GGUF's on CUDA); Q5_K likewise,
    as a Q5_K_M file (routed experts Q5KP); AWQ and FP8, as their checkpoints: embedding and LM
    head in `dtype`."""
    from models.formats import gguf_blocks
    from models.quant import layers as quant
    model, _ = models.build_model(dict(SHAPES[name]))
    gen = torch.Generator(device=device).manual_seed(seed)
    gguf = fmt in ("Q4_K", "Q5_K")
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            fits = gguf or getattr(child, "in_features", 0) % 128 == 0  # (AWQ / FP8: groups of 128 along K)
            if isinstance(child, torch.nn.Linear) and (child_name != "lm_head" or gguf) and fits:
                head = child_name == "lm_head"
                q = random_quant_linear("Q6_K" if head else fmt, child.out_features, child.in_features, device, gen)
                setattr(module, child_name, q)
    if gguf:
        _k_experts(model, fmt, device, gen)
        n, k = model.model.embed_tokens.weight.shape
        kind = fmt if k % 256 == 0 else _FALLBACK[fmt]
        emb = quant.BlockEmbedding(_random_blocks(kind, n, k, device, gen), ggml_type=gguf_blocks.TYPES[kind])
        emb.out_dtype = dtype
        model.model.embed_tokens = emb
        if model.config.tie_embeddings:
            model.lm_head = emb.as_linear()
    _random_parameters(model, device, dtype, gen)
    if model.config.tie_embeddings and not gguf:
        model.lm_head.weight = model.model.embed_tokens.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    models.fuse(model)
    return model.eval()
