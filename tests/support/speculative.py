"""For the speculative decoding tests: a depth policy that always drafts k tokens (as room allows),
and the state a session holds live (KV up to its length, the fixed tensors)."""
from __future__ import annotations

from engine.speculative import Depth


def kv_live(s):
    """The live state's values: each KV cache up to the length, each fixed tensor (conv windows)."""
    n = s.state.length
    kv = [t[:, :n].clone() for i in range(len(s.state._kv)) if s.state._kv[i] is not None for t in s.state.kv(i)]
    return kv + [t.clone() for t in s.state.fixed_tensors()]


class Always(Depth):
    """Depth k at every step, never adapted (a test of exactness, not of speed)."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def choose(self, room):
        return min(self.k, room)
