"""OLMo-Hybrid's variants as config data: NoPE attention (no rope_theta) and beta = sigmoid(b)
(linear_allow_neg_eigval off), each against transformers. transformers 5 saves the published
layout (per-part q/k/v convs, attention_layer_norm), so every test loads that layout.

The default variant's parity, splits, resets and checkpoints are in test_hybrid.py (KINDS),
test_state_reset.py and test_checkpoints.py.
"""
import pytest
import torch

import models
from engine.session import DecodeSession


def parity(hf, path, n=70):
    ids = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    s = DecodeSession(models.load(path).model, max_context=256, device=torch.device("cpu"), dtype=torch.float32)
    ours = s.prefill(ids, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ids.append(int(ours[-1].argmax()))
    step = s.step(ids[-1])[-1]
    with torch.no_grad():
        ref_step = hf(torch.tensor([ids])).logits[0, -1]
    return max(float((ours - ref).abs().max()), float((step - ref_step).abs().max()))


@pytest.mark.parametrize("over", [dict(rope_parameters={"rope_type": "default"}),
                                  dict(linear_allow_neg_eigval=False)], ids=["nope", "beta-sigmoid"])
def test_variant_matches_transformers(tmp_path, over):
    from tiny import hf_model, write_checkpoint
    hf = hf_model("olmo_hybrid", **over)
    if "rope_parameters" in over:
        assert hf.model.rotary_emb is None
    assert parity(hf, write_checkpoint("olmo_hybrid", str(tmp_path), model=hf)) <= 1e-4


def test_unpaired_linear_heads_are_refused():
    from models.architectures.olmo_hybrid import config_from_hf
    c = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
             linear_num_key_heads=2, linear_num_value_heads=4)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        config_from_hf(c)
