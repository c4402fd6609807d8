"""``NativeBackend``: the C kernels (``kernels/native.py``) on CPU tables: float32, and half-precision ones
(``kernels/native_half.py``: their lookups and lazy updates; spec §12).

Lookups of every feature in one parallel region; phase 1 (dedup, float32 sums, finiteness) of every
accumulated table in one call into per-table scratch workspaces; phase 2 of every table in one call.
Steps staged whole by one native call take the small-batch fast path (``native_fast_path.py``). The
finiteness proof reads bounds measured in the step that writes: over exactly the touched rows in C
(``Workspace.touched_bounds``), or by the exact dry run in the writing call when that is cheaper.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.kernels import native, native_half
from embtables.kernels.clip_decay import optimizer_decay
from embtables.kernels.finite_guard import update_is_finite
from embtables.kernels.native_abi import decode
from embtables.kernels.stochastic_rounding import HALF_TYPES
from embtables.tables.backends.interface import (
    GRADIENT_NOT_FINITE,
    INPUT_CHANGED,
    NOT_FINITE,
    OUT_OF_MEMORY,
    OUT_OF_RANGE,
    POOLED,
    PREPARED,
    BagPart,
    GradientPart,
    Lookup,
    Prepared,
    Restore,
    Update,
    input_changed,
)
from embtables.tables.backends.native_fast_path import NativeFastPath
from embtables.tables.backends.table_set import TableSet
from embtables.tables.backends.torch_backend import applied_with_backup
from embtables.tables.inputs import FeatureBatch
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import non_finite_gradient, non_finite_update

# The C statuses' meanings (``native_abi``) as the interface's statuses.
_POOL_STATUS = {"ok": POOLED, "out_of_range": OUT_OF_RANGE, "not_finite": NOT_FINITE}
_PREPARE_STATUS = {"ok": PREPARED, "not_finite": GRADIENT_NOT_FINITE, "out_of_memory": OUT_OF_MEMORY,
                   "out_of_range": INPUT_CHANGED}  # fmt: skip

# Updates of at most this many rows x D (about 170 rows of 24) are checked by the exact dry run in C rather
# than proven finite in Python: at that size both cost about the same (10 us a table, measured).
SMALL_UPDATE_ELEMENTS = 1 << 12


_R = TypeVar("_R")


def _weakly(method: Callable[..., _R]) -> Callable[..., _R]:
    """``method`` (bound), called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> _R:
        bound = ref()
        if bound is None:
            raise RuntimeError("embtables: the native backend of this fast path is gone (a bug)")
        return bound(*args, **kwargs)

    return call


class NativeBackend:
    """The C kernels over ``tables``. Scratch (workspaces, optimizer blocks, the fast path's argument
    arrays) belongs to this process: a copy or a pickle of the collection builds a new backend."""

    name = "native"

    def __init__(self, tables: TableSet) -> None:
        self.tables = tables
        self._workspaces: dict[str, native.Workspace] = {}
        self._param_blocks: dict[tuple[str, float, float], Any] = {}
        self._half_scratch: dict[str, dict[str, Tensor]] = {}  # a half table's rounded rows between check and write
        # the fast path is this backend's own: it calls back through weak references, so the two are no reference
        # cycle and a dropped module's tables are freed at once (not at the next garbage collection)
        self.fast = NativeFastPath(tables, _weakly(self.workspace), _weakly(self.params))

    def workspace(self, table: ResolvedTable, scratch: str = "") -> native.Workspace:
        """The table's phase-1 scratch (reused every step; one pending update per ``scratch`` name)."""
        key = f"{table.name}\0{scratch}"
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = native.Workspace(table.dim)
        return ws

    def params(self, table: ResolvedTable, lr: float, decay: float | None = None) -> Any:
        """``native.opt_params`` of the table's optimizer at ``lr`` (and the decay it implies), built once
        per (learning rate, decay): the config is frozen, so the block only changes with them."""
        opt = table.optimizer
        if decay is None:
            decay = optimizer_decay(opt, lr)
        key = (table.name, lr, decay)
        params = self._param_blocks.get(key)
        if params is None:
            if len(self._param_blocks) > 4 * len(self.tables.tables):  # a schedule: keep the latest only
                self._param_blocks.clear()
            params = self._param_blocks[key] = native.opt_params(opt, lr, decay, clip_gradients=True)
        return params

    # ------------------------------------------------------------------ lookup
    def lookup(self, batches: Sequence[FeatureBatch], concat: bool) -> Lookup:
        ts = self.tables
        if batches and batches[0].staged is not None:  # every feature staged natively, in one call
            buffer = torch.empty((batches[0].out_shape[0], ts.width)) if concat else None
            done = self.fast.lookup(batches, buffer, ts.starts)
            if done is not None:
                if concat:
                    return Lookup([], set(), done[0])
                return Lookup(list(done), set(), complete=True)
        ts.check_storage()
        features, tables, states = ts.features, ts.tables, ts.states
        fast: list[int] = []
        parts = []
        out: list[Tensor | None] = [None] * len(batches)
        checked: set[int] = set()
        half: list[int] = []
        for i, (feature, batch) in enumerate(zip(features, batches)):
            table = tables[feature.table_index]
            weights = states[table.name].weights
            if table.config.half:
                if weights.is_cpu and native.usable(batch.ids, batch.offsets, batch.coeffs):
                    half.append(i)
            elif table.config.quantization_config is None and native.usable(
                weights, batch.ids, batch.offsets, batch.coeffs
            ):
                fast.append(i)
                parts.append((weights, batch.ids, batch.offsets, batch.coeffs))
        if half:
            self._half_lookups(half, batches, out, checked)
        if not fast:
            return Lookup(out, checked)
        wide = None
        if concat and len(fast) == len(batches):
            wide = torch.empty((batches[0].out_shape[0], ts.width), dtype=torch.float32)
        acts_list, code = native.lookup_many(parts, None if wide is None else (wide, ts.starts))
        status = _POOL_STATUS[decode("et_lookup_many", code)]
        if status == OUT_OF_RANGE:
            names = ", ".join(repr(features[i].name) for i in fast)
            raise InputError(
                f"features {names}: ids or offsets changed after they were validated (an input buffer was "
                "written while the batch was staged); nothing was looked up or changed. Do not modify input "
                "tensors between enqueue() and dequeue()."
            )
        finite = status == POOLED  # else some output is not finite: the caller's check names the feature
        if wide is not None:
            if not finite:
                ts.check_finite([wide[:, a : a + tables[f.table_index].dim] for f, a in zip(features, ts.starts)])
            return Lookup([], set(), wide)
        for i, acts in zip(fast, acts_list):
            out[i] = acts.reshape(*batches[i].out_shape, tables[features[i].table_index].dim)
        return Lookup(out, checked | set(fast) if finite else checked)

    def _half_lookups(
        self, half: list[int], batches: Sequence[FeatureBatch], out: list[Tensor | None], checked: set[int]
    ) -> None:
        """The activations of features ``half`` from their half-precision tables, in one call
        (``native_half.lookup_half_many``), into ``out``; they join ``checked`` when all are finite (else the
        caller's check names the feature)."""
        ts = self.tables
        parts = []
        for i in half:
            b = batches[i]
            parts.append((ts.states[ts.table_of(i).name].weights, b.ids, b.offsets, b.coeffs))
        acts, code = native_half.lookup_half_many(parts)
        status = _POOL_STATUS[decode("et_lookup_half_many", code)]
        if status == OUT_OF_RANGE:
            names = ", ".join(repr(ts.features[i].name) for i in half)
            raise InputError(
                f"features {names}: ids or offsets changed after they were validated (an input buffer was written "
                "while the batch was staged); nothing was looked up or changed. Do not modify input tensors "
                "between enqueue() and dequeue()."
            )
        for i, a in zip(half, acts):
            out[i] = a.reshape(*batches[i].out_shape, a.shape[1])
        if status == POOLED:
            checked.update(half)

    def pool(self, parts: Sequence[BagPart]) -> tuple[list[Tensor], int] | None:
        if parts and all(w.dtype in HALF_TYPES and w.is_cpu and native.usable(i, o, c) for w, i, o, c in parts):
            outs, code = native_half.lookup_half_many(list(parts))  # a sharded half table's partial lookups
            return outs, _POOL_STATUS[decode("et_lookup_half_many", code)]
        if not parts or not all(native.usable(w, ids, offsets, coeffs) for w, ids, offsets, coeffs in parts):
            return None
        outs, code = native.lookup_many(list(parts))
        return outs, _POOL_STATUS[decode("et_lookup_many", code)]

    # ------------------------------------------------------------------ phase 1
    def table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        """Phase 1 in C (dedup, float32 sums, finiteness) for every table the native kernels serve."""
        if batches and batches[0].staged is not None:
            done = self.fast.table_gradients(batches, grads)
            if done is not None:
                return done
        eligible: list[tuple[ResolvedTable, list[native.FeaturePart]]] = []
        for table in self.tables.tables:
            if not table.optimizer.use_gradient_accumulation:
                continue
            parts = [(batches[f].ids, batches[f].offsets, batches[f].coeffs, grads[f]) for f in table.feature_indices]
            # the collection checked the gradients: float32 on this device, contiguous or column blocks (which
            # phase 1 reads in place); prepare_many checks every buffer again. Phase 1 reads no table: a half
            # table's is summed here too, and its update written by ``native_half``.
            weights = self.tables.states[table.name].weights
            if (weights.is_cpu if table.config.half else native.usable(weights)) and native.usable(
                *(t for part in parts for t in part[:3])
            ):
                eligible.append((table, parts))
        if not eligible:
            return {}
        statuses = native.prepare_many(
            [(self.workspace(table), table.vocabulary_size, parts) for table, parts in eligible]
        )
        out = {}
        for (table, _), code in zip(eligible, statuses):
            status = _PREPARE_STATUS[decode("et_prepare_many", code)]
            if status == OUT_OF_MEMORY:
                raise MemoryError(f"table {table.name!r}: out of memory while preparing the sparse update.")
            if status == INPUT_CHANGED:
                raise input_changed(f"table {table.name!r}")
            if status != PREPARED:
                raise non_finite_gradient(table)
            out[table.name] = TableGradient(table, None, None, accumulated=True, prepared=self.workspace(table))
        return out

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared | None:
        weights = self.tables.states[table.name].weights
        # phase 1 reads no table: a half one is summed here too
        if not (weights.is_cpu if table.config.half else native.usable(weights)) or not native.usable(
            *(x for p in parts for x in p)
        ):
            return None
        ws = self.workspace(table, scratch)
        (code,) = native.prepare_many([(ws, table.vocabulary_size, list(parts))])
        status = _PREPARE_STATUS[decode("et_prepare_many", code)]
        if status not in (PREPARED, GRADIENT_NOT_FINITE):
            return Prepared(status)
        return Prepared(status, TableGradient(table, None, None, accumulated=True, prepared=ws))

    # ------------------------------------------------------------------ phase 2
    def write_step(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> bool:
        return self.fast.apply(table_grads, lrs)

    def checked_updates(self, updates: Sequence[Update], *, check_in_write: bool = False) -> list[Any | None]:
        return [self.checked_update(tg, lr, decay, check_in_write=check_in_write) for tg, lr, decay in updates]

    def checked_update(
        self, tg: TableGradient, lr: float, decay: float, *, check_in_write: bool = False
    ) -> _NativeWrite | _HalfWrite | None:
        """Check one accumulated update (writes nothing; its bounds measured in C over the rows it touches)
        and return what ``write`` writes; None when the native kernels do not take its tensors."""
        state = self.tables.states[tg.table.name]
        opt = tg.table.optimizer
        slots = state.slot_tuple()
        dense = not opt.lazy
        half = tg.table.config.half
        if half and (dense or not state.weights.is_cpu):
            return None  # the reference updates every row of a non-lazy half table
        ws = tg.prepared
        if ws is None:
            tensors = (tg.rows, tg.grads) if half else (state.weights, *slots, tg.rows, tg.grads)
            if tg.rows is None or tg.grads is None or not native.usable(*tensors):
                return None
            ws = self.workspace(tg.table)
            meaning = decode("et_workspace_load", ws.load(tg.rows, tg.grads.contiguous(), tg.table.vocabulary_size))
            if meaning == "out_of_memory":
                raise MemoryError(f"table {tg.table.name!r}: out of memory while loading the sparse update.")
            if meaning != "ok":
                raise InputError(f"table {tg.table.name!r}: the update's rows are out of range or repeated.")
        params = self.params(tg.table, lr, decay)
        if half:
            return self._half_update(tg.table, ws, params, lr, check_in_write)
        rows = tg.table.vocabulary_size if dense else ws.num_rows
        if check_in_write and rows * tg.table.dim <= SMALL_UPDATE_ELEMENTS:
            # A dry run of a few rows costs less than the proof: check exactly in the writing call.
            return _NativeWrite(tg.table, ws, state.weights, slots, params, dense, lr, True)
        hi, lo = ws.touched_bounds(state.weights, slots, dense=dense)
        # not proven: the exact dry run, a second pass over every touched row
        check = not update_is_finite(opt, lr, decay, ws.gradient_max_abs, hi, lo)
        if check and not check_in_write:
            bad = ws.check(state.weights, slots, params, dense=dense)
            if bad >= 0:
                raise non_finite_update(tg.table, bad, lr)
        return _NativeWrite(tg.table, ws, state.weights, slots, params, dense, lr, check and check_in_write)

    def _half_update(
        self, table: ResolvedTable, ws: native.Workspace, params: Any, lr: float, check_in_write: bool
    ) -> _HalfWrite:
        """A half-precision table's lazy update and what writes it: with ``check_in_write``, checked as it is
        written in place (``write``); else computed and checked now, by the rounded values (no proof: it
        bounds float32 results), and written from scratch."""
        state = self.tables.states[table.name]
        config = table.config
        grows = self.tables.global_rows.get(table.name)
        rounding = (config.rounding_seed, self.tables.step, table.index, config.rounding == "stochastic")
        if isinstance(grows, Tensor):
            grows = grows.to(torch.int64).contiguous()
        update = native_half.HalfUpdate(ws, state.weights, state.slot_tuple(), params, grows, rounding)
        scratch = self._half_scratch.setdefault(table.name, {})
        if check_in_write:
            return _HalfWrite(table, update, scratch, lr, computed=False)
        bad = update.compute(scratch)
        if bad >= 0:
            raise non_finite_update(table, bad, lr)
        return _HalfWrite(table, update, scratch, lr, computed=True)

    def settle(self) -> None:
        return None  # every error is raised in the call that finds it

    def write(self, writes: Sequence[_NativeWrite | _HalfWrite]) -> None:
        """All or nothing: the half tables checked as they are written go first, in place, each row's values
        kept; then the float32 tables (their dry runs in the writing call); a refusal by either puts those
        half tables back. The half tables checked before (written from scratch) cannot refuse: last."""
        whole = [w for w in writes if isinstance(w, _NativeWrite)]
        halves = [w for w in writes if isinstance(w, _HalfWrite)]
        done: list[_HalfWrite] = []
        try:
            for half in halves:
                if not half.computed:
                    bad = half.update.apply_in_place(half.scratch)  # raising, it wrote nothing
                    done.append(half)
                    if bad >= 0:
                        raise non_finite_update(half.table, bad, half.lr)
            if whole:
                # Written last-measured first: the bounds pass has just read the last tables' rows, which are
                # still in the L3 cache when their updates run first.
                whole.reverse()
                bad_rows = native.apply_many([(w.ws, w.weights, w.slots, w.params, w.dense, w.check) for w in whole])
                for w, bad in zip(whole, bad_rows):
                    if bad >= 0:  # found by a dry run in the writing call: nothing of it was written
                        raise non_finite_update(w.table, bad, w.lr)
        except BaseException:
            for half in reversed(done):
                half.update.put_back()
            raise
        for half in halves:
            if half.computed:
                half.update.write()  # computed and checked in ``checked_update``

    def sequential(self, tg: TableGradient, lr: float) -> Restore | None:
        state = self.tables.states[tg.table.name]
        slots = state.slot_tuple()
        if tg.rows is None or tg.grads is None or not native.usable(state.weights, *slots, tg.rows, tg.grads):
            return None
        opt = tg.table.optimizer
        params = native.opt_params(opt, lr, optimizer_decay(opt, lr), clip_gradients=False)

        def run(rows: Tensor, grads: Tensor) -> None:
            native.apply_sequential(rows, grads.contiguous(), state.weights, slots, params)

        return applied_with_backup(state, tg, lr, run)


@dataclasses.dataclass(eq=False)
class _NativeWrite:
    """A checked native update, not yet written: ``NativeBackend.write`` writes several together."""

    table: ResolvedTable
    ws: native.Workspace
    weights: Tensor
    slots: tuple[Tensor, ...]
    params: Any
    dense: bool
    lr: float
    check: bool = False  # the exact dry run runs in the writing call


@dataclasses.dataclass(eq=False)
class _HalfWrite:
    """An update of a half-precision table, not yet written: ``computed`` (rounded into ``scratch`` and checked)
    or to be checked as it is written in place."""

    table: ResolvedTable
    update: native_half.HalfUpdate
    scratch: dict[str, Tensor]
    lr: float
    computed: bool
