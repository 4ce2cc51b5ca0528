"""CUDA: output-format masks applied on the device (the Triton kernel, eagerly and in its small
CUDA graph) equal the torch form and the host's; constrained replies are the
same with and without the CUDA graph and with the mask inline or on the worker thread, and they
validate; the embedded model answers the acceptance question in JSON on the GPU. (The speed
ratio is bench/constrained_bench.py's: timings are not asserted in tests.)"""
import json
import os
import subprocess
import sys

import jsonschema
import pytest
import torch

import models
from chat.constraints import Format
from engine.config import SamplingConfig
from engine.constraint import ConstraintMask, DeviceMasks
from models.kernels.cuda.bitmask import masked_logits, masked_logits_torch
from engine.session import DecodeSession

from tests.support.paths import ROOT

pytestmark = pytest.mark.gpu
SCHEMA = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}, "maxItems": 5},
                                           "s": {"type": "string", "maxLength": 6}},
          "required": ["xs", "s"], "additionalProperties": False}


class Fixed:
    """A TokenConstraint with given masks, one a step."""

    def __init__(self, masks):
        self.masks, self.mask_words, self.i = masks, masks[0].numel(), 0

    def fill_mask(self, out):
        out.copy_(self.masks[self.i])

    def consume(self, token):
        self.i += 1
        return True

    def error(self):
        return ""


@pytest.mark.parametrize("overlap", [False, True])
def test_device_unpacking_equals_the_host(overlap, monkeypatch):
    monkeypatch.setattr(ConstraintMask, "overlap", overlap)
    g = torch.Generator().manual_seed(0)
    vocab = 49152 + 17
    words = [torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32,), generator=g, dtype=torch.int64).to(torch.int32)
             for _ in range(4)]
    logits = torch.randn(4, vocab, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        m = ConstraintMask(Fixed(words), vocab, torch.device(dev))
        m.start()
        rows = []
        for i in range(4):
            rows.append(m.apply(logits[i].to(dev)).cpu())
            m.advance(0)
        out[dev] = torch.stack(rows)
    assert torch.equal(out["cpu"], out["cuda"])
    bit = (words[1][5] >> 3) & 1  # token 5 * 32 + 3 of step 1
    assert (out["cpu"][1, 5 * 32 + 3] == float("-inf")) == (int(bit) == 0)


def random_words(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32 + 1,), generator=g, dtype=torch.int64)
            .to(torch.int32) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mask_kernel_equals_the_torch_form(dtype):
    vocab = 49152 + 17  # not a multiple of 32 (nor of the kernel's block); the words run past it
    words = random_words(vocab, 1)[0].cuda()
    logits = torch.randn(vocab, device="cuda").to(dtype)
    got = masked_logits(logits, words, torch.empty_like(logits))
    want = masked_logits_torch(logits, words, torch.empty_like(logits))
    assert torch.equal(got, want)
    allowed = ((words.cpu().long()[torch.arange(vocab) // 32] >> (torch.arange(vocab) % 32)) & 1) == 1
    assert torch.equal(got.cpu() == float("-inf"), ~allowed)


def test_mask_graph_replays_equal_the_eager_apply():
    """The same logits tensor step after step (as a decode graph's output): the first apply of each
    host buffer runs eagerly, the second captures, later ones replay; every one is exact."""
    vocab = 49152 + 17
    words = random_words(vocab, 7, seed=1)
    masks = DeviceMasks(torch.device("cuda"), words[0].numel())
    logits = torch.empty(vocab, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    for step, w in enumerate(words):
        logits.copy_(torch.randn(vocab, device="cuda", generator=g))
        masks.host[step % 2].copy_(w)
        got = masks.apply(step % 2, logits).clone()
        assert torch.equal(got, masked_logits_torch(logits, w.cuda(), torch.empty_like(logits))), step
    assert len(masks.graphs) == 2  # one a host buffer


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    path = write_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), model=hf_model("llama"))
    return models.load(path, "cuda", torch.bfloat16)


def replies(lm, graph, overlap, monkeypatch):
    monkeypatch.setattr(ConstraintMask, "overlap", overlap)
    s = DecodeSession(lm.model, max_context=1024, device=torch.device("cuda"), dtype=torch.bfloat16,
                      eos_ids=lm.eos_ids, cuda_graph=graph)
    compiled = Format("json_schema", json.dumps(SCHEMA)).compile(lm.tokenizer, s.eos_ids, s.vocab_size)
    out = []
    for seed in range(4):
        cfg = SamplingConfig(temperature=1.0, seed=seed, max_new_tokens=400, top_k=0, top_p=1.0, min_p=0.0)
        ids = list(s.generate([1, 90, 100, 110, 2, 1, 70], cfg, constraint=compiled.constraint()))
        assert s.last_stats.finish_reason == "stop"
        jsonschema.validate(json.loads(lm.tokenizer.decode(ids[:-1])), SCHEMA)
        out.append(ids)
    return out


def test_graph_on_off_and_overlap_give_the_same_constrained_tokens(tiny_cuda, monkeypatch):
    runs = [replies(tiny_cuda, graph, overlap, monkeypatch)
            for graph, overlap in (("on", None), ("off", None), ("on", True))]
    assert runs[0] == runs[1] == runs[2]


GGUF = os.environ.get("CHAT_TEST_GGUF", "")


@pytest.mark.skipif(not GGUF, reason="CHAT_TEST_GGUF names no model file")
def test_embedded_model_answers_in_json_on_cuda():
    schema = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'
    proc = subprocess.run([sys.executable, "-m", "chat", "--model", GGUF, "--device", "cuda", "--prompt",
                           "Which city is the capital of France? Answer in JSON.", "--json-schema", schema,
                           "--temperature", "0"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, CHAT_HISTORY_FILE=os.devnull))
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["city"], str)

