"""Saved conversations: the REPL's conversation kept on disk as it goes, so nothing is lost.

Contract: `ConversationStore.save(controller)` writes the conversation as a recording (the format
of /save and `chat run -o`, so a saved conversation replays) into `directory`, atomically: a
process killed at any moment leaves the previous complete file or the new one, never a torn one.
One file per conversation, named by when it started; /reset and /model begin a new file. Files
beyond `keep` are pruned, oldest first (never the current one). `latest()` and `entries()` read
back what is there for `chat --resume` and /history; unreadable files are skipped, not fatal.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from . import transcript as tr
from .state_cache import remove_beside

SUFFIX = ".yaml"
STALE_SECONDS = 600  # (a temporary older than this belongs to a write that will never finish)


def default_directory(configured: str = "") -> str:
    if configured:
        return os.path.expanduser(configured)
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "chat", "conversations")


def directory_problem(path: str) -> str | None:
    """Why conversations cannot be saved in `path` (it, or the nearest part of it that exists, is
    not a writable directory), or None."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    if not os.path.isdir(probe):
        return "is not a directory" if probe == os.path.abspath(path) else f"cannot be made: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "is not writable" if probe == os.path.abspath(path) else f"cannot be made: {probe} is not writable"
    return None


@dataclass
class Entry:
    path: str
    mtime: float
    turns: int
    model: str
    first: str  # the first user message, for the listing


class ConversationStore:
    def __init__(self, directory: str, keep: int):
        self.directory = directory
        self.keep = keep
        self.path: str | None = None  # the current conversation's file, once it has a turn
        self._saved: tuple | None = None

    @property
    def enabled(self) -> bool:
        return self.keep > 0

    def continue_file(self, path: str) -> None:
        """Go on saving into an existing file (`chat --resume`)."""
        self.path = os.path.abspath(path)
        self._saved = None

    def begin_new(self) -> None:
        """The next save starts a new file (after /reset, or a model switch)."""
        self.path = None
        self._saved = None

    def _new_path(self) -> str:
        stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
        base = os.path.join(self.directory, f"{stamp}-{os.getpid()}")
        path, n = base + SUFFIX, 1
        while os.path.exists(path):
            path, n = f"{base}-{n}{SUFFIX}", n + 1
        return path

    @staticmethod
    def _signature(controller) -> tuple:
        """What a save would write, cheaply: the turns, the system prompt and the settings."""
        return (controller.tree_signature(), controller.conv.system_prompt,
                tuple(sorted(controller.sampling_dict().items())), id(controller.rt))

    def save(self, controller) -> str | None:
        """Write the conversation if it has a turn and changed since the last save; returns the
        path written, or None. OSError propagates (the caller reports it in one line)."""
        if not self.enabled or not controller.turns:
            return None
        sig = self._signature(controller)
        if sig == self._saved and self.path is not None:
            return None
        if self.path is None:
            os.makedirs(self.directory, exist_ok=True)
            self.path = self._new_path()
        tr.save_controller(controller, self.path)
        self._saved = sig
        self.prune()
        return self.path

    def _files(self) -> list[tuple[float, str]]:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        out = []
        for name in names:
            path = os.path.join(self.directory, name)
            if name.endswith(SUFFIX) and not name.startswith(".") and os.path.isfile(path):
                try:
                    out.append((os.path.getmtime(path), path))
                except OSError:
                    continue
        return sorted(out, reverse=True)  # newest first

    def prune(self) -> None:
        """Keep the newest `keep` conversations (and their saved states); remove the temporaries
        of writes a killed process left, once they are old enough to be no one's write in flight."""
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(".tmp-")]
        except OSError:
            names = []
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                if time.time() - os.path.getmtime(path) > STALE_SECONDS:
                    os.unlink(path)
            except OSError:
                pass
        files = [p for _, p in self._files() if p != self.path]
        for path in files[max(self.keep - 1, 0):]:
            try:
                os.unlink(path)
            except OSError:
                pass
            remove_beside(path)  # (its saved session state, if any)

    def latest(self) -> str | None:
        files = self._files()
        return files[0][1] if files else None

    def latest_readable(self) -> tuple[str | None, list[str]]:
        """The newest conversation that reads as a recording (`chat --resume`), and why each newer
        file was skipped: one torn or foreign file must not hide the conversations before it."""
        skipped = []
        for _, path in self._files():
            try:
                t = tr.load(path)
            except tr.TranscriptError as e:
                skipped.append(str(e))
                continue
            if not t.is_recording:
                skipped.append(f"{path}: not a recording")
                continue
            return path, skipped
        return None, skipped

    def entries(self) -> list[Entry]:
        out = []
        for mtime, path in self._files():
            try:
                t = tr.load(path)
            except tr.TranscriptError:
                continue
            users = [e.user for e in t.events if e.user is not None]
            n = sum(e.result is not None for e in t.events)
            out.append(Entry(path, mtime, n, str(t.model.get("source", "?")), users[0] if users else ""))
        return out
