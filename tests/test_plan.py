"""The kernel plan (models/plan): one rule table picks each op's kernel by device, dtype, weight
format and shape; the thresholds are KernelConfig fields. Planned on the CPU for either device
(a plan reads modules, it runs nothing): a tiny and a large matrix of one format get different
kernels where the table says so, configs move the thresholds, every op and device has a rule
that always serves, and the loaded models carry their plan."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

import models
from models.formats import gguf_blocks, quant
from models.plan import DEFAULT, KernelConfig, make, table
from models.plan.sites import OPS, collect


def q6k_linear(rows: int, cols: int, seed: int) -> quant.BlockLinear:
    from tiny_gguf import random_k_blocks
    blocks = torch.from_numpy(np.ascontiguousarray(random_k_blocks(Q.Q6_K, rows, cols, 0.02, seed)))
    return quant.BlockLinear(blocks, gguf_blocks.TYPES["Q6_K"])


class TwoMatrices(nn.Module):
    """A Q6_K matrix under KernelConfig.planar_min_weights and one over it."""

    def __init__(self):
        super().__init__()
        self.small = q6k_linear(256, 512, 1)         # 128 Ki weights
        self.large = q6k_linear(2304, 2048, 2)       # 4.5 Mi weights: over the 4 Mi default


@pytest.fixture(scope="module")
def two():
    return TwoMatrices()


def by_name(plan):
    return {c.site.name: c for c in plan.choices}


def test_a_tiny_and_a_large_matrix_of_one_format_get_different_kernels(two):
    assert two.small.in_features * two.small.out_features <= DEFAULT.planar_min_weights
    assert two.large.in_features * two.large.out_features > DEFAULT.planar_min_weights
    got = by_name(make(two, "cuda", torch.bfloat16, DEFAULT.but(triton=True)))
    assert (got["small"].kernel, got["small"].layout) == ("qlinear block GEMV", None)
    assert (got["large"].kernel, got["large"].layout) == ("qplanar GEMV", "Q6KP")
    assert "planar_min_weights" in got["small"].reason and "planar_min_weights" in got["large"].reason


@pytest.mark.parametrize("least,small,large", [(0, "Q6KP", "Q6KP"), (64 << 20, None, None)])
def test_the_threshold_is_the_configs(two, least, small, large):
    got = by_name(make(two, "cuda", torch.bfloat16, KernelConfig(planar_min_weights=least, triton=True)))
    assert (got["small"].layout, got["large"].layout) == (small, large)


def test_the_cpu_and_triton_off_plan_no_repack(two):
    for plan in (make(two, "cpu", torch.float32), make(two, "cuda", torch.bfloat16, KernelConfig(triton=False))):
        assert all(c.layout is None for c in plan.choices), plan.summary()
    off = by_name(make(two, "cuda", torch.bfloat16, KernelConfig(triton=False)))
    assert off["large"].kernel.startswith("torch")


def test_bind_on_the_cpu_changes_nothing(two):
    before = [t.data_ptr() for m in (two.small, two.large) for t in m.stored()]
    plan = models.plan.bind(two, "cpu", torch.float32)
    assert [t.data_ptr() for m in (two.small, two.large) for t in m.stored()] == before
    assert not two.large.planar and plan.device == "cpu"


def test_every_op_has_a_rule_that_always_serves():
    """The last rule of each op and device has no condition (else an unforeseen site would have
    no kernel), and each rule's conditions are ones the planner reads."""
    for op in OPS:
        for device in ("cpu", "cuda"):
            rules = table.rules_for(op, device, "any-format")
            assert rules and rules[-1].when == (), (op, device)
    known = {"gt", "le", "on", "off", "k", "not_k", "tied", "untied", "group", "not_group", "fits", "not_fits",
             "half", "fp32", "triton", "no_triton", "step", "no_step", "blocks", "int8", "head", "int4pack",
             "planar", "attention_fits", "delta_fits", "ssd_fits"}
    fields = set(KernelConfig.__dataclass_fields__)
    for rule in table.RULES:
        for cond in rule.when:
            assert cond[0] in known, cond
            if cond[0] in ("gt", "le", "on", "off"):
                assert cond[1] in fields, cond


@pytest.fixture(scope="module")
def smollm2_blocks():
    """The embedded GGUF as the CPU holds it by default (quantized: auto): its blocks kept."""
    return models.load("smollm2", "cpu", torch.float32, quantized=True)


def test_the_embedded_model_on_the_cpu(smollm2_blocks):
    smollm2 = smollm2_blocks
    plan = smollm2.plan
    assert plan is not None and plan.device == "cpu"
    assert plan.step == "C++ decode step" and set(plan.kernels()) == {"C++ decode step", "C++ decode step (fp16 KV)"}
    ops = {c.site.op for c in plan.choices}
    assert ops == {"embedding", "attention", "linear", "lm_head"}
    torch_only = make(smollm2.model, "cpu", torch.float32, KernelConfig(cpu_kernel=False))
    kinds = torch_only.kernels()
    assert torch_only.step == "torch eager step"
    assert kinds["torch int4 mm"] == 4 * smollm2.model.config.num_layers, kinds  # qkv, o, gate_up, down
    assert kinds["torch int4 mm (two planes)"] == 1 and kinds["torch SDPA"] == smollm2.model.config.num_layers
    # a decode step reads about the file's weight bytes: every matrix, one row of the embedding
    held = sum(smollm2.weight_bytes.values())
    assert 0.5 * held < plan.decode_bytes() <= held
    assert plan.kv_bytes_per_token() == 2 * smollm2.model.config.num_layers * 2 * 3 * 64  # fp16 K and V, 3 KV heads


def test_a_tiny_hybrid_lists_its_mixers(tmp_path):
    from tiny import write_checkpoint
    lm = models.load(write_checkpoint("qwen3_5", str(tmp_path)), "cpu", torch.float32)
    kinds = {c.site.op: c.kernel for c in lm.plan.choices}
    assert kinds["gated_delta"] == "torch recurrent step" and kinds["attention"] == "torch SDPA"
    cuda = {c.site.op: c.kernel for c in make(lm.model, "cuda", torch.bfloat16, KernelConfig(triton=True)).choices}
    assert cuda["gated_delta"] == "Triton delta step" and cuda["attention"] == "Triton flash-decoding"
    assert cuda["linear"] == "Triton GEMV (prefill: cuBLAS)"
    sites = collect(lm.model)
    assert sum(s.op == "gated_delta" for s in sites) + sum(s.op == "attention" for s in sites) \
        == len(lm.model.model.layers)
