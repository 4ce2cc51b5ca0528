"""CUDA: prefills padded to length buckets and their graphs (engine/graphs.py's PaddedPrefill).
Graphs on = off bit for bit (each bucket eager once, then replayed, at other starts too); the
padded logits against the prompt's own length; a bucket whose capture fails stays eager."""
import pytest
import torch

import models
from engine.config import SamplingConfig
from engine.session import DecodeSession

pytestmark = pytest.mark.gpu

CUDA, BF16 = torch.device("cuda"), torch.bfloat16
KINDS = ["llama", "qwen3", "qwen3_moe", "qwen3_moe-grouped"]


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    out = {}
    for kind in KINDS:
        base = kind.removesuffix("-grouped")
        # "-grouped": sizes grouped.py's GEMMs take (its combine joins the next norm); else torch._grouped_mm
        over = dict(hidden_size=192, moe_intermediate_size=64) if kind.endswith("-grouped") else {}
        path = write_checkpoint(base, str(tmp_path_factory.mktemp(base)), model=hf_model(base, **over))
        out[kind] = models.load(path, "cuda", BF16)
    return out


def ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def session(lm, graph="on", max_context=512):
    return DecodeSession(lm.model, max_context=max_context, device=CUDA, dtype=BF16, cuda_graph=graph)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_prefills_graphs_on_off_identical(lms, kind):
    """A conversation whose prefills fall in several buckets, twice in some (replays), at other
    starts (later turns, a rewind): graphs on and off give the same tokens and prefill logits."""
    lm = lms[kind]
    a, b, c = ids(37, 1), ids(9, 2), ids(150, 3)
    cfg = SamplingConfig(temperature=0, max_new_tokens=10)

    def run(graph):
        s = session(lm, graph)
        assert s._padded is not None
        out, logits = [], []
        for prompt in (a, None, a[:30] + b, c, None, ids(40, 4), ids(20, 5)):
            prompt = prompt if prompt is not None else s.cached + b  # a later turn: a prefill past 0
            out.append(list(s.generate(prompt, cfg)))
            logits.append(s.state.checkpoint_logits(len(prompt)))
        s.reset()
        logits.append(s.prefill(ids(45, 6)).clone())
        return s, out, logits

    on, off = run("on"), run("off")
    assert on[1] == off[1]
    assert all(x is not None and torch.equal(x, y) for x, y in zip(on[2], off[2]))
    assert on[0]._padded.replays >= 3 and len(on[0]._padded.graphs) >= 3 and not on[0]._padded.failed
    assert off[0]._padded.replays == 0 and not off[0]._padded.graphs
    assert "CUDA graph" in on[0].prefill_path


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe-grouped"])
def test_a_bucket_graph_serves_any_start(lms, kind):
    """One bucket's graph replayed at starts other than its capture's: the positions, the KV
    slots written and the attention's start all come from the device (a start baked into the
    recording would attend over the wrong slots)."""
    lm = lms[kind]
    on, off = session(lm, "on"), session(lm, "on")
    off._padded.use_graphs = False  # its prefills eager; its decode steps the same graph's as on's
    on.prefill(ids(20, 7))  # bucket 32 from position 0: eager, then captured
    assert 32 in on._padded.graphs
    for start in (0, 5, 44, 300):
        prefix, prompt = ids(start, 8), ids(25, 9)
        got, want = [], []
        for s, out in ((on, got), (off, want)):
            s.reset()
            if prefix:
                s.prefill(prefix)
            out.append(s.prefill(prompt))
            out += [s.step(t) for t in (11, 12, 13)]  # decode over the slots that prefill wrote
        same = [torch.equal(x, y) for x, y in zip(got, want)]
        assert all(same), (start, same, [float((x - y).abs().max()) for x, y in zip(got, want)])
    assert on._padded.replays >= 4 and off._padded.replays == 0


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe-grouped"])
def test_padded_close_to_the_prompts_own_length(lms, kind):
    """The padded prefill's logits against the unpadded eager form's (bf16: the GEMMs' tiles may
    round differently at another row count; the greedy choice agrees)."""
    lm = lms[kind]
    for start, n in ((0, 3), (0, 100), (17, 40)):
        padded, plain = session(lm, "on"), session(lm, "off")
        plain._padded = None
        for s in (padded, plain):
            if start:
                s.prefill(ids(start, 10))
        p, q = padded.prefill(ids(n, 11)), plain.prefill(ids(n, 11))
        assert float((p - q).abs().max()) <= 0.02 * float(q.abs().max()) + 1e-3
        assert int(p.argmax()) == int(q.argmax())


def test_a_capture_that_fails_ends_the_captures(lms, monkeypatch):
    """An op the capture refuses (a host sync) fails that bucket's capture: the prefill's result
    stands, every bucket runs eager from then on (/show says why), and the session goes on giving
    graphs-off tokens."""
    from engine import graphs
    lm = lms["llama"]
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    prompts = (ids(20, 12), ids(50, 13))
    want = [list(session(lm, "off").generate(p, cfg)) for p in prompts]
    run = graphs.PaddedPrefill._run

    def syncing(self, bucket):
        out = run(self, bucket)
        torch.cuda.synchronize()  # not permitted while capturing
        return out

    monkeypatch.setattr(graphs.PaddedPrefill, "_run", syncing)
    s = session(lm, "on")
    assert list(s.generate(prompts[0], cfg)) == want[0]
    assert list(s._padded.failed) == [32] and not s._padded.graphs
    monkeypatch.setattr(graphs.PaddedPrefill, "_run", run)
    s.reset()
    assert [list(s.generate(p, cfg)) for p in prompts] == want  # eager, the CUDA context intact
    assert not s._padded.graphs and s._padded.replays == 0
    assert "not capturable" in s.prefill_path and "32-token bucket" in s.prefill_path


def test_ctrl_c_during_a_capture_leaves_the_session_usable(lms, monkeypatch):
    """A KeyboardInterrupt in the middle of a capture (the REPL's Ctrl-C) ends the capture and
    reaches the caller; the session then prefills, captures and replays that bucket as usual."""
    from engine import graphs
    lm = lms["llama"]
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    prompt = ids(20, 14)
    want = list(session(lm, "off").generate(prompt, cfg))
    run = graphs.PaddedPrefill._run

    def interrupted(self, bucket):
        if torch.cuda.is_current_stream_capturing():
            run(self, bucket)  # (the capture is under way: its launches recorded)
            raise KeyboardInterrupt
        return run(self, bucket)

    monkeypatch.setattr(graphs.PaddedPrefill, "_run", interrupted)
    s = session(lm, "on")
    with pytest.raises(KeyboardInterrupt):
        list(s.generate(prompt, cfg))
    assert not s._padded.graphs and not s._padded.failed and s.state.length == 0
    monkeypatch.setattr(graphs.PaddedPrefill, "_run", run)
    assert list(s.generate(prompt, cfg)) == want  # eager once more, then captured
    assert 32 in s._padded.graphs
    s.reset()
    assert list(s.generate(prompt, cfg)) == want and s._padded.replays == 1
