"""The embedded SmolLM2 GGUF: tokenizer vs llama.cpp, greedy tokens vs transformers (fp32)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from engine.config import SamplingConfig
from engine.session import DecodeSession
from tests.support.paths import DATA

TOKEN_IDS = os.path.join(DATA, "smollm2_token_ids.json")
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in one sentence what a CPU does."]


def test_tokenizer_matches_llama_cpp(smollm2):
    cases = json.load(open(TOKEN_IDS, encoding="utf-8"))["cases"]
    assert len(cases) >= 200
    mismatches = [(s, ids) for s, ids in cases
                  if smollm2.tokenizer.encode(s, add_special_tokens=False).ids != ids]
    assert not mismatches, mismatches[:3]


def test_digit_split_differs_from_naive_byte_level(smollm2):
    # llama.cpp's smollm pre-tokenizer: "  4" is ĠĠ then 4 (transformers' GGUF tokenizer gives Ġ Ġ 4)
    assert smollm2.tokenizer.encode("  4", add_special_tokens=False).tokens == ["ĠĠ", "4"]


def test_stop_ids_from_metadata(smollm2):
    assert smollm2.eos_ids[0] == 2 and 0 in smollm2.eos_ids


@pytest.fixture(scope="module")
def hf_gguf(smollm2_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_greedy(hf, ids, n):
    """Plain greedy with HF's KV cache and no stop ids (generate() would suppress or stop at eos)."""
    out = []
    with torch.no_grad():
        res = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.mark.slow
def test_greedy_parity_with_transformers(smollm2, hf_gguf):
    from chat.template import ChatTemplate
    tpl = ChatTemplate(smollm2.chat_template)
    s = DecodeSession(smollm2.model, max_context=1024, device=torch.device("cpu"), dtype=torch.float32,
                      eos_ids=())
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.encode(tpl.render([{"role": "user", "content": prompt}]),
                                       add_special_tokens=False).ids
        ours = list(s.generate(ids, SamplingConfig(temperature=0, max_new_tokens=32)))
        assert ours == hf_greedy(hf_gguf, ids, 32), prompt


@pytest.mark.slow
def test_cli_answers_like_transformers(smollm2, hf_gguf):
    # the reference path (weights dequantized), which is what transformers computes
    proc = subprocess.run([sys.executable, "-m", "chat", "--prompt", "What is the capital of France?",
                           "--temperature", "0", "--quantized", "off"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from chat.template import ChatTemplate
    ids = smollm2.tokenizer.encode(ChatTemplate(smollm2.chat_template).render(
        [{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False).ids
    with torch.no_grad():
        out = hf_gguf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = smollm2.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    assert proc.stdout == expected + "\n"
    assert "Paris" in proc.stdout
