"""LFM2: the short convolution's prefill and one-step forms, and the loader's config handling.

HF parity, splits and repeated generations are in test_hybrid.py (KINDS), state resets in
test_state_reset.py, checkpoints in test_checkpoints.py; the llama.cpp conversion in test_gguf_lfm2.py.
"""
import pytest
import torch

from models.architectures import lfm2


@pytest.mark.parametrize("T", [1, 2, 3, 5, 63, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_prefill_equals_steps_from_nonzero_state(T, bias):
    g = torch.Generator().manual_seed(T)
    C, K = 7, 3
    x = torch.randn(T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    s0 = torch.randn(C, K - 1, generator=g)
    s_pre, s_step = s0.clone(), s0.clone()
    out_pre = lfm2.conv_prefill(x, s_pre, w, b)
    out_step = torch.cat([lfm2.conv_step(x[t:t + 1], s_step, w, b) for t in range(T)])
    # the oracle: a zero-padded causal conv over the whole stream, state prepended
    full = torch.cat([s0.t(), x])
    ref = torch.stack([(full[t:t + K].t() * w).sum(-1) + (0 if b is None else b) for t in range(T)])
    assert (out_pre - ref).abs().max() <= 1e-5 and (out_step - ref).abs().max() <= 1e-5
    assert torch.equal(s_pre, full[-(K - 1):].t()) and torch.equal(s_step, s_pre)


def test_ffn_size_follows_hf():
    import transformers as tf
    for over in [dict(intermediate_size=12288), dict(intermediate_size=1000, block_ffn_dim_multiplier=1.3),
                 dict(intermediate_size=1000, block_auto_adjust_ff_dim=False)]:
        cfg = tf.Lfm2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **over)
        hf = tf.models.lfm2.modeling_lfm2.Lfm2MLP(cfg)
        assert lfm2.Lfm2Config.from_hf(cfg.to_dict()).intermediate_size == hf.w1.out_features


def test_published_config_keys():
    """LFM2-1.2B's config.json names: block_ff_dim, full_attn_idxs, rope_theta at the top level."""
    c = dict(vocab_size=65536, hidden_size=2048, block_ff_dim=12288, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14], rope_theta=1000000.0, norm_eps=1e-5,
             conv_L_cache=3, conv_bias=False, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
             block_auto_adjust_ff_dim=True, max_position_embeddings=128000, tie_embedding=True)
    cfg = lfm2.Lfm2Config.from_hf(c)
    assert cfg.intermediate_size == 8192 and cfg.layer_types.count("full_attention") == 6
    assert cfg.layer_types[2] == "full_attention" and cfg.layer_types[3] == "conv" and cfg.tie_embeddings


def test_bad_layer_types_name_the_problem():
    c = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
             layer_types=["conv", "mamba"])
    with pytest.raises(ValueError, match="layer_types"):
        lfm2.Lfm2Config.from_hf(c)
