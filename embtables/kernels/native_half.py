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

from embtables.kernels.native import Bags, Workspace, library, require, threads
from embtables.kernels.native_abi import NativeBufferError, raise_for
from embtables.kernels.native_args import array

KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # C's storage kinds


def half_kind(t: Tensor) -> int:
    """The C kind of a half-precision CPU table or slot (0 bfloat16, 1 float16); raises for anything else."""
    kind = KINDS.get(t.dtype, -1)
    if kind not in (0, 1):
        raise NativeBufferError(f"embtables native kernel: {t.dtype} is not a half type.")
    return kind


def lookup_half_many(parts: list[tuple[Tensor, Tensor, Tensor, Tensor | None]]) -> tuple[list[Tensor], int]:
    """Several features' pooled activations [S_f, D_f] float32 in one parallel region: for each ``(table [V, D]
    half, ids [N], offsets [S+1], coeffs [N] | None)``: each row read as float32, the bags summed in float32 in
    the float32 lookup's order. Returns the outputs and a status: 0 ok, 1 an id outside [0, V) or bad offsets
    (the outputs are unusable), 2 a non-finite activation."""
    lib = library()
    assert lib is not None
    bags = Bags()
    w_ptr, kinds, dims, vocab = [], [], [], []  # type: list[int], list[int], list[int], list[int]
    for table, ids, offsets, coeffs in parts:
        kinds.append(half_kind(table))
        require(table, "table", table.dtype, (-1, -1))
        bags.add(ids, offsets, coeffs)
        w_ptr.append(table.data_ptr())
        vocab.append(table.shape[0])
        dims.append(table.shape[1])
    outs = [torch.empty((n, d), dtype=torch.float32) for n, d in zip(bags.n_bags, dims)]
    vp, c64 = ctypes.c_void_p, ctypes.c_int64
    status = lib.et_lookup_half_many(
        len(parts), array("half.w", vp, w_ptr), array("half.kinds", ctypes.c_int32, kinds),
        array("half.dims", c64, dims), array("half.vocab", c64, vocab), array("half.ids", vp, bags.ids),
        array("half.n_ids", c64, bags.n_ids), array("half.offsets", vp, bags.offsets),
        array("half.n_bags", c64, bags.n_bags), array("half.coeffs", vp, bags.coeffs),
        array("half.out", vp, [o.data_ptr() for o in outs]), threads(),
    )  # fmt: skip
    return outs, int(status)


class HalfUpdate:
    """Phase 2 of a lazy update of a half-precision table from its prepared workspace ``ws``: ``compute`` (the
    rounded rows into scratch; the table unchanged) then ``write`` (the scratch into the table), or
    ``apply_in_place`` (one pass, the stored rows kept in scratch) and, when refused, ``put_back``.
    ``weights`` [V, D] are bfloat16 / float16, ``slots`` (each [V, D]) all of one storage type (half or
    float32), ``params`` the optimizer's C block, ``global_rows`` [V] the global id of every local row (None:
    the rows are global), ``rounding`` = (seed, step, table index, stochastic)."""

    def __init__(
        self,
        ws: Workspace,
        weights: Tensor,
        slots: tuple[Tensor, ...],
        params: Any,
        global_rows: Tensor | None,
        rounding: tuple[int, int, int, bool],
    ) -> None:
        self.ws, self.weights, self.slots, self.params = ws, weights, slots, params
        self.global_rows, self.rounding = global_rows, rounding
        self.out: Tensor | None = None
        self.sout: Tensor | None = None

    def compute(self, scratch: dict[str, Tensor] | None = None) -> int:
        """Every prepared row's update, rounded, into scratch: -1 when every value is finite, else the largest
        row whose update is not (nothing is ever written by this call). ``scratch``: buffers kept by the
        caller between steps (``"out"``, ``"sout"``: grown here when too small, their first rows used)."""
        self._scratch(scratch)
        return self._call(0)

    def _scratch(self, scratch: dict[str, Tensor] | None) -> None:
        ws, slots = self.ws, self.slots
        rows = ws.num_rows
        float_slots = bool(slots) and slots[0].dtype == torch.float32
        wide = ws.dim * (1 if float_slots else 1 + len(slots))
        self.out = _rows_of(scratch, "out", rows * wide, torch.int16).view(rows, wide)
        self.sout = (
            _rows_of(scratch, "sout", rows * len(slots) * ws.dim, torch.float32).view(rows, len(slots), ws.dim)
            if float_slots
            else None
        )

    def write(self) -> None:
        """The scratch of ``compute`` into the table (its rows and the workspace unchanged since)."""
        if self.out is None:
            raise NativeBufferError("embtables native kernel: a half-precision update is written before computed.")
        self._call(1)

    def apply_in_place(self, scratch: dict[str, Tensor] | None = None) -> int:
        """The update written in place, each row's stored values kept in scratch first: -1 when every written
        value is finite, else the largest row whose update is not (then ``put_back`` must run)."""
        self._scratch(scratch)
        return self._call(2)

    def put_back(self) -> None:
        """The rows ``apply_in_place`` changed, back to what they held (the workspace unchanged since)."""
        if self.out is None:
            raise NativeBufferError("embtables native kernel: a half-precision update is put back before applied.")
        self._call(3)

    def _call(self, mode: int) -> int:
        lib = library()
        assert lib is not None
        ws, weights, slots = self.ws, self.weights, self.slots
        wkind = half_kind(weights)
        require(weights, "weights", weights.dtype, (-1, ws.dim))
        vocab = weights.shape[0]
        if len(slots) > 3 or len({s.dtype for s in slots}) > 1:
            raise NativeBufferError("embtables native kernel: at most 3 slots, all of one storage type.")
        skind = KINDS.get(slots[0].dtype, -1) if slots else 2
        if skind < 0:
            raise NativeBufferError(
                f"embtables native kernel: slots of {slots[0].dtype} are not stored by the kernels."
            )
        ptrs: list[int | None] = [None, None, None]
        for i, s in enumerate(slots):
            require(s, f"slot {i}", s.dtype, tuple(weights.shape))
            ptrs[i] = s.data_ptr()
        grows = self.global_rows
        if grows is not None:
            require(grows, "global rows", torch.int64, (vocab,))
        out = require(self.out, "scratch", torch.int16, (-1, ws.dim * (1 if skind == 2 else 1 + len(slots))))
        sout = self.sout
        if skind == 2 and slots:
            sout = require(sout, "slot scratch", torch.float32, (out.shape[0], len(slots), ws.dim))
        seed, step, table, stochastic = self.rounding
        result = lib.et_apply_half(
            ws.handle, weights.data_ptr(), *ptrs, wkind, skind, vocab, ws.dim, ctypes.byref(self.params),
            None if grows is None else grows.data_ptr(), vocab if grows is not None else 0, seed, step, table,
            int(stochastic), mode, out.data_ptr(), None if sout is None else sout.data_ptr(), out.shape[0],
            threads(),
        )  # fmt: skip
        bad = int(result)
        if bad < -1:
            raise_for("et_apply_half", bad)
        return bad


def _rows_of(scratch: dict[str, Tensor] | None, name: str, n: int, dtype: torch.dtype) -> Tensor:
    """n elements of ``dtype`` [n]: the front of ``scratch[name]`` (grown to at least 1.5 n when smaller), or a
    new tensor without ``scratch``."""
    if scratch is None:
        return torch.empty(n, dtype=dtype)
    held = scratch.get(name)
    if held is None or held.dtype != dtype or held.numel() < n:
        held = scratch[name] = torch.empty(max(n + n // 2, 1), dtype=dtype)
    return held[:n]
