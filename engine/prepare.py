"""`python -m engine.prepare`: compile the C++ CPU decode step ahead of a first chat (`make chat`
runs it), into the cache folder and with the compiler this process's environment names
(engine/config.py's Environment, as chat itself takes them); prints the library's path, or why it
was not built (chat then decodes with the torch step, after a one-line note)."""
from __future__ import annotations

import sys

from .device import configure_process


def main() -> int:
    configure_process()
    from models import build_cpu_step
    return build_cpu_step()


if __name__ == "__main__":
    sys.exit(main())
