"""GGUF files of Mamba2 hybrids, written by llama.cpp's own converter (`nemotron_h`, and
`granitehybrid` for Granite 4.0-H), load into the same models as their HF directories: equal
logits, the same greedy tokens, and transformers' logits.

The converter hashes the tokenizer's pre-tokenizer to name it; the tiny test tokenizer is not one
it knows, so it runs here with that one step answering "gpt-2" (the tiny tokenizer's rules: our
GGUF tokenizer rebuilds it from the file). The tensor layouts are what these tests check.
"""

import pytest

import models
from engine.config import SamplingConfig
from tests.support.llama_cpp_tree import convert
from tests.support.parity import TOL, hf_logits, rand_ids, session

pytestmark = pytest.mark.slow  # (each test converts a checkpoint with llama.cpp's converter)

CASES = {  # case: (kind, HF config overrides, config.json's layer types as released or as transformers 5 saves them)
    "nemotron_h": ("nemotron_h", {}, True),
    "granitehybrid": ("granitemoehybrid", {"position_embedding_type": "nope"}, True),
    "granitehybrid_e5": ("granitemoehybrid_e5", {}, True),
    # the converter reads only "attention" as an attention layer: transformers 5's "full_attention"
    # layer gets head_count_kv 0 and its q/k rows unpermuted, its KV heads known by attn_k's shape
    "granitehybrid_e5_hf5": ("granitemoehybrid_e5", {}, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    from tests.support.tiny import as_released, hf_model, write_checkpoint
    kind, over, released = CASES[request.param]
    hf = hf_model(kind, seed=2, **over)
    d = write_checkpoint(kind, str(tmp_path_factory.mktemp(request.param)), model=hf)
    if released:
        as_released(d, kind)
    gguf = convert(d, str(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"), "f32", pre="gpt-2")
    return request.param, models.load(d), models.load(gguf), hf


def test_gguf_architecture_is_the_converter_s(pair):
    import gguf
    name, _, lm, _ = pair
    arch = gguf.GGUFReader(lm.source).fields["general.architecture"]
    # this converter names Nemotron-H `nemotron_h_moe` whenever transformers' config for it has
    # MoE keys (transformers 5 always gives them defaults), experts or not: both names load
    expected = ("nemotron_h", "nemotron_h_moe") if name == "nemotron_h" else ("granitehybrid",)
    assert bytes(arch.parts[arch.data[0]]).decode() in expected


def test_gguf_logits_equal_the_hf_directory_and_transformers(pair):
    _, from_dir, from_gguf, hf = pair
    assert from_gguf.model.config.layer_types == from_dir.model.config.layer_types
    ids = rand_ids(70, 13)
    ours = session(from_gguf).prefill(ids, all_logits=True)
    assert (ours - session(from_dir).prefill(ids, all_logits=True)).abs().max() <= 1e-5
    assert (ours - hf_logits(hf, ids)).abs().max() <= TOL


def test_gguf_greedy_tokens_equal_the_hf_directory(pair):
    _, from_dir, from_gguf, _ = pair
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    prompt = rand_ids(25, 14)
    assert list(session(from_gguf).generate(prompt, greedy, stop_ids=())) == \
        list(session(from_dir).generate(prompt, greedy, stop_ids=()))


def test_gguf_tokenizer_equals_the_hf_directory(pair):
    _, from_dir, from_gguf, _ = pair
    text = "<|im_start|>user\nthe heron in 2 ponds<|im_end|>\n"
    assert from_gguf.tokenizer.encode(text).ids == from_dir.tokenizer.encode(text).ids


def test_q8_0_granite_gguf_runs_in_its_blocks(tmp_path):
    """A Q8_0 file kept quantized on the CPU (the Mamba2 and expert-free projections as blocks;
    the 3-D expert stacks and the conv dequantized) agrees with the same file dequantized, to
    the quantized kernels' activation rounding."""
    from tests.support.tiny import as_released, hf_model, write_checkpoint
    hf = hf_model("granitemoehybrid", seed=3, position_embedding_type="nope")
    d = write_checkpoint("granitemoehybrid", str(tmp_path / "hf"), model=hf)
    as_released(d, "granitemoehybrid")
    path = convert(d, str(tmp_path / "q8.gguf"), "q8_0", pre="gpt-2")
    blocks, plain = models.load(path, quantized=True), models.load(path)
    assert "Q8_0" in blocks.weight_format
    ids = rand_ids(40, 15)
    diff = session(blocks).prefill(ids, all_logits=True) - session(plain).prefill(ids, all_logits=True)
    assert diff.abs().max() <= 2e-2
