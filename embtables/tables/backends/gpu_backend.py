"""``GpuBackend``: the fused GPU kernels (``kernels/gpu.py``) on CUDA tables: the lookup of every feature in
one launch, phase 1 (dedup, and the per-row sums or a bound on them) per table in one sort, one cumulative
sum and a few small kernels, phase 2 (the fused update, which sums a lazy table's rows itself) in one
launch per table. Same contract as the other backends: every error is raised before any table or slot is
written, with the same messages.

Host syncs: the lookup reads its status once (ids outside a table, non-finite activations); phase 1
reads every table's row count, sum bound (or largest |summed gradient|) and input check in one transfer.
Phase 2 reads the bounds of the values every table's update reads together, in one transfer (measured in
the step that writes, so an edit the engine cannot see is in them); a table whose sum bound proves nothing
(its sums are then made exactly) and an update the proof cannot show finite (its dry run) add one more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.kernels import gpu
from embtables.kernels.finite_guard import update_is_finite
from embtables.kernels.segments import segments_from_offsets
from embtables.tables.backends.interface import (
    GRADIENT_NOT_FINITE,
    INPUT_CHANGED,
    NOT_FINITE,
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
from embtables.tables.backends.table_set import TableSet
from embtables.tables.inputs import FeatureBatch
from embtables.tables.state import TableState
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import bounds_of_many, non_finite_gradient, non_finite_update, read_bounds

_F32_MAX = 3.4028234663852886e38


class GpuBackend:
    """The fused GPU kernels over ``tables``."""

    name = "gpu"

    def __init__(self, tables: TableSet) -> None:
        self.tables = tables

    def lookup(self, batches: Sequence[FeatureBatch], concat: bool) -> Lookup:
        """Every feature of a table without quantization in one launch (straight into the concatenated
        activations with ``concat``); the others are left to the reference."""
        ts = self.tables
        features, tables, states = ts.features, ts.tables, ts.states
        device = ts.device
        fast = [i for i, f in enumerate(features) if tables[f.table_index].config.quantization_config is None]
        dims = [tables[f.table_index].dim for f in features]
        wide = None
        if concat and len(fast) == len(batches):
            wide = torch.empty((batches[0].out_shape[0], ts.width), dtype=torch.float32, device=device)
            outs = [wide[:, a : a + d] for a, d in zip(ts.starts, dims)]
        else:
            outs = [torch.empty((batches[i].num_segments, dims[i]), dtype=torch.float32, device=device) for i in fast]
        parts = [(states[tables[features[i].table_index].name].weights, batches[i].ids, batches[i].offsets,
                  batches[i].coeffs) for i in fast]  # fmt: skip
        flags = gpu.lookup_many(parts, outs).tolist() if fast else []  # the lookup's one sync
        for i, flag in zip(fast, flags):
            if flag & OUT_OF_RANGE:
                raise InputError(
                    f"feature {features[i].name!r}: an id is outside its table or the offsets are broken (an input "
                    "buffer was written after it was validated); nothing was looked up or changed. Do not modify "
                    "input tensors between enqueue() and dequeue()."
                )
        checked = {i for i, flag in zip(fast, flags) if not flag & NOT_FINITE}
        if wide is not None:
            if len(checked) < len(fast):
                ts.check_finite(outs, checked)
            return Lookup([], set(), wide)
        acts: list[Tensor | None] = [None] * len(batches)
        for i, out in zip(fast, outs):
            acts[i] = out.view(*batches[i].out_shape, dims[i])
        return Lookup(acts, checked)

    def pool(self, parts: Sequence[BagPart]) -> tuple[list[Tensor], int] | None:
        if not parts:
            return None
        device = parts[0][0].device
        outs = [torch.empty((o.numel() - 1, w.shape[1]), dtype=torch.float32, device=device) for w, _, o, _ in parts]
        flags = gpu.lookup_many(list(parts), outs).tolist()  # one sync
        if any(f & OUT_OF_RANGE for f in flags):
            return outs, OUT_OF_RANGE
        return outs, NOT_FINITE if any(f & NOT_FINITE for f in flags) else POOLED

    def table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        """Phase 1 of every table with gradient accumulation: distinct rows and what bounds their summed
        gradients, read back for every table in one sync. A lazy table's sums are deferred to its update
        (which sums each row as it applies it) when the bound proves them finite; the others, and a
        deferred table the bound does not clear, are summed here (one more sync for those). Raises before
        anything is written."""
        ts = self.tables
        accumulated = [t for t in ts.tables if t.optimizer.use_gradient_accumulation]
        if not accumulated:
            return {}
        stats = torch.zeros((len(accumulated), gpu.STATS), dtype=torch.int64, device=ts.device)  # one sync
        pending: list[tuple[Any, gpu.RowSums]] = []
        for i, table in enumerate(accumulated):
            parts = []
            for f in table.feature_indices:
                batch, g = batches[f], grads[f]
                if g is None:
                    g = torch.zeros((batch.num_segments, table.dim), dtype=torch.float32, device=ts.device)
                parts.append((batch.ids, batch.seg, batch.coeffs, g))
            defer = table.optimizer.lazy and bool(gpu.DEFER_SUMS)
            rs = gpu.row_sums(parts, table.vocabulary_size, table.dim, stats[i], defer=defer)
            pending.append((table, rs))
        values = stats.tolist()
        bounds: dict[str, float] = {}
        summed_here = False
        for (table, rs), row in zip(pending, values):
            if rs.sums is not None or row[2]:
                continue
            bound = rs.sum_bound(row)
            if bound < _F32_MAX:
                bounds[table.name] = bound
            else:  # a gradient too large (or not finite) for the bound to prove anything: the exact sums
                gpu.materialize(rs)
                summed_here = True
        if summed_here:
            values = stats.tolist()
        out = {}
        for (table, rs), (count, maxbits, bad, *_) in zip(pending, values):
            if bad:
                raise input_changed(f"table {table.name!r}")
            if table.name in bounds:
                out[table.name] = TableGradient(
                    table, rs.rows[:count], None, accumulated=True, gradient_max_abs=bounds[table.name], deferred=rs
                )
                continue
            if maxbits >= gpu.F32_INF_BITS:
                raise non_finite_gradient(table)
            assert rs.sums is not None
            out[table.name] = TableGradient(
                table,
                rs.rows[:count],
                rs.sums[:count],
                accumulated=True,
                gradient_max_abs=gpu.bits_to_float([maxbits])[0] if count else 0.0,
            )
        return out

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared | None:
        """Distinct rows and their exact sums on the device (one sync)."""
        device = self.tables.states[table.name].weights.device
        grad_parts = []
        for ids, offsets, coeffs, g in parts:
            if g is None:
                g = torch.zeros((offsets.numel() - 1, table.dim), dtype=torch.float32, device=device)
            grad_parts.append((ids, segments_from_offsets(offsets, ids.numel()), coeffs, g.contiguous()))
        if not grad_parts:
            return None
        stats = torch.zeros(gpu.STATS, dtype=torch.int64, device=device)
        rs = gpu.row_sums(grad_parts, table.vocabulary_size, table.dim, stats)
        count, maxbits, bad, *_ = stats.tolist()
        if bad:
            return Prepared(INPUT_CHANGED)
        if maxbits >= gpu.F32_INF_BITS:
            return Prepared(GRADIENT_NOT_FINITE)
        assert rs.sums is not None
        gmax = gpu.bits_to_float([maxbits])[0] if count else 0.0
        tg = TableGradient(table, rs.rows[:count], rs.sums[:count], accumulated=True, gradient_max_abs=gmax)
        return Prepared(PREPARED, tg)

    def write_step(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> bool:
        return False

    def checked_updates(self, updates: Sequence[Update], *, check_in_write: bool = False) -> list[Any | None]:
        """Check every accumulated update (writes nothing) and return the functions that write them: proven
        finite from bounds on the values each reads, measured now for every table and read back together
        (one sync), else a dry run of the fused kernel (one more, for that table)."""
        planned = [self._plan(tg, lr, decay) for tg, lr, decay in updates]
        stats = bounds_of_many([(p.tensors(), p.rows if p.table.optimizer.lazy else None) for p in planned])
        values = read_bounds(torch.cat(stats)) if stats else ([], [])
        out: list[Any | None] = []
        at = 0
        for p, measured in zip(planned, stats):
            n = measured.shape[0]
            hi, lo = values[0][at : at + n], values[1][at : at + n]
            at += n
            out.append(p.checked(hi, lo))
        return out

    def _plan(self, tg: TableGradient, lr: float, decay: float) -> _GpuUpdate:
        """One table's update before its check: its rows, sums (or the deferred sums it makes inline), the
        bound on its gradient and its parameters."""
        table, state = tg.table, self.tables.states[tg.table.name]
        opt = table.optimizer
        deferred = tg.deferred if tg.grads is None else None
        inline = deferred if deferred is not None and deferred.sums is None and opt.lazy else None
        if inline is None:  # summed already (pickled, or an observer's flush), or not lazy: the sums
            tg = tg.materialized()
        assert tg.rows is not None
        rows, grads = tg.rows, tg.grads
        if not opt.lazy:
            assert grads is not None  # non-lazy Adam: every row, a zero gradient where the batch has none
            full = torch.zeros((table.vocabulary_size, table.dim), dtype=torch.float32, device=grads.device)
            grads = full.index_copy_(0, rows, grads)
            rows = torch.arange(table.vocabulary_size, device=grads.device)
        gmax = tg.gradient_max_abs
        if gmax is None:
            assert grads is not None
            gmax = float(grads.abs().max()) if grads.numel() else 0.0
        return _GpuUpdate(table, state, rows, grads, inline, gpu.update_parameters(opt, lr, decay), lr, decay, gmax)

    def write(self, writes: Sequence[Callable[[], None]]) -> None:
        for write in writes:
            write()

    def sequential(self, tg: TableGradient, lr: float) -> Restore | None:
        return None  # occurrence by occurrence: the reference


@dataclasses.dataclass(eq=False)
class _GpuUpdate:
    """One table's planned update (``GpuBackend._plan``), checked once its bounds are read."""

    table: ResolvedTable
    state: TableState
    rows: Tensor
    grads: Tensor | None
    inline: gpu.RowSums | None
    params: dict[str, Any]
    lr: float
    decay: float
    gmax: float

    def tensors(self) -> tuple[Tensor, ...]:
        """The weights and slots the update reads (their bounds are measured for every table together)."""
        return (self.state.weights, *self.state.slot_tuple())

    def checked(self, hi: list[float], lo: list[float]) -> Callable[[], None]:
        """Raise when the update would write a non-finite value (a dry run when the bounds ``hi``, ``lo``
        prove nothing); else the function that writes it."""
        opt, state = self.table.optimizer, self.state
        slots = state.slot_tuple()
        if not update_is_finite(opt, self.lr, self.decay, self.gmax, hi, lo):
            bad, _ = gpu.update(self.rows, self.grads, state.weights, slots, self.params, write=False, measure=False,
                                inline=self.inline)  # fmt: skip
            row = self.table.vocabulary_size if bad is None else int(bad.item())
            if row < self.table.vocabulary_size:
                raise non_finite_update(self.table, row, self.lr)
        rows, grads, params, inline = self.rows, self.grads, self.params, self.inline

        def write() -> None:
            gpu.update(rows, grads, state.weights, slots, params, write=True, measure=False, inline=inline)

        return write
