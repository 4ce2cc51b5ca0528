"""Our dense models vs transformers on tiny random checkpoints (fp32, max abs diff <= 1e-4)."""
import pytest
import torch

import models
from engine import reference
from engine.config import SamplingConfig
from engine.session import DecodeSession

TOL = 1e-4
KINDS = ["llama", "qwen2", "qwen3"]


def _session(lm, max_context=256):
    return DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"),
                         dtype=torch.float32, eos_ids=())


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits(tiny_dirs, kind):
    path, hf = tiny_dirs[kind]
    lm = models.load(path)
    ids = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _session(lm).prefill(ids, all_logits=True)
    assert (ours - _hf_logits(hf, ids)).abs().max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decode_steps(tiny_dirs, kind):
    path, hf = tiny_dirs[kind]
    lm = models.load(path)
    ids = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    s = _session(lm)
    logits = s.prefill(ids)
    seq = list(ids)
    for _ in range(16):
        nxt = int(logits[-1].argmax())
        seq.append(nxt)
        logits = s.step(nxt)
        assert (logits[-1] - _hf_logits(hf, seq)[-1]).abs().max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_generation_after_rewind(tiny_dirs, kind):
    path, hf = tiny_dirs[kind]
    lm = models.load(path)
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 300, (40,), generator=g).tolist()
    s = _session(lm)
    list(s.generate(long, SamplingConfig(temperature=0, max_new_tokens=8)))
    short = long[:17] + torch.randint(3, 300, (5,), generator=g).tolist()
    out = list(s.generate(short, SamplingConfig(temperature=0, max_new_tokens=12)))
    assert s.last_stats.reused_tokens == 17
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([short]), attention_mask=torch.ones(1, len(short), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == hf_out[0, len(short):].tolist()
    # and the oracle agrees with the cached path on the logits after the rewind
    ref = reference.full_logits(lm.model, short + out[:-1])
    assert (s.prefill([out[-1]])[-1] - reference.full_logits(lm.model, short + out)[-1]).abs().max() <= TOL
    assert ref.shape[0] == len(short) + len(out) - 1
