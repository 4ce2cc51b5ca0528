"""gguf_tensors.release_pages: the load hands back the file pages it has copied, without losing data.

A GGUF's Q4_0/Q4_1 matrices and Q8_0 tables are copied into modules of their own at load; until
then their mapped pages count in the resident set, so the load's peak held both. release_pages
drops those pages from the process (never the contents: a later read faults them in again), and
leaves arrays that are not over a file mapping alone.
"""
from __future__ import annotations

import numpy as np
import pytest

from models.formats import gguf_tensors


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


def _linux_at_least(major: int, minor: int) -> bool:
    import platform
    try:
        return tuple(int(p) for p in platform.release().split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


@pytest.mark.skipif(gguf_tensors._libc() is None or not _linux_at_least(5, 4), reason="needs Linux 5.4's MADV_PAGEOUT")
def test_mapped_pages_leave_the_resident_set_and_read_back(tmp_path):
    path = tmp_path / "blocks.bin"
    data = np.random.default_rng(0).integers(0, 256, size=32 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    raw = mapped[4096:].reshape(-1, 1024)  # (a view, as GgufTensor.raw is)
    assert int(raw.sum(dtype=np.int64)) == int(data[4096:].sum(dtype=np.int64))  # every page resident
    before = _rss_file_kib()
    gguf_tensors.release_pages(raw)
    dropped = before - _rss_file_kib()
    assert dropped > (16 << 10), f"only {dropped} KiB of 32 MiB left the resident set"
    assert np.array_equal(np.asarray(raw).ravel(), data[4096:])  # read back from the file


def test_a_page_written_to_is_kept(tmp_path):
    """A copy-on-write page of the mapping that the load wrote to holds the only copy of that
    write: reclaiming it must not bring back the file's bytes."""
    path = tmp_path / "blocks.bin"
    np.zeros(1 << 20, dtype=np.uint8).tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    mapped[8192:8200] = 7
    gguf_tensors.release_pages(mapped)
    assert list(mapped[8192:8200]) == [7] * 8 and int(mapped.sum()) == 56


def test_arrays_not_over_a_file_are_left_alone():
    a = np.arange(1 << 20, dtype=np.uint8).reshape(1024, 1024)
    copy = a.copy()
    gguf_tensors.release_pages(a)
    gguf_tensors.release_pages(a[::2])  # (not contiguous)
    assert np.array_equal(a, copy)
