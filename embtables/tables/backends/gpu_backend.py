"""``GpuBackend``: the fused GPU kernels (``kernels/gpu.py``, ``kernels/gpu_step.py``) on CUDA tables, in a
fixed number of launches whatever the number of tables: the lookup of every feature in one launch; phase 1
(every id of a group of tables of one width as one key space: gathered, sorted once, deduplicated, long runs
summed) in about ten launches per group; phase 2 as one dry run and one write per group and optimizer
setting, the update summing each row's gradients as it applies them.

Errors keep the other backends' meaning and messages (a step that finds one writes nothing), but the host
does not wait for them: what the kernels find is kept on the device (``DeviceChecks``: flags, and a sticky
``refused`` cell that every write kernel reads first) and raised at the next call, with no host sync in a
steady-state step; with ``immediate`` checks (``EMBTABLES_GPU_ERRORS=immediate``) every call reads its own
flags (one sync) and raises before it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.kernels import gpu, gpu_step
from embtables.kernels.affine_rows import AffineRows
from embtables.kernels.segments import segments_from_offsets
from embtables.kernels.stochastic_rounding import table_state
from embtables.tables.backends.device_checks import DeviceChecks
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
from embtables.tables.value_bounds import non_finite_activations, non_finite_gradient, non_finite_update


class GpuBackend:
    """The fused GPU kernels over ``tables``."""

    name = "gpu"

    def __init__(self, tables: TableSet, *, immediate: bool = False) -> None:
        self.tables = tables
        self.checks = DeviceChecks(tables.device, immediate=immediate or not gpu.deferred_errors())
        self._mappings: dict[str, tuple[Tensor | AffineRows, int, Tensor]] = {}  # see _global_rows

    @property
    def refused(self) -> Tensor:
        """int64 [1] on the tables' device: nonzero while a step is refused (every write then writes nothing)."""
        return self.checks.refused

    def settle(self) -> None:
        """Raise every error the device found so far (one sync): before a write that does not read
        ``refused``."""
        self.checks.settle()

    def lookup(self, batches: Sequence[FeatureBatch], concat: bool) -> Lookup:
        """Every feature of a table without quantization in one launch (straight into the concatenated
        activations with ``concat``); the others are left to the reference. The status of every feature is
        checked on the device (``DeviceChecks``): raised at the next call, or before this one returns when
        errors are immediate."""
        checks = self.checks
        checks.raise_pending(wait=False)
        ts = self.tables
        ts.check_storage()
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
        if fast:
            status = gpu.lookup_many(parts, outs, checks.refused)
            checks.add([status], lambda flags: self._lookup_error(fast, flags))
        checks.post("the lookup")
        if wide is not None:
            return Lookup([], set(), wide)
        acts: list[Tensor | None] = [None] * len(batches)
        for i, out in zip(fast, outs):
            acts[i] = out.view(*batches[i].out_shape, dims[i])
        return Lookup(acts, set(fast))

    def _lookup_error(self, fast: list[int], flags: list[int]) -> InputError | None:
        features = self.tables.features
        for i, flag in zip(fast, flags):
            if flag & OUT_OF_RANGE:
                return InputError(
                    f"feature {features[i].name!r}: an id is outside its table or the offsets are broken (an input "
                    "buffer was written after it was validated); nothing was looked up or changed. Do not modify "
                    "input tensors between enqueue() and dequeue()."
                )
        for i, flag in zip(fast, flags):
            if flag & NOT_FINITE:
                return non_finite_activations(features[i], self.tables.table_of(i))
        return None

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
        """Phase 1 of every table with gradient accumulation, in a fixed number of launches per group of
        tables of one width and laziness (``gpu_step.row_sums``), with no sync: each
        table's gradient is its share of its group's distinct keys. A lazy group's sums are left to its
        update, which sums each row as it applies it; what phase 1 finds wrong (an id or a bag outside its
        table or gradient) is raised by ``checked_updates``, before anything is written."""
        self.checks.raise_pending(wait=False)
        ts = self.tables
        groups: dict[tuple[Any, ...], list[ResolvedTable]] = {}
        for table in ts.tables:
            if table.optimizer.use_gradient_accumulation:
                lazy = table.optimizer.lazy
                groups.setdefault((table.dim, lazy), []).append(table)
        out: dict[str, TableGradient] = {}
        for (dim, lazy), members in groups.items():
            parts = []
            for j, table in enumerate(members):
                for f in table.feature_indices:
                    batch, g = batches[f], grads[f]
                    if g is None:
                        g = torch.zeros((batch.num_segments, dim), dtype=torch.float32, device=ts.device)
                    parts.append((batch.ids, batch.seg, batch.coeffs, g, j))
            rs = gpu_step.row_sums(parts, [t.vocabulary_size for t in members], dim, summed=not lazy)
            rs.sorted["parts"] = parts  # read again only to name a flagged input
            for j, table in enumerate(members):
                share = gpu_step.TableShare(rs, j)
                out[table.name] = TableGradient(table, None, None, accumulated=True, deferred=share)
        return out

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared | None:
        """Distinct rows and their exact sums on the device (one sync)."""
        device = self.tables.states[table.name].weights.device
        grad_parts = []
        for ids, offsets, coeffs, g in parts:
            if g is None:
                g = torch.zeros((offsets.numel() - 1, table.dim), dtype=torch.float32, device=device)
            grad_parts.append((ids, segments_from_offsets(offsets, ids.numel()), coeffs, g.contiguous(), 0))
        if not grad_parts:
            return None
        rs = gpu_step.row_sums(grad_parts, [table.vocabulary_size], table.dim)
        count, maxbits, bad, *_ = rs.stats.tolist()
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
        """Check every accumulated update (writes nothing) and return the functions that write them: one dry
        run per group and optimizer setting (``gpu_step.update(write=False)``), whatever the number of tables.
        What the dry runs find is checked on the device (``DeviceChecks``; the writes write nothing while a
        step is refused) and raised at the next call, or here when errors are immediate (one sync). A
        gradient that is not a share of a group (a pickled one) is left to the reference."""
        launches: dict[tuple[int, Any], _GroupUpdate] = {}
        out: list[Any | None] = []
        for tg, lr, decay in updates:
            share = tg.deferred
            if share is None:
                out.append(None)
                continue
            state = self.tables.states[tg.table.name]
            config = tg.table.config
            params = gpu_step.update_parameters(
                tg.table.optimizer, lr, decay, row_dtype=state.weights.dtype,
                slot_dtype=state.slot_tuple()[0].dtype if state.slots else torch.float32,
                stochastic=config.rounding == "stochastic",
            )  # fmt: skip
            key = (id(share.sums), _frozen(params))
            launch = launches.get(key)
            if launch is None:
                launch = launches[key] = _GroupUpdate(share.sums, params, self.refused)
            changed = None if self.tables.changed is None else self.tables.changed.flags[tg.table.name]
            rounding = None
            if params["STOCHASTIC"]:
                rounding = (
                    self._global_rows(tg.table),
                    table_state(config.rounding_seed, self.tables.step, tg.table.index),
                )
            launch.add(share.index, tg.table, state, lr, changed, rounding)
            out.append(launch)
        for launch in launches.values():
            launch.dry_run()
        if launches:
            found = list(launches.values())
            self.checks.add([t for u in found for t in (u.found, u.sums.stats[2:3])], lambda v: self._found(found, v))
            if self.checks.immediate:
                self.checks.settle()
        return out

    def _global_rows(self, table: ResolvedTable) -> Tensor | None:
        """The global id [V] of each local row of ``table`` on its device (None: local rows are global): the
        mapping itself when it is an int64 tensor there, else a copy made once per version of the mapping (a
        dynamic table's keys change in place; the copy's entry holds the mapping, so its identity is its own)."""
        held = self.tables.global_rows.get(table.name)
        device = self.tables.device
        if isinstance(held, AffineRows):  # the GPU kernels read one id a row: made once on the device
            kept = self._mappings.get(table.name)
            if kept is None or kept[0] is not held:
                kept = self._mappings[table.name] = (held, 0, held.tensor(device))
            return kept[2]
        mapping = held
        if mapping is None or (mapping.device == device and mapping.dtype == torch.int64 and mapping.is_contiguous()):
            return mapping
        kept = self._mappings.get(table.name)
        if kept is None or kept[0] is not mapping or kept[1] != mapping._version:
            copy = mapping.to(device, torch.int64).contiguous()
            kept = self._mappings[table.name] = (mapping, mapping._version, copy)
        return kept[2]

    def _found(self, launches: list[_GroupUpdate], values: list[int]) -> InputError | None:
        """The first error the dry runs found, in table order: an input that changed, then a gradient that is
        not finite, then an update that would not be (``values``: each launch's found [2] and phase-1 flag)."""
        errors: list[tuple[int, int, InputError]] = []
        for i, launch in enumerate(launches):
            bad_key, nan_key, changed = values[3 * i : 3 * i + 3]
            if changed:
                table = launch.flagged_table()
                errors.append((0, self.tables.tables.index(table), input_changed(f"table {table.name!r}")))
            if nan_key != gpu_step.NEVER:
                table, _ = launch.table_row(nan_key)
                errors.append((1, self.tables.tables.index(table), non_finite_gradient(table)))
            if bad_key != gpu_step.NEVER:
                table, row = launch.table_row(bad_key)
                error = non_finite_update(table, row, launch.lrs[table.name])
                errors.append((2, self.tables.tables.index(table), error))
        return min(errors, key=lambda e: e[:2])[2] if errors else None

    def write(self, writes: Sequence[Callable[[], None]]) -> None:
        for write in writes:
            write()
        self.checks.post("apply_gradients")

    def sequential(self, tg: TableGradient, lr: float) -> Restore | None:
        return None  # occurrence by occurrence: the reference


def _frozen(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(params.items()))


class _GroupUpdate:
    """The update of the tables of one group that share optimizer parameters: one dry run, then (called
    once, however many of its tables' writes call it) one write."""

    def __init__(self, sums: gpu_step.RowSums, params: dict[str, Any], refused: Tensor) -> None:
        self.sums, self.params, self.refused = sums, params, refused
        members = len(sums.bases) - 1
        self.tables: list[ResolvedTable | None] = [None] * members
        self.tensors: list[gpu_step.TableTensors | None] = [None] * members
        self.changed: list[Tensor | None] = [None] * members
        self.rounding: list[gpu_step.Rounding | None] = [None] * members
        self.lrs: dict[str, float] = {}
        self.found = torch.empty(0)
        self.done = False

    def add(
        self,
        index: int,
        table: ResolvedTable,
        state: TableState,
        lr: float,
        changed: Tensor | None,
        rounding: gpu_step.Rounding | None = None,
    ) -> None:
        self.tables[index] = table
        self.tensors[index] = (state.weights, state.slot_tuple())
        self.changed[index] = changed
        self.rounding[index] = rounding
        self.lrs[table.name] = lr

    def _launch(self, write: bool) -> None:
        rs = self.sums
        gpu_step.update(rs, self.tensors, self.params, write=write, refused=self.refused, found=None if write else
                        self.found, inline=rs.sums is None, changed=self.changed, rounding=self.rounding)  # fmt: skip

    def dry_run(self) -> None:
        table = next(t for t in self.tables if t is not None)
        if not table.optimizer.lazy:  # every row of the group's tables, a zero gradient where the batch has none
            self.sums = gpu_step.every_row(self.sums)
        self.found = gpu_step.found_cells(self.refused.device)
        self._launch(write=False)

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self._launch(write=True)

    def table_row(self, key: int) -> tuple[ResolvedTable, int]:
        """The table and row of a key of the group."""
        bases = self.sums.bases
        j = max(i for i in range(len(bases) - 1) if bases[i] <= key)
        table = self.tables[j]
        assert table is not None
        return table, key - bases[j]

    def flagged_table(self) -> ResolvedTable:
        """The first table whose ids or bags phase 1 flagged (read on the host: an error path)."""
        parts: list[gpu_step.GradPart] = self.sums.sorted.get("parts", [])
        for ids, seg, _, grad, j in parts:
            table = self.tables[j]
            if table is None:
                continue
            outside = (ids < -1) | (ids >= table.vocabulary_size) | (seg < 0) | (seg >= grad.shape[0])  # -1: dropped
            if bool(outside.any()):
                return table
        return next(t for t in self.tables if t is not None)
