"""The C++ library's ops on the CPU: the whole decode step of a model (`decode_step`), and where
it does not serve, the per-linear kernels of its GGUF blocks (`block_kernels`); with the
predicates the architectures offer them by, the planner's rules (models/plan/serving.py;
models/kernels/__init__.py holds the kernels' contracts)."""
from __future__ import annotations

from ..kernels import cpu_block_kernels as block_kernels, cpu_decode_step as decode_step, cpu_kernels_off as kernels_off
from ..plan.serving import cpu_blocks_served as blocks_served, cpu_rows16_types as rows16_types
from ..plan.serving import cpu_step_serves as step_serves

__all__ = ["block_kernels", "blocks_served", "decode_step", "kernels_off", "rows16_types", "step_serves"]
