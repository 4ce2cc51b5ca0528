"""The session's state on disk for CUDA sessions (chat/state_cache.py, engine/state_file.py): a
conversation resumed from its saved state on the GPU answers as the re-prefilled one does, token
for token, with its decode graph captured before the state is read back (a KV model and a
hybrid); a file saved on the GPU is refused on the CPU (another device kind). `chat --resume` on
CUDA: tests/test_state_file.py's resume test, its cuda case."""
from __future__ import annotations

import pytest

from test_state_file import controller, fp, say

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
