"""Prefills padded to a length bucket (engine/graphs.py's PaddedPrefill, CausalLM.forward's `last`):
on the CPU, where the padded forward runs as the tests' form (the session pads only on CUDA),
against the prompt's own length; tests/engine/test_prefill_graphs.py runs the CUDA form and its
graphs."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.graphs import PREFILL_BUCKETS, PaddedPrefill, prefill_bucket
from engine.session import DecodeSession

GREEDY = SamplingConfig(temperature=0, max_new_tokens=12)


def ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tests.support.tiny import write_checkpoint
    return {kind: models.load(write_checkpoint(kind, str(tmp_path_factory.mktemp(kind))))
            for kind in ("llama", "qwen3", "qwen3_moe")}


def session(lm, padded: bool, max_context=256):
    s = DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32)
    if padded:
        s._padded = PaddedPrefill(lm.model, s.state, torch.device("cpu"), graphs=False)
    return s


def test_buckets():
    assert [prefill_bucket(n, 4096) for n in (2, 16, 17, 200, 257, 700, 2000, 2048)] == \
        [16, 16, 32, 256, 512, 768, 2048, 2048]
    assert prefill_bucket(2049, 4096) is None  # longer chunks run unpadded
    assert prefill_bucket(20, 30) is None  # no room for the bucket's pads: unpadded
    assert prefill_bucket(20, 32) == 32
    assert list(PREFILL_BUCKETS) == sorted(PREFILL_BUCKETS) and all(b % 16 == 0 for b in PREFILL_BUCKETS)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_padded_prefill_gives_the_prompts_logits(tiny_models, kind):
    """From position 0 and over a cached prefix: the last real row's logits, whatever the pads."""
    lm = tiny_models[kind]
    for start, n in ((0, 5), (0, 16), (0, 40), (7, 9), (33, 60)):
        prefix, prompt = ids(start, 1), ids(n, 2)
        plain, padded = session(lm, False), session(lm, True)
        for s in (plain, padded):
            if prefix:
                s.prefill(prefix)
        want, got = plain.prefill(prompt), padded.prefill(prompt)
        assert got.shape == want.shape == (1, lm.model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert padded.state.length == padded.state.written == start + n  # the pads' slots are not counted


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_padded_session_conversation_matches(tiny_models, kind, monkeypatch):
    """Turns, an edit that rewinds into the cached prompt, a /retry-like repeat, and a later turn
    too close to the context's end for its bucket (unpadded): the same tokens as without pads."""
    import engine.session
    lm = tiny_models[kind]
    a, b = ids(30, 3), ids(9, 4)
    buckets = []

    def bucket(n, room):
        buckets.append(prefill_bucket(n, room))
        return buckets[-1]

    monkeypatch.setattr(engine.session, "prefill_bucket", bucket)

    def conversation(padded):
        s = session(lm, padded, max_context=128)
        out = [list(s.generate(a, GREEDY))]
        out.append(list(s.generate(a + out[0] + b, GREEDY)))
        out.append(list(s.generate(a[:20] + b, GREEDY)))  # rewinds into the first prompt
        out.append(list(s.generate(a[:20] + b, GREEDY)))  # the whole prompt reused
        later = a[:20] + b + out[3] + ids(70, 5)  # 70 new tokens at 40: bucket 128 > the 88 slots left
        out.append(list(s.generate(later, SamplingConfig(temperature=0, max_new_tokens=4))))
        return out, s

    (want, _), (got, s) = conversation(False), conversation(True)
    assert got == want
    assert s.state.written == s.state.length
    assert buckets == [32, 16, 16, None]  # (the whole-prompt reuse prefilled nothing)


def test_pads_are_never_reused(tiny_models):
    """A padded prefill writes the pads' keys and values past the prompt; a later prompt that
    continues the conversation must not take them for its tokens (they were fed token 0)."""
    lm = tiny_models["llama"]
    s = session(lm, True)
    s.prefill(ids(5, 6))
    assert s.state.written == 5
    follow = ids(5, 6) + [0, 0, 0]  # the very ids the pads were fed
    n, logits = s.reuse_prefix(follow)
    assert n == 5 and logits is None
    torch.testing.assert_close(s.prefill([0, 0, 0]), session(lm, False).prefill(follow), rtol=1e-5, atol=1e-5)


def test_models_that_cannot_pad_say_so(tiny_models, tmp_path):
    """Recurrent state (a pad would feed it), the CPU, and the per-expert loop (it reads the
    chosen ids on the host: no graph could record it) keep the prompt's own length."""
    from tests.support.tiny import write_checkpoint
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    hybrid = models.load(write_checkpoint("qwen3_5", str(tmp_path)))
    assert not hybrid.model.pads_prefill(cuda, bf16, bf16)
    assert not tiny_models["llama"].model.pads_prefill(torch.device("cpu"), torch.float32, torch.float32)
    from models.architectures import moe
    mlps = [layer.mlp for layer in tiny_models["qwen3_moe"].model.model.layers]
    assert any(isinstance(m, moe.SparseMoe) for m in mlps)
    assert not all(moe.prefill_syncless(m, torch.float16) for m in mlps)  # fp16: the loop
    assert all(moe.prefill_syncless(m, torch.bfloat16) for m in mlps)
