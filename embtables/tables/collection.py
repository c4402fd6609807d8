"""``EmbeddingCollection``: all tables of a resolved config in one process, with the pooled lookup
and the fused sparse update. ``DistributedEmbedding`` (``embtables.api``) wraps it with the TF verbs.

Every ``apply`` is two-phase: phase 1 computes and validates every table's gradient (shapes,
finiteness, learning rates) without touching state; phase 2 updates. A bad batch therefore
changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import InputError
from embtables.kernels import gpu, native
from embtables.kernels.clip_decay import effective_weight_decay
from embtables.kernels.finite_guard import update_is_finite
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum
from embtables.kernels.sparse_update import update_rows
from embtables.tables import gpu_step
from embtables.tables.concatenated import column_starts
from embtables.tables.dynamic_vocabularies import Vocabularies
from embtables.tables.inputs import FeatureBatch
from embtables.tables.learning_rates import LearningRatePlan
from embtables.tables.native_fast_path import NativeFastPath
from embtables.tables.state import TableState, create_table_state, initial_rows
from embtables.tables.table_gradient import TableGradient
from embtables.tables.update_paths import apply_sequential_or_restore, dense_update
from embtables.tables.value_bounds import check_finite_rows, non_finite_gradient, non_finite_update, rows_bounds


class EmbeddingCollection:
    """Tables of ``resolved`` on ``device``; single process. A plain object: the ``nn.Module``
    integration (``.to()``, ``state_dict``) lives in ``DistributedEmbedding``."""

    def __init__(self, resolved: ResolvedConfig, device: torch.device) -> None:
        self.resolved = resolved
        self.states: dict[str, TableState] = {t.name: create_table_state(t, device) for t in resolved.tables}
        self._workspaces: dict[str, native.Workspace] = {}
        self._param_blocks: dict[tuple[str, float, float], Any] = {}  # native parameter blocks, see _params
        self.vocabularies = Vocabularies(resolved)  # the key maps of dynamic tables (spec §11)
        self._lr_plan: LearningRatePlan | None = None  # built at the first step, see learning_rates()
        self._fast: NativeFastPath | None = None  # built at the first step, see fast_path

    @property
    def device(self) -> torch.device:
        return next(iter(self.states.values())).weights.device

    @property
    def on_gpu_kernels(self) -> bool:
        """Whether the tables take the fused GPU kernels (``kernels/gpu.py``)."""
        return gpu.usable_for(next(iter(self.states.values())).weights)

    def __getstate__(self) -> dict[str, Any]:
        # Workspaces are per-process scratch (C memory): a copy or a pickle starts with none.
        state = self.__dict__.copy()
        state["_workspaces"] = {}
        state["_param_blocks"] = {}  # ctypes structures: rebuilt on demand
        state["_lr_plan"] = None  # rebuilt from the config on demand
        state["_fast"] = None  # ctypes arrays of this process's tensors: rebuilt on demand
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_lr_plan", None)
        self.__dict__.setdefault("_fast", None)

    @property
    def fast_path(self) -> NativeFastPath:
        """The small-batch fast path over these tables (``tables/native_fast_path.py``)."""
        if self._fast is None or self._fast.resolved is not self.resolved:
            self._fast = NativeFastPath(self)
        return self._fast

    # ------------------------------------------------------------------ forward
    def translate_keys(
        self, batches: Sequence[FeatureBatch], training: bool, step: int, pin_from: int
    ) -> list[FeatureBatch]:
        """Batches whose dynamic features hold rows instead of keys (spec §11); the rows a training lookup
        gave to new keys are reset to the table's initial values first. Other batches pass unchanged."""
        if not self.vocabularies:
            return list(batches)
        out, resets = self.vocabularies.translate(batches, training, step, pin_from)
        for name, rows in resets.items():
            if rows.numel():
                self.reset_rows(name, rows)
        return out

    def reset_rows(self, name: str, rows: Tensor) -> None:
        """Give rows [R] of table ``name`` fresh initial values (weights and slots): a dynamic table's rows
        handed to new keys."""
        table = self.resolved.tables[self.resolved.table_names.index(name)]
        rows = rows.to(self.device)
        state = self.states[table.name]
        weights, slots = initial_rows(table, rows.numel(), self.device)
        with torch.no_grad():
            state.weights.index_copy_(0, rows, weights)
            for name, values in slots.items():
                state.slots[name].index_copy_(0, rows, values)

    def lookup(self, batches: Sequence[FeatureBatch], concat: bool = False) -> list[Tensor]:
        """Activations per feature, [*out_shape, D], in feature order; ``concat``: one tensor [B, sum(D)],
        the features' activations side by side (every batch must pool to the same B bags).

        Features the native kernel serves are looked up together in one parallel region; with
        ``concat`` and every feature native, straight into the one output tensor."""
        if batches and batches[0].staged is not None:  # every feature staged natively, in one call
            buffer = torch.empty((batches[0].out_shape[0], self.columns[1])) if concat else None
            done = self.fast_path.lookup(batches, buffer, self.columns[0])
            if done is not None:
                return done
        if self.on_gpu_kernels:
            return gpu_step.lookup(self, batches, concat)
        features, tables, states = self.resolved.features, self.resolved.tables, self.states
        out: list[Tensor | None] = [None] * len(batches)
        fast: list[int] = []
        parts = []
        for i, (feature, batch) in enumerate(zip(features, batches)):
            table = tables[feature.table_index]
            weights = states[table.name].weights
            if table.config.quantization_config is None and native.usable(
                weights, batch.ids, batch.offsets, batch.coeffs
            ):
                fast.append(i)
                parts.append((weights, batch.ids, batch.offsets, batch.coeffs))
        status_nonfinite = False
        if fast:
            into = None
            if concat and len(fast) == len(batches):
                starts, width = self.columns
                into = (torch.empty((batches[0].out_shape[0], width), dtype=torch.float32), starts)
            acts_list, status = native.lookup_many(parts, into)
            status_nonfinite = status == 2
            if status == 1:
                names = ", ".join(repr(features[i].name) for i in fast)
                raise InputError(
                    f"features {names}: ids or offsets changed after they were validated (an input buffer was "
                    "written while the batch was staged); nothing was looked up or changed. Do not modify input "
                    "tensors between enqueue() and dequeue()."
                )
            if into is not None:
                if status_nonfinite:
                    starts, _ = self.columns
                    self.check_finite(
                        [acts_list[0][:, a : a + tables[f.table_index].dim] for f, a in zip(features, starts)]
                    )
                return acts_list
            for i, acts in zip(fast, acts_list):
                out[i] = acts.reshape(*batches[i].out_shape, tables[features[i].table_index].dim)
        result = [self.torch_lookup(i, batch) if a is None else a for i, (a, batch) in enumerate(zip(out, batches))]
        # The native lookup checked its outputs in C (status 2); check the others, or find the culprit.
        self.check_finite(result, None if status_nonfinite else set(fast))
        return [torch.cat(result, dim=1)] if concat else result

    def torch_lookup(self, i: int, batch: FeatureBatch) -> Tensor:
        """Feature ``i``'s activations [*out_shape, D] on the torch kernels (unchecked)."""
        table = self.resolved.tables[self.resolved.features[i].table_index]
        q = table.config.quantization_config
        acts = pooled_lookup(
            self.states[table.name].weights,
            batch.ids,
            batch.seg,
            batch.offsets,
            batch.coeffs,
            quantization=None if q is None else (q.num_buckets, float(q.lower), float(q.upper)),
        )
        return acts.reshape(*batch.out_shape, table.dim)

    @functools.cached_property
    def columns(self) -> tuple[list[int], int]:
        """``column_starts`` of the config (fixed: computed once, not per lookup)."""
        return column_starts(self.resolved)

    def check_finite(self, activations: Sequence[Tensor], checked: set[int] | None = None) -> None:
        """Raise naming the first feature whose activations are not all finite (skipping those ``checked``)."""
        for i, acts in enumerate(activations):
            if checked is not None and i in checked:
                continue
            if not bool(torch.isfinite(acts).all()):
                feature = self.resolved.features[i]
                table = self.resolved.tables[feature.table_index]
                raise InputError(
                    f"feature {feature.name!r} (table {table.name!r}): the looked-up activations overflow float32 "
                    "(a sum of large rows or weights is not finite); no table or slot was changed. Check the "
                    "weights of this feature and the table's values."
                )

    # ------------------------------------------------------------------ backward, phase 1
    def check_gradient(
        self, feature_index: int, batch: FeatureBatch, grad: Any, *, column_block: bool = False
    ) -> Tensor | None:
        """Validate one activation gradient (None is allowed); returns it as [S, D] float32, contiguous,
        or with ``column_block`` also a column block of a wider gradient (rows further apart, unit column
        stride: a feature's columns of the concatenated activations' gradient, which phase 1 reads in
        place)."""
        if grad is None:
            return None
        feature = self.resolved.features[feature_index]
        table = self.resolved.tables[feature.table_index]
        weights = self.states[table.name].weights
        if (  # the common case: already what phase 1 reads
            type(grad) is Tensor
            and grad.dtype is torch.float32
            and len(batch.out_shape) == 1
            and (grad.is_cpu if weights.is_cpu else grad.device == weights.device)
            and grad.layout is torch.strided
            and not grad.is_nested  # a strided nested tensor has no shape to compare
            and grad.shape == (batch.out_shape[0], table.dim)
            and not grad.requires_grad
            and (grad.is_contiguous() or (column_block and native.gradient_rows(grad, table.dim) is not None))
        ):
            return grad
        expected = (*batch.out_shape, table.dim)
        if not isinstance(grad, Tensor):
            raise TypeError(
                f"feature {feature.name!r}: the gradient must be a Tensor or None, got {type(grad).__name__}."
            )
        if grad.layout != torch.strided or grad.is_nested:
            raise TypeError(
                f"feature {feature.name!r} (table {table.name!r}): the gradient must be a dense (strided) tensor, "
                f"got layout {grad.layout}{' (nested)' if grad.is_nested else ''}. Pass grad.to_dense()."
            )
        if tuple(grad.shape) != expected:
            raise InputError(
                f"feature {feature.name!r} (table {table.name!r}): gradient shape {list(grad.shape)} does not "
                f"match the activation shape {list(expected)} (output_shape + [dim]). Pass d(loss)/d(activation)."
            )
        if not torch.is_floating_point(grad):
            raise TypeError(f"feature {feature.name!r}: the gradient must be floating point, got {grad.dtype}.")
        # contiguous(): the native update reads raw rows; a transposed or sliced gradient must not
        # silently send the table down the slower torch path.
        return grad.detach().to(self.device, torch.float32).reshape(batch.num_segments, table.dim).contiguous()

    def table_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> list[TableGradient]:
        """Per-table gradients from per-feature activation gradients [S, D] (None = zero)."""
        if batches and batches[0].staged is not None:
            done = self.fast_path.table_gradients(batches, grads)
            if done is not None:
                return done
        out = []
        if self.on_gpu_kernels:
            fast = gpu_step.table_gradients(self, batches, grads)
        else:
            fast = self._native_table_gradients(batches, grads)
        for table in self.resolved.tables:
            if table.name in fast:
                out.append(fast[table.name])
                continue
            ids_parts, grad_parts = [], []
            for f in table.feature_indices:
                batch, g = batches[f], grads[f]
                if g is None:
                    per_id = torch.zeros((batch.ids.numel(), table.dim), dtype=torch.float32, device=self.device)
                else:
                    per_id = occurrence_gradients(g, batch.seg, batch.coeffs)
                ids_parts.append(batch.ids)
                grad_parts.append(per_id)
            ids = torch.cat(ids_parts)
            per_id = torch.cat(grad_parts)
            accumulated = table.optimizer.use_gradient_accumulation
            if accumulated:
                rows, row_grads = dedup_sum(ids, per_id)
            else:
                # Occurrence order (spec §10.2): sample-major, then feature order, then position.
                num_features = len(table.feature_indices)
                keys = torch.cat(
                    [batches[f].sample_index() * num_features + local for local, f in enumerate(table.feature_indices)]
                )
                order = torch.sort(keys, stable=True).indices
                rows, row_grads = ids[order], per_id[order]
            if not bool(torch.isfinite(row_grads).all()):
                raise non_finite_gradient(table)
            out.append(TableGradient(table, rows, row_grads, accumulated=accumulated))
        return out

    def _native_table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        """Phase 1 in C (dedup, float32 sums, finiteness) for every table the native path serves."""
        eligible: list[tuple[ResolvedTable, list[native.FeaturePart]]] = []
        for table in self.resolved.tables:
            if not table.optimizer.use_gradient_accumulation:
                continue
            parts = [(batches[f].ids, batches[f].offsets, batches[f].coeffs, grads[f]) for f in table.feature_indices]
            # check_gradient gave float32 gradients on this device, contiguous or column blocks (which phase 1
            # reads in place): on the CPU they are native buffers; prepare_many checks them all again
            if native.usable(self.states[table.name].weights, *(t for part in parts for t in part[:3])):
                eligible.append((table, parts))
        if not eligible:
            return {}
        statuses = native.prepare_many(
            [(self._workspace(table), table.vocabulary_size, parts) for table, parts in eligible]
        )
        out = {}
        for (table, _), status in zip(eligible, statuses):
            if status == 2:
                raise MemoryError(f"table {table.name!r}: out of memory while preparing the sparse update.")
            if status == 3:
                raise InputError(
                    f"table {table.name!r}: ids or offsets changed after they were validated (an input buffer was "
                    "written between the lookup and apply_gradients()); no table or slot was changed."
                )
            if status != 0:
                raise non_finite_gradient(table)
            out[table.name] = TableGradient(table, None, None, accumulated=True, prepared=self._workspace(table))
        return out

    def workspace(self, table: ResolvedTable) -> native.Workspace:
        """The table's native scratch for phase 1 (reused every step; one pending update at a time)."""
        return self._workspace(table)

    def _workspace(self, table: ResolvedTable) -> native.Workspace:
        ws = self._workspaces.get(table.name)
        if ws is None:
            ws = self._workspaces[table.name] = native.Workspace(table.dim)
        return ws

    # ------------------------------------------------------------------ backward, phase 2
    def learning_rates(self) -> dict[str, float]:
        """Each table's learning rate for this step, float32 (see ``learning_rates.LearningRatePlan``)."""
        plan = self._lr_plan
        if plan is None or plan.resolved is not self.resolved:
            plan = self._lr_plan = LearningRatePlan(self.resolved)
        return plan.rates()

    # ------------------------------------------------------------------ backward, phase 2
    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> None:
        """Apply validated gradients: the fused sparse update of every table, all or nothing.

        Each table's update is first checked to write only finite rows and slots (a dry run that
        writes nothing; tables updated occurrence by occurrence are applied with a backup of their
        touched rows instead). A non-finite result raises ``InputError`` naming the table and row,
        and every table and slot is left exactly as it was. When every table was prepared natively,
        the dry runs happen in the same native call that writes (checked for all tables first).
        """
        if self._fast is not None and self._fast.apply(table_grads, lrs):  # only its own prepared gradients
            return
        in_one_call = all(tg.prepared is not None for tg in table_grads)
        writes: list[Callable[[], None]] = []
        natives: list[_NativeWrite] = []  # written together, in one native call
        for tg in table_grads:
            if tg.accumulated:
                write = self._checked_update(tg, lrs[tg.table.name], check_in_write=in_one_call)
                if isinstance(write, _NativeWrite):
                    natives.append(write)
                else:
                    writes.append(write)
        restores: list[Callable[[], None]] = []
        try:
            for tg in table_grads:
                if not tg.accumulated:
                    restores.append(self._sequential(tg, lrs[tg.table.name]))
        except BaseException:
            for restore in reversed(restores):
                restore()
            raise
        for write in writes:
            write()
        if natives:
            bad_rows = native.apply_many([(n.ws, n.weights, n.slots, n.params, n.dense, n.check) for n in natives])
            for n, bad in zip(natives, bad_rows):
                if bad >= 0:  # found by a dry run in the writing call: nothing was written
                    raise non_finite_update(n.table, bad, lrs[n.table.name])

    def check(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> None:
        """Raise exactly as ``apply`` would, but write nothing (used for an update held back by
        pipelining, so its error surfaces at ``apply_gradients`` and not at a later lookup)."""
        for tg in table_grads:
            if tg.accumulated:
                self._checked_update(tg, lrs[tg.table.name])
            else:
                self._sequential(tg, lrs[tg.table.name])()

    def _checked_update(
        self, tg: TableGradient, lr: float, *, check_in_write: bool = False
    ) -> Callable[[], None] | _NativeWrite:
        """Check one accumulated table update (writes nothing); returns the function that writes it.
        ``check_in_write``: a native update that needs the exact dry run gets it in the native call that
        writes (``native.apply_many``, all tables checked before any is written) instead of here."""
        state = self.states[tg.table.name]
        opt = tg.table.optimizer
        slots = state.slot_tuple()
        dense = not opt.lazy
        ws = tg.prepared
        if (
            ws is None
            and tg.rows is not None
            and tg.grads is not None
            and native.usable(state.weights, *slots, tg.rows, tg.grads)
        ):
            ws = self._workspace(tg.table)
            status = ws.load(tg.rows, tg.grads.contiguous(), tg.table.vocabulary_size)
            if status == 2:
                raise MemoryError(f"table {tg.table.name!r}: out of memory while loading the sparse update.")
            if status != 0:
                raise InputError(f"table {tg.table.name!r}: the update's rows are out of range or repeated.")
        decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
        if ws is not None:
            params = self._params(tg.table, lr, decay)
            if check_in_write and self._small_update(tg.table, ws, dense):
                # A dry run of a few rows costs less than the proof: check exactly in the writing call.
                return _NativeWrite(tg.table, ws, state.weights, slots, params, dense, True)
            hi, lo = ws.touched_bounds(state.weights, slots, dense=dense)
            # not proven: the exact dry run, a second pass over every touched row
            check = not update_is_finite(opt, lr, decay, ws.gradient_max_abs, hi, lo)
            if check and not check_in_write:
                bad = ws.check(state.weights, slots, params, dense=dense)
                if bad >= 0:
                    raise non_finite_update(tg.table, bad, lr)
            return _NativeWrite(tg.table, ws, state.weights, slots, params, dense, check and check_in_write)
        if self.on_gpu_kernels:
            return gpu_step.checked_update(self, tg, lr, decay)
        assert tg.rows is not None and tg.grads is not None
        rows, grads = tg.rows, tg.grads
        if dense:  # every row is updated: bounds over the whole table
            gmax = float(grads.abs().max()) if grads.numel() else 0.0
            if not update_is_finite(opt, lr, decay, gmax, *rows_bounds((state.weights, *slots), None)):
                dense_update(state, tg.table, rows, grads, lr, write=False)
            return lambda: dense_update(state, tg.table, rows, grads, lr, write=True)
        if rows.numel() == 0:
            return lambda: None
        w_new, s_new = update_rows(
            state.weights.index_select(0, rows),
            tuple(s.index_select(0, rows) for s in slots),
            grads,
            opt=opt,
            lr=lr,
            clip_gradients=True,
        )
        check_finite_rows(tg.table, rows, (w_new, *s_new), lr)

        def write() -> None:
            state.weights.index_copy_(0, rows, w_new)
            for dst, src in zip(slots, s_new):
                dst.index_copy_(0, rows, src)

        return write

    def params(self, table: ResolvedTable, lr: float) -> Any:
        """``_params`` at learning rate ``lr`` and the decay it implies."""
        opt = table.optimizer
        decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
        return self._params(table, lr, decay)

    def small_update(self, table: ResolvedTable, ws: native.Workspace) -> bool:
        """``_small_update`` of the table's prepared update (dense: a non-lazy optimizer)."""
        return self._small_update(table, ws, not table.optimizer.lazy)

    def _params(self, table: ResolvedTable, lr: float, decay: float) -> Any:
        """``native.opt_params`` of the table's optimizer, built once per (learning rate, decay): the
        config is frozen, so the block only changes with them."""
        key = (table.name, lr, decay)
        params = self._param_blocks.get(key)
        if params is None:
            if len(self._param_blocks) > 4 * len(self.resolved.tables):  # a schedule: keep the latest only
                self._param_blocks.clear()
            params = self._param_blocks[key] = native.opt_params(table.optimizer, lr, decay, clip_gradients=True)
        return params

    @staticmethod
    def _small_update(table: ResolvedTable, ws: native.Workspace, dense: bool) -> bool:
        """Whether this update is small enough that the exact dry run (in C) is cheaper than the proof
        (Python, about 10 us a table)."""
        rows = table.vocabulary_size if dense else ws.num_rows
        return rows * table.dim <= _SMALL_UPDATE_ELEMENTS

    def _sequential(self, tg: TableGradient, lr: float) -> Callable[[], None]:
        """``apply_sequential_or_restore`` on this collection's table."""
        return apply_sequential_or_restore(self.states[tg.table.name], tg, lr)

    # ------------------------------------------------------------------ torch integration
    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace every table and slot tensor ``t`` by ``fn(t)`` (used by ``Module.to``)."""
        for state in self.states.values():
            state.weights = fn(state.weights)
            state.slots = {k: fn(v) for k, v in state.slots.items()}

    def state_key_owners(self) -> dict[str, tuple[ResolvedTable, str]]:
        """``{"<table>" or "<table>/<slot>": (table, slot name or "")}``, as ``state_keys``."""
        return {
            (f"{t.name}/{slot}" if slot else t.name): (t, slot)
            for t in self.resolved.tables
            for slot in self.states[t.name].tensors()
        }

    def state_keys(self) -> dict[str, Tensor]:
        """``{"<table>": weights, "<table>/<slot>": slot}``: the TF checkpoint names (spec §7)."""
        out = {}
        for name, state in self.states.items():
            for slot, t in state.tensors().items():
                out[f"{name}/{slot}" if slot else name] = t
        return out


@dataclasses.dataclass(eq=False)
class _NativeWrite:
    """A checked native update, not yet written: ``native.apply_many`` writes several together."""

    table: ResolvedTable
    ws: native.Workspace
    weights: Tensor
    slots: tuple[Tensor, ...]
    params: Any
    dense: bool
    check: bool = False  # the exact dry run runs in the writing call


# Updates of at most this many rows x D (about 170 rows of 24) are checked by the exact dry run in C rather
# than proven finite in Python: at that size both cost about the same (10 us a table, measured).
_SMALL_UPDATE_ELEMENTS = 1 << 12
