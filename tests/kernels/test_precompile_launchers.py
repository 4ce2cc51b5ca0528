"""models/kernels/cuda/base.precompiling readies the compiled kernels' launchers one after another
on the calling thread, never side by side in its pool (bench/launcher_race.py: launchers loaded
side by side sometimes came back as another kernel's)."""
from __future__ import annotations

import contextlib
import threading
import types

import torch

from models.kernels.cuda import base


class Kernel:
    """A compiled kernel as precompiling sees one: `.run` readies its launcher."""
    inside = 0
    most = 0

    def __init__(self, seen):
        self.seen = seen

    @property
    def run(self):
        Kernel.inside += 1
        Kernel.most = max(Kernel.most, Kernel.inside)
        self.seen.append(threading.current_thread().name)
        threading.Event().wait(0.01)  # (long enough for a pool's threads to overlap)
        Kernel.inside -= 1
        return self


def test_launchers_are_readied_one_at_a_time_on_the_calling_thread(monkeypatch):
    fake_triton = types.SimpleNamespace(AsyncCompileMode=lambda pool: contextlib.nullcontext())
    monkeypatch.setattr(base, "triton", fake_triton)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    seen: list[str] = []
    kernels = [Kernel(seen) for _ in range(12)]
    with base.precompiling(workers=4):
        assert base.precompiling_now()
        base._submitted.extend(kernels)  # (what launch() submits inside)
        base._submitted.append(kernels[0])  # a kernel launched twice is readied once
    assert not base.precompiling_now()
    assert seen == [threading.current_thread().name] * 12
    assert Kernel.most == 1
