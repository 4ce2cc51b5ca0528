"""Mixture-of-experts families: Qwen3-MoE (dense attention, routed MLP) against transformers, and
the checkpoint layouts the MoE loaders accept (hub per-expert weights, Qwen3.5-MoE's multimodal
nesting). Qwen3.5-MoE's own parity runs with the other hybrids in test_hybrid.py."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from engine import reference
from engine.config import SamplingConfig
from models.architectures.moe import SparseMoe
from models.formats.checkpoints import CheckpointError
from tests.support.parity import LENGTHS, TOL, check_decode, check_prefill, check_split_prefill, hf_logits, rand_ids, session


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("qwen3_moe")
    path = write_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen3_moe")), model=hf)
    return path, models.load(path), hf


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logits_match_transformers(qwen3_moe, length):
    check_prefill(*qwen3_moe[1:], length)


def test_decode_steps_match_transformers(qwen3_moe):
    check_decode(*qwen3_moe[1:])


def test_split_prefill_equals_one_prefill(qwen3_moe):
    check_split_prefill(qwen3_moe[1])


def test_layers_route_as_the_config_says(qwen3_moe):
    """mlp_only_layers=[1]: layer 1 keeps its dense MLP; the others route over 8 experts, top 3,
    without renormalising the top-k weights; the C++ dense step does not claim the model."""
    lm = qwen3_moe[1]
    kinds = [isinstance(layer.mlp, SparseMoe) for layer in lm.model.model.layers]
    assert kinds == [True, False, True]
    router = lm.model.model.layers[0].mlp.gate
    assert router.top_k == 3 and not router.norm_topk
    assert not hasattr(lm.model.model.layers[0].mlp, "shared_expert")
    assert lm.model.cpu_decode_step(torch.float32) is None


def test_generation_after_rewind_equals_the_oracle(qwen3_moe):
    lm = qwen3_moe[1]
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    s = session(lm)
    long = rand_ids(40, 3)
    list(s.generate(long, greedy))
    short = long[:17] + rand_ids(5, 4)
    out = list(s.generate(short, greedy))
    assert s.last_stats.reused_tokens == 17
    assert out == reference.greedy(lm.model, short, len(out))


def test_checkpoint_in_the_stacked_layout_loads_alike(qwen3_moe, tmp_path):
    """transformers 5's 3D expert tensors and the hub's per-expert weights give the same model."""
    path, lm, hf = qwen3_moe
    out = tmp_path / "stacked"
    shutil.copytree(path, out)
    flat = load_file(str(out / "model.safetensors"))
    assert any(".experts.0.gate_proj.weight" in k for k in flat)  # what save_pretrained writes
    stacked = {}
    for k, v in hf.state_dict().items():
        stacked[k] = v.contiguous()
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    save_file(stacked, str(out / "model.safetensors"))
    ids = rand_ids(25, 12)
    assert (session(models.load(str(out))).prefill(ids, all_logits=True) - hf_logits(hf, ids)).abs().max() <= TOL


def test_incomplete_experts_are_a_one_line_error(qwen3_moe, tmp_path):
    path = qwen3_moe[0]
    out = tmp_path / "broken"
    shutil.copytree(path, out)
    flat = load_file(str(out / "model.safetensors"))
    del flat["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(flat, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="per-expert weights are incomplete"):
        models.load(str(out))


def test_qwen3_5_moe_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5-MoE's released checkpoints are multimodal: model_type qwen3_5_moe, the text config
    under text_config, the text weights under model.language_model.*, per-expert weights and a
    vision tower and MTP head to skip."""
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("qwen3_5_moe", seed=1)
    text_dir = write_checkpoint("qwen3_5_moe", str(tmp_path / "text"), model=hf)
    src = tmp_path / "mm"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(text_dir, name), src / name)
    cfg = json.load(open(os.path.join(text_dir, "config.json")))
    json.dump({"model_type": "qwen3_5_moe", "text_config": cfg, "vision_config": {"depth": 1}},
              open(src / "config.json", "w"))
    tensors = {}
    for k, v in hf.state_dict().items():
        k = k.replace("model.", "model.language_model.", 1)
        if k.endswith("mlp.experts.gate_up_proj"):
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2)
                tensors[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                tensors[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                tensors[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].contiguous()
        else:
            tensors[k] = v.contiguous()
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(src / "model.safetensors"))
    lm = models.load(str(src))
    assert lm.model_type == "qwen3_5_moe_text"
    ids = rand_ids(30, 11)
    assert (session(lm).prefill(ids, all_logits=True) - hf_logits(hf, ids)).abs().max() <= TOL
