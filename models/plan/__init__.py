"""The kernel plan: which kernel serves each op of a loaded model, chosen once at load by one
planner from one table of rules (table.py) under one frozen KernelConfig (config.py). The
loader's callers bind a plan (`bind`: the weights a rule repacks are repacked then, and the
quantized modules' CUDA forms bound; `bind_forms` for a module built by hand); `chat plan`
prints one (report.py); /show and a recording's engine header carry its summary."""
from __future__ import annotations

from .config import DEFAULT, KernelConfig
from .planner import Choice, Plan, PlanError, bind, bind_forms, make, q4_in_blocks

__all__ = ["DEFAULT", "KernelConfig", "Choice", "Plan", "PlanError", "bind", "bind_forms", "make", "q4_in_blocks"]
