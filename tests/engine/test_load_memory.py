"""Load-time memory: fusing projections frees each module's parts as it goes.

The loader's `fuse` concatenates q/k/v, gate/up and the Gated DeltaNet input projections. Had it
held every pre-fusion linear until it returned, the peak would be the weights plus a second copy of
every fused matrix (a 54 GB bf16 model then no longer loads on an 80 GB card). Here the live bytes
of the model's weights are counted at every concatenation during a real `models.load`: the peak
may exceed the weights by at most the largest single fused matrix.
"""
from __future__ import annotations

import weakref

import pytest
import torch

import models
from models import loader
from tests.support.tiny import write_checkpoint


def _peak_during_fuse(monkeypatch, path: str) -> tuple[int, int, int]:
    """(bytes of the weights before fusing, the peak of live weight bytes at any concatenation,
    the largest single concatenation's output) for loading `path` in bfloat16 on the CPU."""
    real_fuse, real_cat = loader.fuse, torch.cat
    seen = {"before": 0, "peak": 0, "largest": 0}
    originals: list[weakref.ref] = []
    held: list[torch.nn.Module] = []

    def live() -> int:
        """Bytes of the distinct storages still alive: the pre-fusion weights nothing freed yet
        and whatever the model holds now (its fused weights among them)."""
        tensors = [t for t in (ref() for ref in originals) if t is not None]
        tensors += list(held[0].parameters()) + list(held[0].buffers())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def counting_cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        seen["peak"] = max(seen["peak"], live() + out.nbytes)
        seen["largest"] = max(seen["largest"], out.nbytes)
        return out

    def watched_fuse(model):
        held.append(model)
        originals.extend(weakref.ref(p) for p in model.parameters())
        seen["before"] = live()
        monkeypatch.setattr(torch, "cat", counting_cat)
        try:
            real_fuse(model)
        finally:
            monkeypatch.setattr(torch, "cat", real_cat)

    monkeypatch.setattr(loader, "fuse", watched_fuse)
    models.load(path, dtype=torch.bfloat16)  # (a copy of the fp32 file's tensors: none shared with it)
    return seen["before"], seen["peak"], seen["largest"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_fuse_frees_parts_as_it_goes(tmp_path, monkeypatch, kind):
    path = write_checkpoint(kind, str(tmp_path / kind), num_hidden_layers=4, tie_word_embeddings=False)
    before, peak, largest = _peak_during_fuse(monkeypatch, path)
    assert largest > 0, "nothing was fused: the test would prove nothing"
    assert peak <= before + largest, (
        f"peak {peak} bytes during fuse against {before} of weights: pre-fusion parts kept alive")
