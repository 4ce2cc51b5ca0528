"""The session's state on disk: the KV cache up to the cached length and the conv / recurrent
state of a DecodeSession, written as a safetensors file, so a conversation resumes with no
prefill.

A file is trusted only when everything checks: its header (format, version), its fingerprint
(`fingerprint`: the model's files, dtype, the KV dtype, device kind and CPU kernels' instruction
set, the engine's version: any difference means other numbers), the token ids (of this model's
vocabulary), each tensor's name, shape and dtype (the session's state layout at that length), and
a sha256 over the tensors' bytes (a file cut short or damaged). Anything else is refused with
the reason, and the caller prefills as it would without a file. Files are written atomically
(a temporary beside the target, fsync, rename): a reader sees the old file or the new one.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from .files import write_atomic

FORMAT = "chat-state"
VERSION = "1"
# torch dtype → the name safetensors' header gives it
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class StateFileError(ValueError):
    """A state file that cannot be used here: the message says why (one line)."""


def fingerprint(model_fingerprint: str, session, cpu_isa: str = "") -> dict[str, str]:
    """What must be equal for a saved state to be this session's: the model, the compute and KV
    dtypes, the device kind, the CPU kernels' instruction set and the engine's version."""
    from importlib import metadata
    try:
        version = metadata.version("chat-engine")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"model": model_fingerprint, "dtype": str(session.dtype).replace("torch.", ""),
            "kv_dtype": str(session.state.kv_dtype).replace("torch.", ""), "device": session.device.type,
            "cpu_isa": cpu_isa, "engine": version, "max_context": str(session.max_context)}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def snapshot(session) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The state to write, copied now (the session may go on while a thread writes it)."""
    return session.export_state()


def write(path: str, ids: list[int], tensors: dict[str, torch.Tensor], fp: dict[str, str]) -> int:
    """Write a snapshot atomically; returns the bytes written."""
    from safetensors.torch import save_file
    meta = {"format": FORMAT, "version": VERSION, "ids": json.dumps(ids), "sha256": _digest(tensors),
            **{f"fp.{k}": v for k, v in fp.items()}}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta), suffix=".state")
    return os.path.getsize(path)


def read(path: str, session, fp: dict[str, str]) -> int:
    """Check the file at `path` against this session and, where everything holds, load it into the
    session; returns the tokens it holds. StateFileError names what does not hold (the session
    is then untouched)."""
    from safetensors import SafetensorError, safe_open
    if not os.path.isfile(path):
        raise StateFileError("no saved state beside the conversation")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise StateFileError(f"not a state file of this version ({meta.get('format')!r} "
                                     f"{meta.get('version')!r})")
            saved = {k[3:]: v for k, v in meta.items() if k.startswith("fp.")}
            for key, value in fp.items():
                if saved.get(key) != value:
                    raise StateFileError(f"it was saved with another {key} ({str(saved.get(key))[:40]!r}, "
                                         f"here {value[:40]!r})")
            ids = json.loads(meta.get("ids", "null"))
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise StateFileError("its token ids are not a list of ids")
            if not 0 < len(ids) < session.max_context:
                raise StateFileError(f"it holds {len(ids)} tokens, not a length this context of "
                                     f"{session.max_context} takes")
            # every tensor's name, shape and dtype before any is read: a file cannot make this
            # process allocate more than the state it would fill
            want = session.state.layout(len(ids))
            declared = {name: (tuple(sl.get_shape()), sl.get_dtype())
                        for name, sl in ((name, f.get_slice(name)) for name in f.keys())}
            expected = {name: (shape, _SAFETENSORS_DTYPES.get(dtype)) for name, (shape, dtype) in want.items()}
            if declared != expected:
                raise StateFileError("its tensors are not this session's state (names, shapes or dtypes differ)")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except StateFileError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise StateFileError(f"it does not read ({str(e).splitlines()[0][:120]})") from None
    if _digest(tensors) != meta.get("sha256"):
        raise StateFileError("its tensors do not match their checksum (damaged)")
    try:
        session.load_state(ids, tensors)
    except ValueError as e:
        raise StateFileError(str(e)) from None
    return len(ids)
