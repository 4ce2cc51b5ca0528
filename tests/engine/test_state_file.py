"""The session's state on disk (engine/state_file.py, chat/state_cache.py): a conversation
resumed from its saved state answers as the re-prefilled one does, token for token, with no
prefill of what the state holds (a KV model and a hybrid); a file from another setting, cut
short, damaged or of another model is refused with the reason and the conversation still
resumes, prefilling. On CUDA (gpu-marked) a resumed state answers as the re-prefilled one with
its decode graph captured before the state is read back, and a GPU-saved file is refused on the
CPU (another device kind)."""
from __future__ import annotations

import os

import pytest
import yaml

from tests.support.cli import run_chat as chat
from tests.support.paths import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden")


def controller(model: str, **over):
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    rt = open_runtime(load_settings(env={}, overrides={"model": os.path.join(GOLDEN, model), "max_new_tokens": "6",
                                                        "temperature": "0", **over}))
    return ChatController(rt, rt.settings)


def say(c, text):
    from chat.turn import TurnResult
    r = TurnResult([])
    list(c.send(text, r))
    return r


def fp(c):
    from chat.state_cache import _fingerprint
    return _fingerprint(c)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3_5"])
def test_a_saved_state_answers_as_a_prefill_does(tmp_path, model):
    from engine import state_file
    a = controller(model)
    for m in ("hello there", "a second message", "and a third one"):
        say(a, m)
    path = str(tmp_path / "s.state")
    ids, tensors = state_file.snapshot(a.session)
    assert state_file.write(path, ids, tensors, fp(a)) > 0
    b = controller(model)  # a fresh session: the state from the file
    b.branches[0].turns, b.current = list(a.turns), 0
    b.switch(0)
    assert state_file.read(path, b.session, fp(b)) == len(ids)
    c = controller(model)  # and one that prefills the conversation
    c.branches[0].turns = list(a.turns)
    c.switch(0)
    ra, rb, rc = say(a, "what now?"), say(b, "what now?"), say(c, "what now?")
    assert ra.ids == rb.ids == rc.ids and ra.prompt_ids == rb.prompt_ids == rc.prompt_ids
    # the restored session reuses what the session that never stopped does; the other prefills all
    assert rb.stats.reused_tokens == ra.stats.reused_tokens > 0 and rc.stats.reused_tokens == 0


def test_files_that_do_not_hold_are_refused(tmp_path):
    from engine import state_file
    a = controller("tiny-llama")
    say(a, "hello there")
    path = str(tmp_path / "s.state")
    ids, tensors = state_file.snapshot(a.session)
    state_file.write(path, ids, tensors, fp(a))
    data = open(path, "rb").read()

    def refused(session_of, needle, content=None):
        if content is not None:
            open(path, "wb").write(content)
        b = session_of()
        before = list(b.session.cached)
        with pytest.raises(state_file.StateFileError, match=needle):
            state_file.read(path, b.session, fp(b))
        assert b.session.cached == before  # (untouched)
    refused(lambda: controller("tiny-llama", max_context="256"), "another max_context")
    refused(lambda: controller("tiny-llama"), "does not read", data[: len(data) // 2])
    damaged = bytearray(data)
    damaged[-7] ^= 0xFF
    refused(lambda: controller("tiny-llama"), "checksum", bytes(damaged))
    refused(lambda: controller("tiny-llama"), "does not read|not a state file", b"not a state file at all")
    open(path, "wb").write(data)
    other = controller("tiny-qwen3_5")  # another model: another fingerprint, and another layout
    with pytest.raises(state_file.StateFileError, match="another model"):
        state_file.read(path, other.session, fp(other))
    with pytest.raises(ValueError, match="not this model's state"):
        other.session.load_state(ids, tensors)


def test_a_forged_file_is_refused_before_its_tensors_are_read(tmp_path):
    """Right fingerprint and checksum, but a tensor of another shape, or more ids than the context
    holds: refused from the header alone."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine import state_file
    from engine.state_file import _digest
    a = controller("tiny-llama")
    say(a, "hello there")
    path = str(tmp_path / "s.state")
    ids, tensors = state_file.snapshot(a.session)
    state_file.write(path, ids, tensors, fp(a))
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    forged = dict(tensors, **{"kv.0.k": torch.zeros(2, 4 * len(ids), 16)})
    save_file(forged, path, metadata=dict(meta, sha256=_digest(forged)))
    b = controller("tiny-llama")
    with pytest.raises(state_file.StateFileError, match="names, shapes or dtypes differ"):
        state_file.read(path, b.session, fp(b))
    save_file(tensors, path, metadata=dict(meta, ids=json.dumps([1] * 100000)))
    with pytest.raises(state_file.StateFileError, match="holds 100000 tokens"):
        state_file.read(path, b.session, fp(b))
    assert b.session.cached == []


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_resume_maps_the_saved_state_back(tmp_path, device):
    """(On CUDA the recording's device is the resumed session's; there the file is then refused
    on the CPU, another device kind, and the conversation still resumes.)"""
    conv = tmp_path / "conv"
    conv.mkdir()
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 5}\n"
                      "events:\n- user: hello there\n- user: and then?\n")
    rec = conv / "rec.yaml"
    assert chat("run", script, "--model", os.path.join(GOLDEN, "tiny-qwen3_5"), "--device", device, "-o", rec,
                tmp_path=tmp_path).returncode == 0
    flags = ["--conversations-dir", conv, "--temperature", "0", "--max-new-tokens", "5"]
    p = chat("--resume", rec, *flags, stdin="third\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "saved state" not in p.stderr, p.stderr
    assert os.path.exists(str(rec) + ".state")
    saved = (str(rec) + ".state", open(str(rec) + ".state", "rb").read())
    plain = tmp_path / "plain.yaml"
    plain.write_text(rec.read_text())
    p = chat("--resume", rec, *flags, stdin="fourth\n", tmp_path=tmp_path)
    assert "resumed from saved state:" in p.stderr and "no prefill" in p.stderr, p.stderr
    q = chat("--resume", plain, *flags, "--state-cache-mib", "0", stdin="fourth\n", tmp_path=tmp_path)
    last = [yaml.safe_load(f.read_text())["events"][-1] for f in (rec, plain)]
    assert last[0]["generated_ids"] == last[1]["generated_ids"] and last[0]["prompt_ids"] == last[1]["prompt_ids"]
    assert last[0]["reused"] > 0 and last[1]["reused"] == 0, q.stderr
    if device == "cuda":
        p = chat("--resume", rec, *flags, "--device", "cpu", stdin="fifth\n", tmp_path=tmp_path)
        assert p.returncode == 0 and "saved state not used: it was saved with another" in p.stderr, p.stderr
        return
    open(saved[0], "wb").write(saved[1][:100])  # cut short: refused, the conversation still resumes
    p = chat("--resume", rec, *flags, stdin="fifth\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "saved state not used: it does not read" in p.stderr, p.stderr
    p = chat("--resume", rec, *flags, "--dtype", "bfloat16", stdin="sixth\n", tmp_path=tmp_path)
    assert "saved state not used: it was saved with another dtype" in p.stderr, p.stderr


def test_pruning_a_conversation_removes_its_state(tmp_path):
    from chat.conversations import ConversationStore
    conv = tmp_path / "conv"
    conv.mkdir()
    for i, name in enumerate(("a.yaml", "b.yaml")):
        (conv / name).write_text("x")
        (conv / (name + ".state")).write_text("x")
        os.utime(conv / name, (i, i))
    (conv / ".tmp-old.state").write_text("x")
    os.utime(conv / ".tmp-old.state", (0, 0))
    (conv / ".tmp-new.state").write_text("x")  # (a write in flight: kept)
    ConversationStore(str(conv), keep=1).prune()
    assert sorted(os.listdir(conv)) == [".tmp-new.state"]


def test_a_tensor_parallel_session_neither_saves_nor_resumes_a_state(tmp_path):
    """Split over processes, rank 0 holds its shard of the state only: a file written from it, or
    loaded into it alone, would leave the workers' caches behind. Refused, with the reason."""
    from types import SimpleNamespace

    from chat.state_cache import StateSaver, resume, state_path
    c = SimpleNamespace(rt=object(), settings=SimpleNamespace(engine=SimpleNamespace(tensor_parallel=2)))
    assert not StateSaver(64).usable(c)
    rec = str(tmp_path / "rec.yaml")
    assert resume(c, rec) is None  # (no file beside it: nothing to say)
    open(state_path(rec), "wb").write(b"any")
    assert resume(c, rec).startswith("saved state not used: a tensor-parallel session")
    c.settings.engine.tensor_parallel = 1
    assert StateSaver(64).usable(c)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3_5"])
def test_a_saved_cuda_state_answers_as_a_prefill_does(tmp_path, model):
    from engine import state_file
    a = controller(model, device="cuda", cuda_graph="on")
    for m in ("hello there", "a second message", "and a third one"):
        say(a, m)
    path = str(tmp_path / "s.state")
    ids, tensors = state_file.snapshot(a.session)
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert state_file.write(path, ids, tensors, fp(a)) > 0 and fp(a)["gpu"] and fp(a)["device"] == "cuda"
    b = controller(model, device="cuda", cuda_graph="on")  # its graph captured before the read
    b.branches[0].turns, b.current = list(a.turns), 0
    b.switch(0)
    assert state_file.read(path, b.session, fp(b)) == len(ids)
    c = controller(model, device="cuda", cuda_graph="on")
    c.branches[0].turns = list(a.turns)
    c.switch(0)
    ra, rb, rc = say(a, "what now?"), say(b, "what now?"), say(c, "what now?")
    assert ra.ids == rb.ids == rc.ids and ra.prompt_ids == rb.prompt_ids == rc.prompt_ids
    assert rb.stats.reused_tokens == ra.stats.reused_tokens > 0 and rc.stats.reused_tokens == 0
    cpu = controller(model, device="cpu")
    with pytest.raises(state_file.StateFileError, match="saved with another"):
        state_file.read(path, cpu.session, fp(cpu))
