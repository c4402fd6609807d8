"""``EmbeddingCollection``: all tables of a resolved config in one process, with the pooled lookup
and the fused sparse update. ``DistributedEmbedding`` (``embtables.api``) wraps it with the TF verbs.

The collection orchestrates; the arithmetic is its backend's (``tables/backends/``), chosen once for the
tables' device, with the torch reference serving whatever the backend leaves. Every ``apply`` is
two-phase: phase 1 computes and validates every table's gradient (shapes, finiteness, learning rates)
without touching state; phase 2 checks every update, then writes. A bad batch therefore changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import ConfigError
from embtables.kernels import native
from embtables.kernels.affine_rows import GlobalRows
from embtables.kernels.clip_decay import optimizer_decay
from embtables.tables.backends import Backend, BagPart, GradientPart, Prepared, TableSet, TorchBackend, choose, switches
from embtables.tables.changed_rows import ChangedRows
from embtables.tables.dynamic_vocabularies import Vocabularies
from embtables.tables.gradient_checks import GradientChecks
from embtables.tables.inputs import FeatureBatch
from embtables.tables.learning_rates import LearningRatePlan
from embtables.tables.offload_cache import OffloadedRows
from embtables.tables.offload_initial import OffloadShard
from embtables.tables.offloaded_tables import Admission, OffloadedTables
from embtables.tables.state import TableState, create_table_state, initial_rows
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import NonFiniteUpdateError


@dataclasses.dataclass(eq=False)
class CheckedStep:
    """A step's updates, checked: the F table gradients with their learning rates and training step, and what
    the backend (``own``) and the reference (``rest``) write for the accumulated ones."""

    table_grads: list[TableGradient]
    lrs: dict[str, float]
    step: int
    own: list[Any]
    rest: list[Any]


class EmbeddingCollection:
    """Tables of ``resolved`` on ``device``; single process. A plain object: the ``nn.Module``
    integration (``.to()``, ``state_dict``) lives in ``DistributedEmbedding``."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        device: torch.device,
        *,
        deferred_errors: bool = True,
        offload: dict[str, OffloadShard] | None = None,
    ) -> None:
        self.resolved = resolved
        # False: a GPU backend raises every error in the call that finds it (the sharded engine's local tables)
        self.deferred_errors = deferred_errors
        self.states: dict[str, TableState] = {}
        # offloaded tables (``TableConfig.offload``): their files and row caches; ``offload`` says which shard
        caches: dict[str, OffloadedRows] = {}
        self.offloaded = OffloadedTables(resolved, caches)
        try:
            for t in resolved.tables:
                made = create_table_state(t, device, (offload or {}).get(t.name))
                if isinstance(made, OffloadedRows):
                    caches[t.name] = made
                    weights, slots = made.state_tensors()
                    made_state = TableState(weights=weights, slots=slots)
                else:
                    made_state = made
                self.states[t.name] = made_state
        except BaseException:
            self.close()
            raise
        self.vocabularies = Vocabularies(resolved)  # the key maps of dynamic tables (spec §11)
        # rows written since the last save (an offloaded table's: a flag a cache slot, a bit a row in its cache)
        self.changed = ChangedRows(self.states, caches)
        self._build()

    def _build(self) -> None:
        """What the collection derives from its config, states and tracking (built again after unpickling)."""
        self._lr_plan: LearningRatePlan | None = None  # built at the first step, see learning_rates()
        self._tables = TableSet(self.resolved, self.states, self.changed)
        self._tables.global_rows.update(self.vocabularies.row_keys)  # a dynamic half table rounds by key
        for name in self.offloaded:  # an offloaded half table rounds each cache slot by its row's global id
            if self.resolved.tables[self.resolved.table_names.index(name)].config.half:
                self._tables.global_rows[name] = self.offloaded[name].slot_global
                if name in self.vocabularies.row_keys:  # a dynamic one: by its row's key
                    self.offloaded[name].round_by(self.vocabularies.row_keys[name])
        self.reference = TorchBackend(self._tables)
        self._backend: Backend | None = None  # chosen at the first call, see backend
        self._switches = -1
        self._sequential_tables = any(not t.optimizer.use_gradient_accumulation for t in self.resolved.tables)
        self._gradients = GradientChecks(self._tables)
        # the native marking call of the last step's workspaces (``_mark_written``), built once while they stay
        self._mark_plan: tuple[list[Any], dict[str, Tensor], Callable[[], None] | None] | None = None

    def set_global_rows(self, rows: dict[str, GlobalRows]) -> None:
        """Per sharded half-precision table, the global row id of every local row (``AffineRows``: its block or
        stride): what its updates are rounded with (``TableSet.global_ids``)."""
        self._tables.global_rows.update(rows)

    @property
    def device(self) -> torch.device:
        return self._tables.device

    @property
    def backend(self) -> Backend:
        """The backend chosen for the tables' device (``tables.backends.choose``)."""
        backend = self._backend
        if backend is None or self._switches != switches():
            if backend is not None:
                backend.settle()  # what the old backend found is raised, not lost with it
            self._switches = switches()
            backend = self._backend = choose(self._tables, deferred_errors=self.deferred_errors)
        return backend

    def close(self) -> None:
        """Close the offloaded tables' files (their locks released)."""
        self.offloaded.close()

    def __getstate__(self) -> dict[str, Any]:
        if self.offloaded:
            raise TypeError(
                f"an embedding collection with offloaded tables ({self.offloaded.names()}) keeps its rows in files "
                "it has locked; it cannot be copied or pickled. Save a checkpoint (save/restore) instead."
            )
        # The backend's scratch (C workspaces, ctypes blocks) belongs to this process: a copy or a pickle
        # chooses its backend again.
        state = self.__dict__.copy()
        for built in ("_backend", "_lr_plan", "_tables", "reference", "_mark_plan", "_gradients"):  # see _build
            state.pop(built, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A collection pickled by an earlier embtables holds its native scratch under other names and no
        # TableSet: keep the tables, states and key maps, build the rest.
        for stale in ("_workspaces", "_param_blocks", "_fast"):
            state.pop(stale, None)
        state.setdefault("deferred_errors", True)  # pickled before the choice existed
        if not isinstance(state.get("offloaded"), OffloadedTables):  # pickled as a dict (never with a table)
            state["offloaded"] = OffloadedTables(state["resolved"], {})
        self.__dict__.update(state)
        if "changed" not in state:  # pickled before rows were tracked: every row counts as changed
            self.changed = ChangedRows(self.states)
            self.changed.mark_all()
        self._build()

    # ------------------------------------------------------------------ forward
    def translate_keys(
        self, batches: Sequence[FeatureBatch], training: bool, step: int, pin_from: int
    ) -> list[FeatureBatch]:
        """Batches whose dynamic features hold rows instead of keys (spec §11), the rows a training lookup
        gave to new keys reset to the table's initial values first; and whose offloaded tables' features hold
        their cache's slots, the rows admitted first (``OffloadedTables.admit``: refused, changing nothing,
        when a cache cannot hold them). Other batches pass unchanged."""
        out = list(batches)
        if self.vocabularies:
            if training and self.offloaded:  # refused before any key map changes
                self.offloaded.check_room(batches, pin_from)
            out, resets = self.vocabularies.translate(batches, training, step, pin_from)
            for name, rows in resets.items():
                if rows.numel():
                    self.reset_rows(name, rows)
        if self.offloaded:
            out = self.offloaded.admit(out, Admission(step, pin_from, training))
        return out

    def reset_rows(self, name: str, rows: Tensor) -> None:
        """Give rows [R] of table ``name`` fresh initial values (weights and slots): a dynamic table's rows
        handed to new keys."""
        table = self.resolved.tables[self.resolved.table_names.index(name)]
        rows = rows.to(self.device)
        state = self.states[table.name]
        weights, slots = initial_rows(table, rows.numel(), self.device)
        cache = self.offloaded.get(name)
        if cache is not None:  # in its cache where the row is there, else in its files
            cache.reset(rows, weights, slots)
            return
        with torch.no_grad():
            state.weights.index_copy_(0, rows, weights)
            for slot, values in slots.items():
                state.slots[slot].index_copy_(0, rows, values)
        self.changed.mark(table.name, rows)

    def lookup(self, batches: Sequence[FeatureBatch], concat: bool = False) -> list[Tensor]:
        """Activations per feature, [*out_shape, D], in feature order; ``concat``: one tensor [B, sum(D)],
        the features' activations side by side (every batch must pool to the same B bags). An offloaded
        table's batches hold its cache's slots (``translate_keys``). The backend serves what it can (with
        ``concat`` and every feature served, straight into the one output), the reference the rest; every
        activation is checked finite."""
        got = self.backend.lookup(batches, concat)
        if got.wide is not None:
            return [got.wide]
        if got.complete:
            return cast("list[Tensor]", got.acts)  # every feature served: no None left
        acts = [self.reference.lookup_feature(i, b) if a is None else a for i, (a, b) in
                enumerate(zip(got.acts, batches))]  # fmt: skip
        self._tables.check_finite(acts, got.checked)
        return [torch.cat(acts, dim=1)] if concat else acts

    def check_activations(self, activations: Sequence[Tensor]) -> None:
        """Raise naming the first feature (of this config's) whose activations [*, D] are not all finite."""
        self._tables.check_finite(activations)

    def all_finite(self, tensors: Sequence[Tensor]) -> bool:
        """Whether every value of the float32 ``tensors`` is finite (one native pass over CPU tensors)."""
        return native.all_finite(list(tensors))

    def pool(self, parts: Sequence[BagPart]) -> tuple[list[Tensor], int]:
        """Pooled bags [S, D] of ``parts`` (weights, ids, offsets, coeffs) and a status (``backends.interface``:
        0 pooled, 1 an id outside its weights, 2 a non-finite output): the sharded engine's partial lookups."""
        self._tables.check_storage()
        return self.backend.pool(parts) or self.reference.pool(parts)

    # ------------------------------------------------------------------ backward, phase 1
    def check_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Any], *, column_block: bool = False
    ) -> list[Tensor | None]:
        """Every feature's activation gradient validated (``GradientChecks.check_all``)."""
        return self._gradients.check_all(batches, grads, column_block=column_block)

    def table_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> list[TableGradient]:
        """Per-table gradients from per-feature activation gradients [S, D] (None = zero), in table order."""
        served = self.backend.table_gradients(batches, grads)
        tables = self.resolved.tables
        if len(served) == len(tables):
            return list(served.values())
        return [served.get(t.name) or self.reference.table_gradient(t, batches, grads) for t in tables]

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared:
        """Phase 1 of gradient ``parts`` of this collection's ``table`` (``Backend.prepare``)."""
        return self.backend.prepare(table, parts, scratch=scratch) or self.reference.prepare(table, parts)

    # ------------------------------------------------------------------ backward, phase 2
    def learning_rates(self) -> dict[str, float]:
        """Each table's learning rate for this step, float32 (see ``learning_rates.LearningRatePlan``)."""
        plan = self._lr_plan
        if plan is None or plan.resolved is not self.resolved:
            plan = self._lr_plan = LearningRatePlan(self.resolved)
        return plan.rates()

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        """Apply validated gradients: the fused sparse update of every table, all or nothing. ``step``: the
        training step of the update (a half-precision table's rounding depends on it, spec §12).

        Each table's update is first checked to write only finite rows and slots (proven from bounds on the
        values it reads, else a dry run that writes nothing; tables updated occurrence by occurrence are
        applied with a backup of their touched rows instead). A non-finite result raises ``InputError``
        naming the table and row, and every table and slot is left exactly as it was. When every table was
        prepared natively, the dry runs happen in the same native call that writes (checked for all tables
        first).
        """
        try:
            self._apply(table_grads, lrs, step)
        except NonFiniteUpdateError as exc:
            raise self._row_named(exc) from None

    def _apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], step: int) -> None:
        self._refuse_closed(table_grads)
        self._tables.step = step
        backend = self.backend
        if backend.write_step(table_grads, lrs):  # the whole phase 2 in one call (its tensors checked current)
            self._mark_written(table_grads)
            return
        self._tables.check_storage()
        in_one_call = all(tg.prepared is not None for tg in table_grads)
        own, rest = self._checked_updates(table_grads, lrs, check_in_write=in_one_call)
        if rest or self._sequential_tables:
            backend.settle()  # other writes come first: every check of the backend's must be read now
        # only the backend's writes may still refuse (a check left to its writing call, all or nothing):
        # with check_in_write every update is the backend's, so nothing else was written before it
        self._write(CheckedStep(list(table_grads), lrs, step, own, rest))

    def _write(self, step: CheckedStep) -> None:
        """The tables updated occurrence by occurrence (each with a backup: all put back if one refuses), then
        the checked updates, the reference's and the backend's; the rows they changed recorded."""
        restores: list[Callable[[], None]] = []
        try:
            for tg in step.table_grads:
                if not tg.accumulated:
                    restores.append(self._sequential(tg, step.lrs[tg.table.name]))
        except BaseException:
            for restore in reversed(restores):
                restore()
            raise
        self.reference.write(step.rest)
        self.backend.write(step.own)
        self._mark_written(step.table_grads)

    def _mark_written(self, table_grads: Sequence[TableGradient]) -> None:
        """Record the rows a step's writes changed (``ChangedRows``): every row of a non-lazy optimizer's
        table; the prepared native updates' rows in one native call (its arguments built once while the
        step's workspaces and flags are the same objects, as they are from step to step); a GPU share's by
        its write kernel (not when the step is refused); any other update's rows from its gradient."""
        plan = self._mark_plan
        flags = self.changed.flags
        spaces = [tg.prepared for tg in table_grads]
        if (
            plan is None
            or plan[1] is not flags
            or len(plan[0]) != len(spaces)
            or any(a is not b for a, b in zip(plan[0], spaces))
        ):
            prepared: list[tuple[Any, Tensor, bool, int]] = []
            for tg in table_grads:
                if tg.prepared is not None:
                    dense = not tg.table.optimizer.lazy and tg.accumulated
                    name = tg.table.name
                    prepared.append((tg.prepared, flags[name], dense, self.changed.sizes[name]))
            plan = self._mark_plan = (spaces, flags, native.changed_marker(prepared) if prepared else None)
        if plan[2] is not None:
            plan[2]()
        for tg in table_grads:
            if tg.prepared is None and tg.deferred is None:
                if not tg.table.optimizer.lazy and tg.accumulated:
                    self.changed.mark_all(tg.table.name)
                elif tg.rows is not None:
                    self.changed.mark(tg.table.name, tg.rows)

    def check(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        """Raise exactly as ``apply`` would, but write nothing (one process's pipelined update, so its error
        surfaces at ``apply_gradients``)."""
        self.checked_step(table_grads, lrs, step=step)

    def checked_step(
        self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0
    ) -> CheckedStep:
        """Raise exactly as ``apply`` would, but write nothing, and keep what the check proved: ``write_checked``
        then writes the step without reading its rows again. Only for a write that follows in the same call,
        nothing else touching the tables in between (a sharded step's agreement): a tensor edited after the proof
        would be written unchecked."""
        try:
            return self._checked_step(table_grads, lrs, step)
        except NonFiniteUpdateError as exc:
            raise self._row_named(exc) from None

    def _checked_step(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], step: int) -> CheckedStep:
        self._refuse_closed(table_grads)
        self._tables.step = step
        self._tables.check_storage()
        own, rest = self._checked_updates(table_grads, lrs, check_in_write=False)
        self.backend.settle()
        for tg in table_grads:
            if not tg.accumulated:
                self._sequential(tg, lrs[tg.table.name])()
        return CheckedStep(list(table_grads), dict(lrs), step, own, rest)

    def write_checked(self, checked: CheckedStep) -> None:
        """Write a step ``checked_step`` checked (all or nothing, as ``apply``; no check is left to the writes)."""
        self._tables.step = checked.step
        self._write(checked)

    def _row_named(self, exc: NonFiniteUpdateError) -> NonFiniteUpdateError:
        """The refusal naming the table's own row: an offloaded table's names the row its cache slot holds (a
        refusal changes no slot); any other is ``exc`` itself."""
        if exc.table is None or exc.table.name not in self.offloaded:
            return exc
        return exc.renamed(int(self.offloaded.local_rows(exc.table.name, torch.tensor([exc.row]))[0]))

    def _refuse_closed(self, table_grads: Sequence[TableGradient]) -> None:
        """An update of an offloaded table whose files were released (``close``) is refused before anything is
        written (its lookup came before the close); what was written through its files' maps since the lookup
        is taken into its cache first (``OffloadedTables.before_update``)."""
        if self.offloaded:  # the common case has none: nothing to look up per table and step
            self.offloaded.before_update([tg.table.name for tg in table_grads])

    def _checked_updates(
        self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, check_in_write: bool
    ) -> tuple[list[Any], list[Any]]:
        """Check every accumulated update (writes nothing): the backend's (all tables together), then the
        reference's for those it does not serve. Returns (the backend's writes, the reference's)."""
        rates = [(tg, lrs[tg.table.name]) for tg in table_grads if tg.accumulated]
        updates = [(tg, lr, optimizer_decay(tg.table.optimizer, lr)) for tg, lr in rates]
        if not updates:
            return [], []
        own = self.backend.checked_updates(updates, check_in_write=check_in_write)
        rest = [self.reference.checked_update(*u) for u, write in zip(updates, own) if write is None]
        return [write for write in own if write is not None], rest

    def _sequential(self, tg: TableGradient, lr: float) -> Callable[[], None]:
        """A no-accumulation update, applied with a backup; returns what undoes it."""
        return self.backend.sequential(tg, lr) or self.reference.sequential(tg, lr)

    # ------------------------------------------------------------------ torch integration
    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace every table and slot tensor ``t`` by ``fn(t)`` (used by ``Module.to``)."""
        for name, state in self.states.items():
            if name in self.offloaded and (fn(state.weights[:0]).device != state.weights.device):
                raise ConfigError(
                    f"table {name!r} is offloaded (its rows in files on this machine): it stays on the CPU; "
                    "the module cannot move to another device. Drop `offload` to train it on a GPU."
                )
        if self._backend is not None:
            self._backend.settle()  # what the device found is raised before its backend goes
        for name, state in self.states.items():
            if name in self.offloaded:
                continue  # its cache stays on the CPU (checked above), the block its rows are read into
            state.weights = fn(state.weights)
            state.slots = {k: fn(v) for k, v in state.slots.items()}
        self.changed.map(fn)
        self._backend = None  # chosen again for the new device

    def state_key_owners(self) -> dict[str, tuple[ResolvedTable, str]]:
        """``{"<table>" or "<table>/<slot>": (table, slot name or "")}``, as ``state_keys``."""
        return {
            (f"{t.name}/{slot}" if slot else t.name): (t, slot)
            for t in self.resolved.tables
            for slot in self.states[t.name].tensors()
        }

    def state_keys(self) -> dict[str, Tensor]:
        """``{"<table>": weights, "<table>/<slot>": slot}``: the TF checkpoint names (spec §7), the whole
        tables (an offloaded table's: its files' maps, ``whole_tensors``)."""
        out = {}
        for name in self.states:
            for slot, t in self.whole_tensors(name).items():
                out[f"{name}/{slot}" if slot else name] = t
        return out

    def whole_tensors(self, name: str) -> dict[str, Tensor]:
        """``{"" or slot: [V, D]}``: table ``name`` whole: its state's tensors, or an offloaded table's files'
        maps (``OffloadedTables.whole`` first, so that they hold it)."""
        cache = self.offloaded.get(name)
        return self.states[name].tensors() if cache is None else cache.file_tensors()
