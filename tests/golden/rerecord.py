"""Re-record the golden recordings from their scripts, report what changed, and replay them.

    python tests/golden/rerecord.py            # from the repository root (or `make golden`)
Each scripts/NAME.yaml is run with `chat run` and written to recordings/NAME.yaml (with the current
sampler, version 2, unless the script names another); for every recording that existed before, the
report names the turns whose prompt or generated ids changed, and whether the model fingerprint or
the sampler version changed. Then `chat replay recordings/` replays them all as a suite (its table;
the exit status is the suite's).
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)


def turns(rec):
    return [e.result for e in rec.events if e.result is not None]


def compare(old, new) -> list[str]:
    notes = []
    if old.model.get("fingerprint") != new.model.get("fingerprint"):
        notes.append("model fingerprint changed")
    if old.sampler_to_replay != new.sampler_to_replay:
        notes.append(f"sampler version {old.sampler_to_replay} -> {new.sampler_to_replay}")
    a, b = turns(old), turns(new)
    if len(a) != len(b):
        notes.append(f"{len(a)} turns before, {len(b)} now")
    for i, (x, y) in enumerate(zip(a, b), start=1):
        for key in ("prompt_ids", "generated_ids"):
            if x[key] != y[key]:
                j = next((k for k, (p, q) in enumerate(zip(x[key], y[key])) if p != q), min(len(x[key]), len(y[key])))
                notes.append(f"turn {i}: {key} differ from index {j}")
    return notes


def main() -> int:
    os.chdir(ROOT)
    from chat import transcript as tr
    from chat.__main__ import main as chat_main

    changed = 0
    for script in sorted(glob.glob(os.path.join(HERE, "scripts", "*.yaml"))):
        name = os.path.basename(script)
        target = os.path.join(HERE, "recordings", name)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, name)
            with open(os.devnull, "w") as null:
                saved, sys.stdout = sys.stdout, null
                try:
                    rc = chat_main(["run", os.path.relpath(script, ROOT), "-o", out])
                finally:
                    sys.stdout = saved
            if rc != 0:
                print(f"{name}: chat run failed (exit {rc})")
                return rc
            new = tr.load(out)
            if os.path.exists(target):
                notes = compare(tr.load(target), new)
                print(f"{name}: " + ("unchanged" if not notes else "; ".join(notes)))
                changed += bool(notes)
            else:
                print(f"{name}: new recording")
                changed += 1
            tr.write_atomic(target, open(out, encoding="utf-8").read())
    print(f"{changed} recording(s) changed; replaying them:")
    sys.stdout.flush()
    return chat_main(["replay", os.path.relpath(os.path.join(HERE, "recordings"), ROOT)])


if __name__ == "__main__":
    sys.exit(main())
