"""The session's state on disk for CUDA sessions (chat/state_cache.py, engine/state_file.py): a
conversation resumed from its saved state on the GPU answers as the re-prefilled one does, token
for token, with its decode graph captured before the state is read back (a KV model and a
hybrid); `chat --resume --device cuda` maps it back with no prefill; a file saved on the GPU is
refused on the CPU (another device kind) and the conversation still resumes there."""
from __future__ import annotations

import os

import pytest
from cli import run_chat as chat
import yaml

from test_state_file import GOLDEN, controller, fp, say

pytestmark = pytest.mark.gpu


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


def test_resume_on_cuda_maps_the_saved_state_back(tmp_path):
    conv = tmp_path / "conv"
    conv.mkdir()
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 5}\n"
                      "events:\n- user: hello there\n- user: and then?\n")
    rec = conv / "rec.yaml"
    model = os.path.join(GOLDEN, "tiny-qwen3_5")
    assert chat("run", script, "--model", model, "--device", "cuda", "-o", rec, tmp_path=tmp_path).returncode == 0
    flags = ["--conversations-dir", conv, "--temperature", "0", "--max-new-tokens", "5"]
    p = chat("--resume", rec, *flags, stdin="third\n", tmp_path=tmp_path)
    assert p.returncode == 0 and os.path.exists(str(rec) + ".state"), p.stderr
    plain = tmp_path / "plain.yaml"
    plain.write_text(rec.read_text())
    p = chat("--resume", rec, *flags, stdin="fourth\n", tmp_path=tmp_path)
    assert "resumed from saved state:" in p.stderr and "no prefill" in p.stderr, p.stderr
    chat("--resume", plain, *flags, "--state-cache-mib", "0", stdin="fourth\n", tmp_path=tmp_path)
    last = [yaml.safe_load(f.read_text())["events"][-1] for f in (rec, plain)]
    assert last[0]["generated_ids"] == last[1]["generated_ids"] and last[0]["prompt_ids"] == last[1]["prompt_ids"]
    assert last[0]["reused"] > 0 and last[1]["reused"] == 0
    p = chat("--resume", rec, *flags, "--device", "cpu", stdin="fifth\n", tmp_path=tmp_path)
    assert p.returncode == 0 and "saved state not used: it was saved with another" in p.stderr, p.stderr
