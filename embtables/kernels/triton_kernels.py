"""The fused GPU kernels (Triton): the pooled lookup of every feature in one launch, the per-row gradient
sums of a group of tables, and the fused sparse update of a group of tables for every optimizer.

Imported only through ``kernels/gpu.py``, which imports it when a CUDA table first needs it (Triton is
optional). The row math follows the native C kernels (``csrc/optimizer_rows.c``) line by line: the
same float32 constants (from each optimizer's kernel record), IEEE division and square roots
(``div_rn`` / ``sqrt_rn``; Triton's plain ``/`` is an approximate division) and no fused multiply-adds
(every launch passes ``enable_fp_fusion=False``), so a GPU table differs from a CPU one only where the
order of a sum differs or ``powf`` rounds differently. Dims: B bags, F features, N ids, U distinct rows,
D columns (padded to ``BLOCK_D``, a power of two).

Every kernel reads only what its masks allow: ids outside a table are never dereferenced (the lookup
flags them instead), and a program past the last distinct row does nothing.
"""

from __future__ import annotations

from embtables.kernels.triton_lookup import lookup_kernel, stage_kernel
from embtables.kernels.triton_row_sums import (
    gather_kernel,
    piece_join_kernel,
    piece_sums_kernel,
    run_starts_kernel,
    sort_marks_kernel,
)
from embtables.kernels.triton_update import update_kernel

__all__ = [
    "gather_kernel",
    "lookup_kernel",
    "piece_join_kernel",
    "piece_sums_kernel",
    "run_starts_kernel",
    "sort_marks_kernel",
    "stage_kernel",
    "update_kernel",
]
