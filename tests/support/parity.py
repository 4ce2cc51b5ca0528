"""Parity checks against transformers shared by the families' tests (fp32, max abs diff <= TOL).

Each check takes our loaded model (`models.load`) and the transformers model it was written
from: prefill logits at a given length, 16 greedy decode steps after a prefill, and a prefill
split at odd points against one prefill. `tiny.py` writes the checkpoints.
"""
from __future__ import annotations

import torch

import models
from engine.session import DecodeSession

TOL = 1e-4
LENGTHS = [1, 63, 64, 65, 200]
SPLITS = [(0, 13), (13, 14), (14, 79), (79, 150)]


def session(lm, max_context=512):
    return DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32,
                         eos_ids=())


def rand_ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def load_with_hf(tmp_path_factory, kinds) -> dict:
    """kind → (our model, the transformers model it was written from), tiny.py's seed-0 checkpoints."""
    from tests.support.tiny import hf_model, write_checkpoint
    out = {}
    for kind in kinds:
        hf = hf_model(kind)
        out[kind] = (models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=hf)), hf)
    return out


def check_prefill_forms(lm, module, monkeypatch):
    """The model's multi-token forward in `module`'s chunked form (the default) against its naive one."""
    ids = rand_ids(70, 9)
    chunked = session(lm).prefill(ids, all_logits=True)
    monkeypatch.setattr(module, "PREFILL_FORM", "naive")
    assert (session(lm).prefill(ids, all_logits=True) - chunked).abs().max() <= TOL


def check_prefill(lm, hf, length):
    ids = rand_ids(length, length)
    diff = (session(lm).prefill(ids, all_logits=True) - hf_logits(hf, ids)).abs().max()
    assert diff <= TOL, f"prefill of {length}: max abs diff {float(diff):.2e}"


def check_decode(lm, hf, steps=16):
    s = session(lm)
    seq = rand_ids(37, 5)
    logits = s.prefill(seq)
    for i in range(steps):
        seq.append(int(logits[-1].argmax()))
        logits = s.step(seq[-1])
        diff = (logits[-1] - hf_logits(hf, seq)[-1]).abs().max()
        assert diff <= TOL, f"decode step {i}: max abs diff {float(diff):.2e}"


def check_split_prefill(lm):
    ids = rand_ids(SPLITS[-1][1], 7)
    whole = session(lm).prefill(ids, all_logits=True)
    s = session(lm)
    parts = [s.prefill(ids[a:b], all_logits=True) for a, b in SPLITS]
    assert (torch.cat(parts) - whole).abs().max() <= TOL


def check_second_turn(lm):
    """A second turn that extends the first reply continues from the live state (no re-prefill of
    the shared part) and decodes what a cold session and the reference forward do."""
    from engine import reference
    from engine.config import SamplingConfig
    greedy = SamplingConfig(temperature=0, max_new_tokens=10)
    s = session(lm)
    first = rand_ids(30, 4)
    reply = list(s.generate(first, greedy))
    second = first + reply + rand_ids(9, 5)
    warm = list(s.generate(second, greedy))
    assert s.last_stats.reused_tokens == len(first) + len(reply) - 1  # continued from the live state
    assert warm == list(session(lm).generate(second, greedy))
    assert warm == reference.greedy(lm.model, second, len(warm))
