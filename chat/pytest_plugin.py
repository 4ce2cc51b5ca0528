"""pytest plugin: `pytest --chat-recordings PATH` makes each recording a test item.

Registered by the `pytest11` entry point in pyproject.toml, so it loads wherever chat is installed
and does nothing without the option. Each recording (a file, or a directory's *.yaml and *.yml)
becomes the item `PATH::replay`, replayed as `chat replay` replays it (`--chat-tolerance MARGIN`:
teacher-forced; `--chat-runs N`: runs on the reused session). Items with the same engine settings
run one after another and share one model load. A divergence or an invalid recording fails its
item with the report as the failure text; near ties are a report section of a passing item.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

_CACHE = pytest.StashKey()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("chat recordings")
    group.addoption("--chat-recordings", action="append", default=[], metavar="PATH",
                    help="replay these chat recordings (files, or directories of *.yaml) as test items")
    group.addoption("--chat-tolerance", type=float, default=None, metavar="MARGIN",
                    help="teacher-forced replay: a different choice within MARGIN (log-probability) is a near tie")
    group.addoption("--chat-runs", type=int, default=1, metavar="N",
                    help="replay runs on the reused session after the fresh one (default 1)")


class RecordingFailed(Exception):
    def __init__(self, outcome):
        super().__init__(outcome.result)
        self.outcome = outcome


class RecordingItem(pytest.Item):
    def __init__(self, *, entry, **kwargs):
        super().__init__(**kwargs)
        self.entry = entry

    def runtest(self) -> None:
        from .suite import DIVERGENCE, INVALID, NEAR_TIES, RuntimeCache, replay_one

        cache = self.config.stash.setdefault(_CACHE, RuntimeCache())
        outcome = replay_one(self.entry, cache, self.config.getoption("chat_runs"),
                             self.config.getoption("chat_tolerance"))
        if outcome.status == NEAR_TIES:
            self.add_report_section("call", "near ties", f"{outcome.result}:\n{outcome.report}")
        if outcome.status in (DIVERGENCE, INVALID):
            raise RecordingFailed(outcome)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, RecordingFailed):
            return excinfo.value.outcome.report
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"chat replay {self.entry.path}"


class RecordingFile(pytest.File):
    def __init__(self, *, entry, **kwargs):
        super().__init__(**kwargs)
        self.entry = entry

    def collect(self):
        yield RecordingItem.from_parent(self, name="replay", entry=self.entry)


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: they apply to these items too
def pytest_collection_modifyitems(session, config, items) -> None:
    paths = config.getoption("chat_recordings")
    if not paths:
        return
    from .__main__ import settings_for
    from .suite import expand, grouped, load_entry

    runs, tolerance = config.getoption("chat_runs"), config.getoption("chat_tolerance")
    if runs < 0 or (tolerance is not None and not tolerance >= 0):
        raise pytest.UsageError("--chat-runs must be 0 or more and --chat-tolerance a margin >= 0")
    no_flags = argparse.Namespace(config=None)  # the config file and CHAT_* variables, as `chat replay` reads them
    entries = [load_entry(p, lambda rec: settings_for(no_flags, rec)) for p in expand(paths)]
    for i in grouped(entries):  # one engine setting's recordings together: one model load each
        path = entries[i].path  # the node id as given: pytest's own is "::NAME" outside the rootdir
        file = RecordingFile.from_parent(session, path=Path(path).resolve(), entry=entries[i],
                                         nodeid=Path(os.path.normpath(path)).as_posix())
        items.extend(file.collect())


def pytest_sessionfinish(session) -> None:
    cache = session.config.stash.get(_CACHE, None)
    if cache is not None:
        cache.close()
