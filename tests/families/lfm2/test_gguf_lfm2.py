"""LFM2 from GGUF: a tiny HF checkpoint converted by llama.cpp's own converter (its `lfm2`
architecture: per-layer KV head counts marking the conv layers, shortconv tensors with the conv
weight squeezed to [C, K], the final norm as token_embd_norm) loads and decodes as the HF directory
does. The converter is told the tiny tokenizer's pre-tokenizer (gpt-2): it recognises only
published tokenizers by hash. llama.cpp's converter cannot write conv biases (LFM2 has none).
"""
import pytest

import models
from engine.config import SamplingConfig
from tests.support.parity import hf_logits, rand_ids, session


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.support.llama_cpp_tree import convert
    from tests.support.tiny import hf_model, write_checkpoint
    hf = hf_model("lfm2", conv_bias=False)
    d = write_checkpoint("lfm2", str(tmp_path_factory.mktemp("lfm2")), model=hf)
    gguf = convert(d, str(tmp_path_factory.mktemp("gguf") / "lfm2.gguf"), "f32", pre="gpt-2")
    return models.load(d), models.load(gguf), hf


@pytest.mark.slow
def test_converted_file_declares_the_layers_and_state_of_the_checkpoint(pair):
    hf_dir, from_gguf, _ = pair
    assert from_gguf.model_type == "lfm2"
    assert from_gguf.model.config.layer_types == hf_dir.model.config.layer_types == ("conv", "full_attention",
                                                                                    "conv", "conv")
    assert from_gguf.model.state_spec() == hf_dir.model.state_spec()


def test_logits_match_transformers(pair):
    _, from_gguf, hf = pair
    ids = rand_ids(77, 3)
    ref = hf_logits(hf, ids)
    assert (session(from_gguf).prefill(ids, all_logits=True) - ref).abs().max() <= 1e-4


def test_greedy_equals_the_hf_directory(pair):
    hf_dir, from_gguf, _ = pair
    text = "<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n"
    ids = from_gguf.tokenizer.encode(text).ids
    assert ids == hf_dir.tokenizer.encode(text).ids
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    assert list(session(from_gguf).generate(ids, greedy)) == list(session(hf_dir).generate(ids, greedy))


@pytest.mark.slow
def test_q8_0_conversion_runs_on_its_blocks(pair, tmp_path):
    """llama.cpp's q8_0 output: the projections stay in their blocks on the CPU (the conv weight,
    3 taps a row, stays float), and the logits stay near the f32 file's."""
    from tests.support.llama_cpp_tree import convert
    hf_dir = pair[0].source  # the fixture's HF directory
    q8 = models.load(convert(hf_dir, str(tmp_path / "lfm2-q8_0.gguf"), "q8_0", pre="gpt-2"), quantized=True)
    assert "Q8_0" in q8.weight_format
    ids = rand_ids(40, 4)
    ref = session(pair[1]).prefill(ids, all_logits=True)
    # (8-bit weights, and the tied Q8_0 head's bf16 activations (models/quant/layers.py), move them by ~5% of the
    # largest; a wrong layout moves them by about the largest itself)
    assert (session(q8).prefill(ids, all_logits=True) - ref).abs().max() <= 0.1 * ref.abs().max()
