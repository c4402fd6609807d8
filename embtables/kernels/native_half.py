"""The native kernels of half-precision tables (docs/spec.md §12): the pooled lookup from bfloat16 / float16
rows and phase 2 of a lazy update that reads half rows (and half or float32 slots) into float32, runs the
optimizer's float32 row function and rounds what it writes, stochastically or to nearest, with the bits of
(seed, step, table, global row, column). No float32 copy of a table is made.

Every buffer is checked here, in the call that hands it to C; C re-checks every id, offset and prepared row
against V. Shapes: V rows, D columns, N ids, S bags, U prepared rows.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from embtables.kernels.native import Workspace, library, require, threads
from embtables.kernels.native_abi import NativeBufferError, raise_for

KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # C's storage kinds


def half_kind(t: Tensor) -> int:
    """The C kind of a half-precision CPU table or slot (0 bfloat16, 1 float16); raises for anything else."""
    kind = KINDS.get(t.dtype, -1)
    if kind not in (0, 1):
        raise NativeBufferError(f"embtables native kernel: {t.dtype} is not a half type.")
    return kind


def lookup_half(table: Tensor, ids: Tensor, offsets: Tensor, coeffs: Tensor | None) -> tuple[Tensor, int]:
    """The pooled activations [S, D] float32 of ``ids`` [N] in bags ``offsets`` [S+1] (``coeffs`` [N] | None)
    from a half-precision ``table`` [V, D]. Returns the output and a status: 0 ok, 1 an id outside [0, V) or
    bad offsets (the output is unusable), 2 a non-finite activation."""
    lib = library()
    assert lib is not None
    kind = half_kind(table)
    require(table, "table", table.dtype, (-1, -1))
    require(ids, "ids", torch.int64, (-1,))
    require(offsets, "offsets", torch.int64, (-1,))
    if coeffs is not None:
        require(coeffs, "coefficients", torch.float32, (ids.numel(),))
    if offsets.numel() < 1:
        raise NativeBufferError("embtables native kernel: offsets need at least one entry.")
    vocab, dim = table.shape
    bags = offsets.numel() - 1
    out = torch.empty((bags, dim), dtype=torch.float32)
    status = lib.et_lookup_half(
        table.data_ptr(), kind, dim, vocab, ids.data_ptr(), ids.numel(), offsets.data_ptr(), bags,
        None if coeffs is None else coeffs.data_ptr(), out.data_ptr(), threads(),
    )  # fmt: skip
    return out, int(status)


def apply_half(
    ws: Workspace,
    weights: Tensor,
    slots: tuple[Tensor, ...],
    params: Any,
    global_rows: Tensor | None,
    rounding: tuple[int, int, int, bool],
    *,
    write: bool,
) -> int:
    """Phase 2 of a lazy update of a half-precision table from its prepared workspace ``ws``: ``weights``
    [V, D] (bfloat16 / float16), ``slots`` (each [V, D], one storage type: half or float32), ``params`` the
    optimizer's C block, ``global_rows`` [V] the global id of every local row (None: the rows are global),
    ``rounding`` = (seed, step, table index, stochastic). ``write=False``: a dry run (nothing written);
    returns -1 when every rounded value is finite, else the largest row whose update is not. ``write=True``:
    the update written (-1)."""
    lib = library()
    assert lib is not None
    wkind = half_kind(weights)
    require(weights, "weights", weights.dtype, (-1, ws.dim))
    vocab = weights.shape[0]
    if len(slots) > 3 or len({s.dtype for s in slots}) > 1:
        raise NativeBufferError("embtables native kernel: at most 3 slots, all of one storage type.")
    skind = KINDS.get(slots[0].dtype, -1) if slots else 2
    if skind < 0:
        raise NativeBufferError(f"embtables native kernel: slots of {slots[0].dtype} are not stored by the kernels.")
    ptrs: list[int | None] = [None, None, None]
    for i, s in enumerate(slots):
        require(s, f"slot {i}", s.dtype, tuple(weights.shape))
        ptrs[i] = s.data_ptr()
    if global_rows is not None:
        require(global_rows, "global rows", torch.int64, (vocab,))
    seed, step, table, stochastic = rounding
    result = lib.et_apply_half(
        ws.handle, weights.data_ptr(), *ptrs, wkind, skind, vocab, ws.dim, ctypes.byref(params),
        None if global_rows is None else global_rows.data_ptr(), vocab if global_rows is not None else 0,
        seed, step, table, int(stochastic), int(write), threads(),
    )  # fmt: skip
    bad = int(result)
    if bad < -1:
        raise_for("et_apply_half", bad)
    return bad
