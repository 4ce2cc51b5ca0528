"""The C++ library's ops on the CPU: the whole decode step of a model (`decode_step`), and where
it does not serve, the per-linear kernels of its GGUF blocks (`block_kernels`); with the
predicates the architectures offer them by (models/kernels/__init__.py holds their contracts)."""
from __future__ import annotations

from ..kernels import cpu_block_kernels as block_kernels, cpu_blocks_served as blocks_served
from ..kernels import cpu_decode_step as decode_step, cpu_kernels_off as kernels_off, cpu_step_serves as step_serves

__all__ = ["block_kernels", "blocks_served", "decode_step", "kernels_off", "rows16_types", "step_serves"]


def rows16_types() -> tuple[int, ...]:
    """The ggml types whose 16-row interleaved forms the library built here computes."""
    from ..kernels.cpu import step
    return step.rows16_types()
