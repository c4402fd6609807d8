"""The native kernels of half-precision tables (docs/spec.md §12): the pooled lookup from bfloat16 / float16
rows and phase 2 of a lazy update that reads half rows (and half or float32 slots) into float32, runs the
optimizer's float32 row function and rounds what it writes, stochastically or to nearest, with the bits of
(seed, step, table, global row, column). No float32 copy of a table is made.

Every buffer is checked here, in the call that hands it to C; C re-checks every id, offset and prepared row
against V. Shapes: V rows, D columns, N ids, S bags, U prepared rows.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.kernels import storage_types
from embtables.kernels.affine_rows import AffineRows, GlobalRows
from embtables.kernels.native import Bags, Workspace, library, require, threads
from embtables.kernels.native_abi import NativeBufferError, raise_for, unchecked
from embtables.kernels.native_args import array
from embtables.kernels.native_step import StagedBags, TableArrays, column_block_outputs

KINDS = {t.dtype: t.c_kind for t in storage_types.STORAGE_TYPES}  # C's storage kinds


def half_kind(t: Tensor) -> int:
    """The C kind of a half-precision CPU table or slot (``StorageType.c_kind``); raises for anything else."""
    record = storage_types.BY_DTYPE.get(t.dtype)
    if record is None or not record.half:
        raise NativeBufferError(f"embtables native kernel: {t.dtype} is not a half type.")
    return record.c_kind


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
        array("half.out", vp, [o.data_ptr() for o in outs]), array("half.ld", c64, dims), threads(),
    )  # fmt: skip
    return outs, int(status)


class HalfUpdate:
    """Phase 2 of a lazy update of a half-precision table from its prepared workspace ``ws``: ``compute`` (the
    rounded rows into scratch; the table unchanged) then ``write`` (the scratch into the table), or
    ``apply_in_place`` (one pass, the stored rows kept in scratch) and, when refused, ``put_back``.
    ``weights`` [V, D] are bfloat16 / float16, ``slots`` (each [V, D]) all of one storage type (half or
    float32), ``params`` the optimizer's C block, ``global_rows`` [V] the global id of every local row (or
    its ``AffineRows``; None: the rows are global), ``rounding`` = (seed, step, table index, stochastic)."""

    def __init__(
        self,
        ws: Workspace,
        weights: Tensor,
        slots: tuple[Tensor, ...],
        params: Any,
        global_rows: GlobalRows | None,
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
        skind = KINDS.get(slots[0].dtype, -1) if slots else storage_types.FLOAT32.c_kind
        if skind < 0:
            raise NativeBufferError(
                f"embtables native kernel: slots of {slots[0].dtype} are not stored by the kernels."
            )
        ptrs: list[int | None] = [None, None, None]
        for i, s in enumerate(slots):
            require(s, f"slot {i}", s.dtype, tuple(weights.shape))
            ptrs[i] = s.data_ptr()
        grows = self.global_rows
        packed = grows.packed if isinstance(grows, AffineRows) else grows
        if isinstance(grows, Tensor):
            require(grows, "global rows", torch.int64, (vocab,))
        elif grows is not None:
            require(packed, "global rows", torch.int64, (2,))
        out = require(self.out, "scratch", torch.int16, (-1, ws.dim * (1 if skind == 2 else 1 + len(slots))))
        sout = self.sout
        if skind == 2 and slots:
            sout = require(sout, "slot scratch", torch.float32, (out.shape[0], len(slots), ws.dim))
        seed, step, table, stochastic = self.rounding
        result = lib.et_apply_half(
            ws.handle, weights.data_ptr(), *ptrs, wkind, skind, vocab, ws.dim, ctypes.byref(self.params),
            None if packed is None else packed.data_ptr(), _global_length(grows, vocab), seed, step, table,
            int(stochastic), mode, out.data_ptr(), None if sout is None else sout.data_ptr(), out.shape[0],
            threads(),
        )  # fmt: skip
        bad = int(result)
        if bad < -1:
            raise_for("et_apply_half", bad)
        return bad


_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class HalfStep:
    """The small-batch fast path's calls over T tables of which some are half-precision (``NativeFastPath``):
    every feature's lookup in one native call (``lookup``, ``et_lookup_half_many`` over the staged bags, float32
    tables' features pooled as the float32 lookup pools them) and phase 2 of every table's lazy update in one
    (``apply``, ``et_apply_half_many``), all or nothing: each half table's rows updated in place and checked as
    they are written, then the float32 tables' updates checked (as ``native_step.apply_checked`` checks them).
    Built once per ``TableArrays``; ``rounding`` per table: (seed, table index, stochastic). The scratch (each half
    table's stored rows, to put back) is kept between steps, grown when a step prepares more rows."""

    def __init__(self, arrays: TableArrays, rounding: Sequence[tuple[int, int, bool]]) -> None:
        count = arrays.count
        if len(rounding) != count:
            raise NativeBufferError("embtables native kernel: one rounding per table is needed.")
        self.arrays = arrays
        wkinds, skinds, self.wide, self.float_slots = [], [], [], []
        for t in range(count):
            at = arrays.weight_at[t]
            slots = arrays.tensors[at + 1 : arrays.weight_at[t + 1] if t + 1 < count else len(arrays.tensors)]
            weights = arrays.tensors[at]
            if weights.dtype == torch.float32:  # TableArrays checked its slots: float32, shaped like it
                wkinds.append(storage_types.FLOAT32.c_kind)
                skinds.append(storage_types.FLOAT32.c_kind)
                self.wide.append(0)  # no scratch: a float32 table's check keeps its own
                self.float_slots.append(0)
                continue
            wkinds.append(half_kind(weights))
            skind = KINDS.get(slots[0].dtype, -1) if slots else storage_types.FLOAT32.c_kind
            if skind < 0 or len(slots) > 3 or len({x.dtype for x in slots}) > 1:
                raise NativeBufferError("embtables native kernel: at most 3 slots, all of one storage type.")
            skinds.append(skind)
            dim = int(arrays.dims[t])
            self.wide.append(dim * (1 if skind == 2 else 1 + len(slots)))
            self.float_slots.append(len(slots) if skind == 2 else 0)
        self.wkind = (_I32 * count)(*wkinds)
        self.fkind = (_I32 * arrays.features)(*[wkinds[t] for t in arrays.feature_tables])
        self.skind = (_I32 * count)(*skinds)
        self.seed = (_I64 * count)(*[r[0] for r in rounding])
        self.table = (_I64 * count)(*[r[1] for r in rounding])
        self.stochastic = (_I32 * count)(*[int(r[2]) for r in rounding])
        self.bad = (_I64 * count)()
        self.half = [w != storage_types.FLOAT32.c_kind for w in wkinds]
        self.mixed = not all(self.half)
        self._out: list[Tensor] = [torch.empty(0, dtype=torch.int16)] * count
        self._sout: list[Tensor | None] = [None] * count
        # "D" of one for each half table, 0 for a float32 one: et_prepared_values_max gives the most rows a half
        # table prepared
        self._ones = (_I64 * count)(*[int(h) for h in self.half])
        # D of each float32 table, 0 for a half one: the size of the float32 updates alone
        # (``native_step.updates_fit_checking``)
        self.float_dims = (_I64 * count)(*[0 if h else int(arrays.dims[t]) for t, h in enumerate(self.half)])
        self._fewest = 0  # the fewest rows any half table's scratch holds
        self._scratch: tuple[Any, Any, Any] = self._scratch_arrays()
        self._grows: tuple[tuple[GlobalRows | None, ...], Any, Any] = ((), None, None)
        self._no_maps = ((_VP * count)(), (_I64 * count)())  # every table's rows global: NULL maps of length 0

    def _scratch_arrays(self) -> tuple[Any, Any, Any]:
        """(out, sout, rows of scratch) as ctypes arrays over the current scratch tensors."""
        count = self.arrays.count
        out = (_VP * count)(*[o.data_ptr() for o in self._out])
        sout = (_VP * count)(*[None if s is None else s.data_ptr() for s in self._sout])
        rows = (_I64 * count)(*[o.shape[0] for o in self._out])
        self._fewest = min((n for n, h in zip(rows, self.half) if h), default=0)
        return out, sout, rows

    def _fit_scratch(self) -> None:
        """Every table's scratch holds at least its prepared rows (grown by half again when it does not)."""
        lib = library()
        assert lib is not None
        arrays = self.arrays
        if int(unchecked(lib).et_prepared_values_max(arrays.count_c, arrays.handles, self._ones)) <= self._fewest:
            return  # one call: no table prepared more rows than the smallest scratch holds
        grown = False
        for t, ws in enumerate(self.arrays.workspaces):
            rows = ws.num_rows
            if self.half[t] and self._out[t].shape[0] < rows:
                cap = max(rows + rows // 2, 1)
                self._out[t] = torch.empty((cap, self.wide[t]), dtype=torch.int16)
                k = self.float_slots[t]
                self._sout[t] = torch.empty((cap, k, ws.dim), dtype=torch.float32) if k else None
                grown = True
        if grown:
            self._scratch = self._scratch_arrays()

    def _global_rows(self, global_rows: Sequence[GlobalRows | None]) -> tuple[Any, Any]:
        """(row maps, their lengths) as ctypes arrays: each table's global id [V] of every local row (checked
        here, every call), its pair [first, stride] and -1 (``AffineRows``), or NULL and 0 (its rows are
        global)."""
        held = self._grows
        if len(held[0]) == len(global_rows) and all(a is b for a, b in zip(held[0], global_rows)):
            maps = held
        else:
            packed = [g.packed if isinstance(g, AffineRows) else g for g in global_rows]
            ptrs = (_VP * self.arrays.count)(*[None if g is None else g.data_ptr() for g in packed])
            lengths = [_global_length(g, int(v)) for g, v in zip(global_rows, self.arrays.vocab)]
            sizes = (_I64 * self.arrays.count)(*lengths)
            maps = self._grows = (tuple(global_rows), ptrs, sizes)
        for t, g in enumerate(global_rows):
            if isinstance(g, AffineRows):
                maps[1][t] = require(g.packed, "global rows", torch.int64, (2,)).data_ptr()
            elif g is not None:
                require(g, "global rows", torch.int64, (int(self.arrays.vocab[t]),))
                maps[1][t] = g.data_ptr()  # a tensor changed in place keeps its address; one set again would not
        return maps[1], maps[2]

    def lookup(
        self, bags: StagedBags, into: Tensor | None = None, starts: Sequence[int] | None = None
    ) -> list[Tensor] | None:
        """Every feature's pooled activations [S_f, D_f] float32 from the staged ``bags`` (one per feature of the
        arrays), or None when an id is outside its table or an activation is not finite (the general lookup then
        raises, naming the feature). With ``into`` [S, W] and ``starts``: into its column blocks
        ``into[:, starts[f] : starts[f] + D_f]`` (the concatenated activations; every feature has S bags), and
        returns ``[into]``."""
        arrays = self.arrays
        bags.check()
        if len(bags.views) != arrays.features:
            raise NativeBufferError("embtables native kernel: the staged bags are not one per feature of the tables.")
        dims, count = list(arrays.fdims), arrays.features
        if into is not None:
            out, ld = column_block_outputs(arrays, bags.n_bags, into, starts or ())
            outs = [into]
        else:
            if count and bags.alike_bags >= 0 and dims.count(dims[0]) == count:  # every output [S, D]: one block
                outs = list(torch.empty((count, bags.alike_bags, dims[0]), dtype=torch.float32).unbind(0))
            else:
                outs = [torch.empty((n, d), dtype=torch.float32) for n, d in zip(bags.n_bags, dims)]
            out = (_VP * count)(*[o.data_ptr() for o in outs])
            ld = arrays.fdims
        lib = library()
        assert lib is not None
        status = unchecked(lib).et_lookup_half_many(
            arrays.features_c, arrays.fw, self.fkind, arrays.fdims, arrays.fvocab, bags.ids, bags.n_ids, bags.offsets,
            bags.n_bags, bags.coeffs, out, ld, ctypes.c_int(threads()),
        )  # fmt: skip
        return outs if int(status) == 0 else None

    def apply(self, params: Any, global_rows: Sequence[GlobalRows | None] | None, step: int) -> list[int]:
        """Write every table's prepared update; per table the largest row whose update is not finite (a float32
        table's: one such row; -1: none; when any is not -1, nothing was written). ``params``: a ctypes array of
        the tables' optimizer blocks' addresses (``native_step.apply_checked``'s), ``global_rows`` [V_t] int64,
        ``AffineRows`` or None per table (None for all: every table's rows are global)."""
        arrays = self.arrays
        if global_rows is not None and len(global_rows) != arrays.count:
            raise NativeBufferError("embtables native kernel: one row map (or None) per table is needed.")
        self._fit_scratch()
        grows, nglobal = self._no_maps if global_rows is None else self._global_rows(global_rows)
        out, sout, rows = self._scratch
        s0, s1, s2 = arrays.s
        lib = library()
        assert lib is not None
        code = unchecked(lib).et_apply_half_many(
            arrays.count_c, arrays.handles, arrays.w, s0, s1, s2, self.wkind, self.skind, arrays.vocab, arrays.dims,
            params, grows, nglobal, self.seed, _I64(step), self.table, self.stochastic, out, sout, rows,
            ctypes.c_int(threads()), self.bad,
        )  # fmt: skip
        raise_for("et_apply_half_many", int(code))
        return list(self.bad)


def _rows_of(scratch: dict[str, Tensor] | None, name: str, n: int, dtype: torch.dtype) -> Tensor:
    """n elements of ``dtype`` [n]: the front of ``scratch[name]`` (grown to at least 1.5 n when smaller), or a
    new tensor without ``scratch``."""
    if scratch is None:
        return torch.empty(n, dtype=dtype)
    held = scratch.get(name)
    if held is None or held.dtype != dtype or held.numel() < n:
        held = scratch[name] = torch.empty(max(n + n // 2, 1), dtype=dtype)
    return held[:n]


def _global_length(grows: GlobalRows | None, vocab: int) -> int:
    """The length C is given with a table's row map: -1 for the pair of ``AffineRows``, ``vocab`` for one id a
    local row (checked to be [vocab] before each call), 0 for none."""
    if grows is None:
        return 0
    return -1 if isinstance(grows, AffineRows) else vocab
