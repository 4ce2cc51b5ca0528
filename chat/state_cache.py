"""The REPL's saved session state: after each autosave of a conversation, the session's state
at its cached length (KV, conv and recurrent state) is written beside the recording
(`<recording>.state`, engine/state_file.py) by a thread, so the next turn does not wait for it;
`chat --resume` maps it back and the conversation goes on with no prefill.

Bounded by `state_cache_mib` (0: never written): a state larger than that is not written, and
an older file of that conversation is removed (it would no longer be the newest state). CPU and
CUDA sessions alike (a CUDA session's state is copied to the host for the thread, and read back
into its buffers in place, which its captured graph reads). A file is used only where
engine/state_file.py finds it whole and made by this model, dtype, device kind, instruction set
(the CPU's; on CUDA the GPU's name) and engine; otherwise the resume says why and prefills as
before.
"""
from __future__ import annotations

import math
import os
import threading

from engine import state_file

SUFFIX = ".state"


def state_path(recording: str) -> str:
    return recording + SUFFIX


def _fingerprint(controller) -> dict[str, str]:
    from .transcript import cpu_isa, model_info
    session = controller.session
    if session.device.type == "cuda":  # (the GPU's kernels sum in their own order: its name, not the CPU's set)
        import torch
        fp = state_file.fingerprint(model_info(controller.rt)["fingerprint"], session, "")
        fp["gpu"] = torch.cuda.get_device_name(session.device)
        return fp
    return state_file.fingerprint(model_info(controller.rt)["fingerprint"], session, cpu_isa())


def _sharded(controller) -> bool:
    """Whether the session is split over tensor-parallel processes: this process holds its shard
    of the state only, and a resume would load it into rank 0 alone (the workers' caches empty),
    so such a session neither saves nor resumes a state file."""
    return controller.settings.engine.tensor_parallel > 1


def _nbytes(session) -> int:
    layout = session.state.layout(session.state.length)
    return sum(dtype.itemsize * math.prod(shape) for shape, dtype in layout.values())


class StateSaver:
    """One write at a time, in a thread; the first failure is kept for one notice."""

    def __init__(self, budget_mib: int):
        self.budget = budget_mib << 20
        self._thread: threading.Thread | None = None
        self.failure: str | None = None

    def usable(self, controller) -> bool:
        return self.budget > 0 and controller.rt is not None and not _sharded(controller)

    def save(self, controller, recording: str) -> None:
        if not self.usable(controller):
            return
        path = state_path(recording)
        self.wait()
        if not controller.session.cached or _nbytes(controller.session) > self.budget:
            _remove(path)  # (an older state of this conversation is not its newest)
            return
        ids, tensors = state_file.snapshot(controller.session)  # (copies: the session goes on)
        fp = _fingerprint(controller)

        def run():
            try:
                state_file.write(path, ids, tensors, fp)
            except OSError as e:
                self.failure = f"cannot save the session's state beside {recording}: {e.strerror or e}"
        self._thread = threading.Thread(target=run, name="state-save")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def resume(controller, recording: str) -> str | None:
    """Load the saved state beside `recording` into the session, where it checks: the notice to
    show (resumed from it, or why the next turn prefills); None where there is no such file."""
    path = state_path(recording)
    if not os.path.lexists(path):
        return None
    if _sharded(controller):
        return ("saved state not used: a tensor-parallel session holds a shard of it in each process; "
                "the next turn prefills the conversation")
    try:
        n = state_file.read(path, controller.session, _fingerprint(controller))
    except state_file.StateFileError as e:
        return f"saved state not used: {e}; the next turn prefills the conversation"
    return f"resumed from saved state: {n} tokens, no prefill"


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_beside(recording: str) -> None:
    """Remove a recording's saved state (the recording was pruned)."""
    _remove(state_path(recording))
