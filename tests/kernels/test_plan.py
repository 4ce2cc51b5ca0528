"""The kernel plan (models/plan): one rule table picks each op's kernel by device, dtype, weight
format and shape; the thresholds are KernelConfig fields. Planned on the CPU for either device
(a plan reads modules, it runs nothing): a tiny and a large matrix of one format get different
kernels where the table says so, configs move the thresholds, every op and device has a rule
that always serves, and the loaded models carry their plan."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

import models
from models.formats import gguf_blocks
from models.quant import layers as quant
from models.plan import DEFAULT, KernelConfig, make, table
from models.plan.sites import OPS, collect


def q6k_linear(rows: int, cols: int, seed: int) -> quant.BlockLinear:
    from tests.support.tiny_gguf import random_k_blocks
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


def test_a_cuda_plan_binds_the_quantized_modules_cuda_forms_and_no_import_does():
    """The quantized modules reach their CUDA forms (models/ops/quant.py) only through a plan's
    binding: importing the forms and their kernels sets nothing on the classes, a CPU plan binds
    none, a CUDA plan binds each module (a copy keeps them), and a bound module still runs its
    torch forms on rows the kernels do not serve (here: CPU rows)."""
    from models.kernels.cuda import qlinear  # noqa: F401  (imported: nothing registers)
    from models.ops import quant as quant_ops
    from models.plan import bind
    assert quant.QuantLinear.forms is None and quant.BlockEmbedding.forms is None and quant.PlanarExperts.forms is None
    net = TwoMatrices()
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    want = net.small(x)
    bind(net, "cpu", torch.float32, KernelConfig(cpu_kernel=False))
    assert net.small.forms is None and net.large.forms is None
    bind(net, "cuda", torch.bfloat16, KernelConfig(triton=True))
    assert net.small.forms is quant_ops.FORMS and net.large.forms is quant_ops.FORMS
    assert copy.deepcopy(net).large.forms is quant_ops.FORMS
    assert not net.small.cuda_serves(x) and torch.equal(net.small(x), want)


def test_every_op_has_a_rule_that_always_serves():
    """The last rule of each op and device has no condition (else an unforeseen site would have
    no kernel), and each rule's conditions are ones the planner reads."""
    for op in OPS:
        for device in ("cpu", "cuda"):
            rules = table.rules_for(op, device, "any-format")
            assert rules and rules[-1].when == (), (op, device)
    known = {"gt", "le", "on", "off", "k", "not_k", "tied", "untied", "group", "not_group", "fits", "not_fits",
             "half", "fp32", "triton", "no_triton", "step", "no_step", "no_offer", "blocks", "int8", "head", "int4pack",
             "planar", "attention_fits", "delta_fits", "ssd_fits", "rows16"}
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
    assert plan.step == "C++ decode step" and set(plan.kernels()) == {
        "C++ step: row decode", "C++ step: flash-decoding (fp16 KV)", "C++ step: int4 GEMV", "C++ step: block GEMV"}
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
    from tests.support.tiny import write_checkpoint
    lm = models.load(write_checkpoint("qwen3_5", str(tmp_path / "dense")), "cpu", torch.float32)
    kinds = {c.site.op: c.kernel for c in lm.plan.choices}
    assert kinds["gated_delta"] == "C++ step: delta rule" and kinds["attention"].startswith("C++ step")
    moe = models.load(write_checkpoint("qwen3_next", str(tmp_path / "moe")), "cpu", torch.float32)
    kinds = {c.site.op: c.kernel for c in moe.plan.choices}
    assert kinds["gated_delta"] == "torch recurrent step" and kinds["attention"] == "torch SDPA"
    # (its family has the C++ step, which reads routed experts only as GGUF blocks: these are fp32)
    assert all(c.kernel == "torch" for c in moe.plan.choices if c.site.op == "linear")
    off = make(lm.model, "cpu", torch.float32, KernelConfig(cpu_kernel=False))
    assert all("cpu_kernel: off" in c.reason for c in off.choices if c.site.op == "linear")
    cuda = {c.site.op: c.kernel for c in make(lm.model, "cuda", torch.bfloat16, KernelConfig(triton=True)).choices}
    assert cuda["gated_delta"] == "Triton delta step" and cuda["attention"] == "Triton flash-decoding"
    assert cuda["linear"] == "Triton GEMV (prefill: cuBLAS)"
    sites = collect(lm.model)
    assert sum(s.op == "gated_delta" for s in sites) + sum(s.op == "attention" for s in sites) \
        == len(lm.model.model.layers)


@pytest.mark.slow
def test_chat_plan_on_the_embedded_model(chat_here):
    code, out, err = chat_here("plan", "smollm2", "--bandwidth", "50")
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith("kernel plan of ") and "on cpu, float32" in lines[0] and lines[1] == "step: C++ decode step"
    # (cpu_int8: auto, the default: the Q4_1 blocks interleaved 16 rows at a time, their inputs
    # rounded (to 16 bits: wide), as with cpu_int8: on; off: torch's int4 planes, gate and up fused)
    planes = ("3072x576", "C++ step: int4 GEMV")
    blocks = ("1536x576", "C++ step: rows16 GEMV (rounded inputs)")
    assert any(line.startswith("linear ") and blocks[0] in line and blocks[1] in line for line in lines)
    assert any(line.startswith("attention ") and "9 heads, 3 KV, d 64" in line for line in lines)
    assert "a decode step reads 98.2 MB of weights, plus 23.0 KB of KV cache per token of context" in out
    assert "at most 509 tok/s at 50 GB/s (given)" in out  # 50e9 / 98.2e6
    for value, (shape, kernel) in (("off", planes), ("on", blocks)):
        code, out, err = chat_here("plan", "smollm2", "--bandwidth", "50", "--cpu-int8", value)
        assert code == 0 and err == "", err
        assert any(line.startswith("linear ") and shape in line and kernel in line for line in out.splitlines())


def test_chat_plan_for_cuda_on_a_host_without_one(chat_here):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the plan is its own")
    code, out, _ = chat_here("plan", "--device", "cuda", "--quantized", "on", "--cpu-kernel", "off")
    assert code == 0
    assert "planned on this CPU: no CUDA device here" in out and "step: Triton kernels" in out
    assert "qlinear block GEMV" in out and "Triton flash-decoding" in out
    assert "give --bandwidth GB/s" in out
    code, out, _ = chat_here("plan", "--device", "cuda")  # (a GGUF on CUDA is dequantized unless quantized: on)
    assert code == 0 and "float16 (auto" in out.splitlines()[0] and "Triton GEMV" in out and "qlinear" not in out


@pytest.mark.parametrize("args,needle", [(["--bandwidth", "0"], "--bandwidth 0"),
                                         (["--bandwidth", "nan"], "--bandwidth nan"),
                                         (["/no/such/model"], "/no/such/model"),
                                         (["--device", "tpu"], "device")])
def test_chat_plan_bad_input_is_one_line(chat_here, args, needle):
    code, out, err = chat_here("plan", *args)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_recording_names_its_plan_and_replay_notes_another():
    from types import SimpleNamespace

    from chat.replay import _other_plan_note
    from chat.transcript import Transcript
    plan = SimpleNamespace(summary=lambda: "C++ decode step: int4 GEMV x120")
    controller = SimpleNamespace(rt=SimpleNamespace(loaded=SimpleNamespace(plan=plan)))

    def note(engine):
        return _other_plan_note(controller, Transcript([], {}, engine, {}))
    assert note({}) is None and note({"kernel_plan": plan.summary()}) is None
    assert note({"kernel_plan": ["not", "text"]}) is None
    other = note({"kernel_plan": "torch eager step: torch x121" + "x" * 500})
    assert other.startswith("  note: recorded on another kernel plan (") and "int4 GEMV x120" in other
    assert len(other) < 400  # (a hostile header's text bounded)
