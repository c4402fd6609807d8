"""``DistributedEmbedding``: the TPUEmbedding programming model as a ``torch.nn.Module``.

    emb = DistributedEmbedding(feature_config, optimizer=embtables.Adagrad(0.1))
    acts = emb(features)               # or emb.enqueue(features); acts = emb.dequeue()
    loss(acts).backward()
    emb.apply_gradients()              # or emb.apply_gradients(d_loss_d_acts)

Tables and slots are not ``nn.Parameter``s: like on a TPU they are updated only by the fused
sparse optimizer, so a ``torch.optim`` over ``model.parameters()`` never touches them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from embtables import checkpoint
from embtables.checkpoint.progress import progress_bar
from embtables.config import Optimizer, ResolvedConfig, nest, resolve
from embtables.sharding import comm
from embtables.sharding.lookup_stats import LookupStatsRecorder, merge, read_loads, write_stats
from embtables.sharding.plan import TablePlan
from embtables.sharding.sharded_collection import LookupContext, ShardedEmbeddingCollection
from embtables.sharding.strategies import check_sharding, place_tables
from embtables.tables.batch_ownership import (
    Staging,
    batch_pointers,
    detached,
    flatten_inputs,
    is_input_leaf,
    owned,
    storages,
)
from embtables.tables.collection import TableGradient
from embtables.tables.engine import Engine, OneProcessEngine
from embtables.tables.inputs import FeatureBatch, InputConverter, convert_many
from embtables.tables.state import LocalShard
from embtables.tables.state_dict_io import TableDict, strict_of_caller, validate_state_dict

logger = logging.getLogger("embtables")


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _locked(method: _F) -> _F:
    """Run ``method`` holding the module's lock: one thread at a time touches tables, slots and the
    native workspaces (ctypes releases the GIL, so two threads could otherwise race in C)."""

    @functools.wraps(method)
    def wrapper(self: DistributedEmbedding, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


@dataclasses.dataclass(eq=False)
class _Staged:
    """An enqueued batch: its features (None when refused), the mode, and, when sharded, this rank's
    validation error (raised on every rank at the lookup) and the lookup started early by pipelining."""

    batches: list[FeatureBatch] | None
    training: bool
    step: int  # the training step it looks up for (its phase header's step)
    refused: BaseException | None = None
    prefetch: concurrent.futures.Future[tuple[list[Tensor], LookupContext | None]] | None = None


@dataclasses.dataclass(eq=False)
class _Lookup:
    """What the last training lookup left for ``apply_gradients``."""

    batches: list[FeatureBatch]
    activations: list[Tensor]
    context: LookupContext | None = None


@dataclasses.dataclass(eq=False)
class _PendingUpdate:
    """A validated update held back one step by pipelining (spec §6)."""

    table_grads: list[TableGradient]
    lrs: dict[str, float]


class DistributedEmbedding(nn.Module):
    """Embedding tables with TF ``TPUEmbedding`` semantics, in one process or sharded over many.

    Args:
      feature_config: a nest (dict, list, tuple, nested) of ``FeatureConfig``. Activations come back
        in the same nest. Features (and so tables, in order of first appearance) are flattened in
        ``tf.nest`` order, i.e. dict keys sorted; unnamed tables become ``table_{i}`` in that order.
      optimizer: the global optimizer for tables whose ``TableConfig.optimizer`` is None.
      pipeline_execution_with_tensor_core: when True, the lookup of step t+1 reads the tables before
        the update of step t is applied (one step stale, spec §6); updates still apply in order.
      device: where tables, slots and activations live (default CPU).
      sharding: how tables are spread over the ranks of the process group when its world size W > 1:
        "div" (default, as TF: contiguous row blocks), "mod" (row id modulo W), "table" (whole tables
        on ranks, balanced by size and measured lookup load), "auto" (per table, from the lookup
        statistics), or a dict table name -> strategy. Ignored (one process owns everything) when
        W == 1 or no process group is initialised.
      process_group: the torch.distributed group to shard over (default: the default group).
      timeout: seconds after which a collective gives up when another rank raised, died or never
        arrived (a dedicated group is created with it; default: the process group's own timeout).
        Every rank then raises ``CollectiveError`` instead of hanging.
      profile_data_directory: where lookup statistics are written (one JSON file per table, at
        ``flush()``) and read back at construction to place "table"/"auto" tables (spec §5).
      profile_sample_rate, profile_seed: the share of training steps sampled (about 3%) and its seed.

    Sharded, every rank passes its own local batch and calls the same methods in the same order;
    ``state_dict()``, ``embedding_tables`` and ``slot_variables`` gather the full logical tables
    (every rank must call them), ``local_shards()`` gives this rank's rows without communicating.
    """

    def __init__(
        self,
        feature_config: Any,
        optimizer: Optimizer | None = None,
        pipeline_execution_with_tensor_core: bool = False,
        device: torch.device | str | None = None,
        sharding: str | Mapping[str, str] = "div",
        process_group: Any = None,
        timeout: float | None = None,
        profile_data_directory: str | os.PathLike[str] | None = None,
        profile_sample_rate: float = 0.03,
        profile_seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(pipeline_execution_with_tensor_core, bool):
            raise TypeError(
                "DistributedEmbedding: `pipeline_execution_with_tensor_core` must be a bool, got "
                f"{pipeline_execution_with_tensor_core!r}."
            )
        self._resolved: ResolvedConfig = resolve(feature_config, optimizer)
        self._feature_config = feature_config
        self.pipeline_execution_with_tensor_core = pipeline_execution_with_tensor_core
        dev = torch.device(device) if device is not None else torch.device("cpu")
        check_sharding(sharding, self._resolved)
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"DistributedEmbedding: `timeout` must be a positive number of seconds, got {timeout!r}.")
        self._sharded = comm.is_distributed(process_group) and comm.get_world_size(process_group) > 1
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._engine: Engine
        loads = read_loads(profile_data_directory, self._resolved)
        if self._sharded:
            comm.clean_exit()  # the program may never call destroy_process_group(): leave cleanly at exit
            group = process_group if timeout is None else comm.new_group(float(timeout), process_group)
            placements = place_tables(self._resolved, sharding, comm.get_world_size(group), loads)
            self._engine = ShardedEmbeddingCollection(self._resolved, dev, placements, group, settings=self._settings())
            plans = self._engine.plans
            if pipeline_execution_with_tensor_core:  # collectives run on one thread, in program order
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embtables-exchange")
        else:
            self._engine = OneProcessEngine(self._resolved, dev, process_group)
            plans = {t.name: TablePlan("div", t.vocabulary_size, 1, 0) for t in self._resolved.tables}
        self._profile_dir = None if profile_data_directory is None else os.fspath(profile_data_directory)
        self._stats = (
            None
            if self._profile_dir is None
            else LookupStatsRecorder(self._resolved, plans, profile_sample_rate, profile_seed)
        )
        self._training_steps = 0
        self._group = process_group
        self._converters = [InputConverter(f, self._resolved.tables[f.table_index]) for f in self._resolved.features]
        self._names_by_config = {id(t.config): t.name for t in self._resolved.tables}
        self._built = False
        self._enqueued: _Staged | None = None
        self._last: _Lookup | None = None
        self._pending: _PendingUpdate | None = None
        # Pipelining: pre-update values of the rows an observer-triggered flush updated early, so the
        # next training lookup still reads them one step stale: {table: (rows [U], weights [U, D])}.
        self._stale: dict[str, tuple[Tensor, Tensor]] = {}
        self._staging = Staging()
        self._lock = threading.RLock()
        self._torn: str | None = None  # a restore interrupted half-way: refuse to train or save until one succeeds

    def _settings(self) -> dict[str, Any]:
        """Module settings that change results, beyond the config: in the rank fingerprint and manifests."""
        return {"pipeline_execution_with_tensor_core": self.pipeline_execution_with_tensor_core}

    def __getstate__(self) -> dict[str, Any]:
        if self._sharded:
            raise TypeError(
                "a sharded DistributedEmbedding cannot be copied or pickled: its rows live in several processes. "
                "Use state_dict() (full tables) or local_shards() (this rank's rows) instead."
            )
        state = super().__getstate__()  # type: ignore[no-untyped-call]
        state = dict(state)
        state.pop("_lock", None)
        state.pop("_worker", None)
        state["_staging"] = Staging()  # scratch buffers: a copy owns fresh ones
        live = [b for b in (state.get("_enqueued"), state.get("_last")) if b is not None]
        if live:  # batches that point into the staging buffers get their own storage in the copy
            staged = self._enqueued
            if staged is not None:
                batches = detached(staged.batches) if staged.batches is not None else None
                state["_enqueued"] = dataclasses.replace(staged, batches=batches, prefetch=None)
            last = self._last
            state["_last"] = last and _Lookup(detached(last.batches), last.activations, last.context)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._lock = threading.RLock()
        self._worker = None

    # ------------------------------------------------------------------ properties
    @property
    def feature_config(self) -> Any:
        return self._feature_config

    @property
    def resolved_config(self) -> ResolvedConfig:
        """Tables (with final names and optimizers) and features, as resolved at construction."""
        return self._resolved

    @property
    def sharding_plan(self) -> dict[str, str]:
        """``{table name: "div" | "mod" | "table@<rank>"}`` when sharded; empty in one process."""
        if self._engine.world == 1:
            return {}
        return {n: str(p.placement) for n, p in self._engine.plans.items()}

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    @_locked
    def embedding_tables(self) -> dict[str, Tensor]:
        """``{table name: weights [V, D]}`` (live tensors, after any pipelined update); the
        ``TableConfig`` object works as a key too, as in TF."""
        self._flush(observer=True)
        full = self._exchange(self._engine, "state read", self._engine.full_state)
        return TableDict({t.name: full[t.name] for t in self._resolved.tables}, self._names_by_config)

    @property
    @_locked
    def slot_variables(self) -> dict[str, dict[str, Tensor]]:
        """``{table name: {slot name: [V, D]}}`` with TF's slot names (live tensors); the
        ``TableConfig`` object works as a key too."""
        self._flush(observer=True)
        full = self._exchange(self._engine, "state read", self._engine.full_state)
        slots = {t.name: {s: full[f"{t.name}/{s}"] for s in t.optimizer.slot_names} for t in self._resolved.tables}
        return TableDict(slots, self._names_by_config)

    def build(self, per_replica_input_shapes: Any = None, per_replica_batch_size: int | None = None) -> None:
        """TF compatibility: tables are created at construction, so this only checks TF's rules
        (both arguments together raise ``ValueError``; a second call logs a warning)."""
        if per_replica_input_shapes is not None and per_replica_batch_size is not None:
            raise ValueError(
                "DistributedEmbedding.build: pass `per_replica_input_shapes` or `per_replica_batch_size`, not both."
            )
        if self._built:
            logger.warning("DistributedEmbedding.build: already built; this call does nothing.")
        self._built = True

    # ------------------------------------------------------------------ forward
    @_locked
    def enqueue(self, features: Any, weights: Any = None, training: bool = True) -> None:
        """Validate and stage a batch (TF ``enqueue``); ``training=False`` is a forward-only lookup.

        ``features`` / ``weights`` follow the nest of ``feature_config``; see ``embtables.Ragged``
        for the accepted input types. Raises (and stages nothing) on any invalid input.
        """
        if training:
            self._refuse_if_torn("enqueue")
        try:
            flat_x, flat_w = flatten_inputs(self._feature_config, features, weights)
            device = self.device
            busy = batch_pointers(self._last.batches) if self._last is not None else set()
            if self._enqueued is not None and self._enqueued.batches is not None:
                busy |= batch_pointers(self._enqueued.batches)  # kept until this batch is valid
            converted = convert_many(self._converters, flat_x, flat_w, device)
            batches = [
                owned(b, storages(x) | storages(w), self._staging, i, busy)
                for i, (b, x, w) in enumerate(zip(converted, flat_x, flat_w))
            ]
        except (ValueError, TypeError) as exc:
            if not self._sharded:
                raise  # a bad enqueue changes nothing
            # Sharded: every rank must refuse this step together, at the lookup (dequeue). Pipelined,
            # the refusing rank joins the early lookup's agreement round on the exchange thread like
            # the others, so every rank's collectives stay in the same order.
            self._drop_prefetch()
            refused = _Staged(None, bool(training), self._lookup_step(bool(training)), refused=exc)
            if self._worker is not None and refused.training:
                refused.prefetch = self._worker.submit(self._lookup, refused)
            self._enqueued = refused
            return
        self._drop_prefetch()
        staged = _Staged(batches, bool(training), self._lookup_step(bool(training)))
        if self._worker is not None and staged.training:
            # Pipelining: the id exchange and lookup of this step run now, overlapping the caller's dense
            # compute; they read the tables before the pending update, as the pipelined lookup must.
            staged.prefetch = self._worker.submit(self._lookup, staged)
        self._enqueued = staged

    @_locked
    def dequeue(self) -> Any:
        """The activations of the last enqueued batch, in the nest of ``feature_config``.

        In training mode each activation is a leaf tensor that requires grad, so ``loss.backward()``
        leaves d(loss)/d(activation) in its ``.grad`` for ``apply_gradients()``.
        """
        if self._enqueued is None:
            raise RuntimeError("DistributedEmbedding.dequeue: nothing was enqueued. Call enqueue(features) first.")
        staged = self._enqueued
        self._enqueued = None
        training = staged.training
        if not training:
            self._flush(observer=True)  # pipelining affects training lookups only
        if staged.prefetch is not None:
            acts, context = staged.prefetch.result()
        else:
            acts, context = self._run(functools.partial(self._lookup, staged))
        if training:
            assert staged.batches is not None
            if self._last is not None:
                logger.warning(
                    "DistributedEmbedding: a training lookup's gradients were never applied before the next "
                    "training lookup; they are dropped. Call apply_gradients() once after each training lookup, "
                    "or look up with training=False / module.eval() for inference."
                )
            acts = [a.requires_grad_(True) for a in acts]
            self._last = _Lookup(staged.batches, acts, context)
            if self._stats is not None and self._stats.should_sample(self._training_steps):
                b = staged.batches
                self._stats.record(
                    [x.ids for x in b], [x.out_shape[0] if x.out_shape else 1 for x in b], [x.dropped for x in b]
                )
            self._training_steps += 1
            self._flush()  # the pending update of the previous step lands after this step's lookup
        return nest.pack_sequence_as(self._feature_config, acts)

    def _lookup_step(self, training: bool) -> int:
        """The step a lookup belongs to: the next training step, or (eval) the last one trained."""
        return self._training_steps + 1 if training else self._training_steps

    def _lookup(self, staged: _Staged) -> tuple[list[Tensor], Any]:
        """The lookup of a staged batch (on the exchange thread when pipelining is sharded)."""
        with torch.no_grad(), self._stale_rows_swapped_in(staged.training):
            self._engine.check_phase("lookup" if staged.training else "eval lookup", staged.step)
            return self._engine.lookup(staged.batches or [], staged.refused)

    def _run(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` where this module's collectives run: on the exchange thread when there is one, so
        every rank issues them in program order; else here."""
        if self._worker is None:
            return fn()
        return self._worker.submit(fn).result()

    def _exchange(self, engine: Engine, phase: str, fn: Callable[[], _T]) -> _T:
        """An operation's collectives (``_run``), preceded by its phase header: ranks out of step raise
        ``CollectiveError`` on every rank before any data moves (in one process, just ``fn()``)."""
        step = self._training_steps

        def run() -> _T:
            engine.check_phase(phase, step)
            return fn()

        return self._run(run)

    def _drop_prefetch(self) -> None:
        """Wait for a lookup started early (a staged batch being replaced, or tables about to change)."""
        staged = self._enqueued
        if staged is not None and staged.prefetch is not None:
            concurrent.futures.wait([staged.prefetch])

    @_locked
    def forward(self, features: Any, weights: Any = None) -> Any:
        """``enqueue(features, weights, training=self.training)`` then ``dequeue()``."""
        self.enqueue(features, weights, training=self.training)
        return self.dequeue()

    # ------------------------------------------------------------------ backward
    @_locked
    def apply_gradients(self, gradients: Any = None) -> None:
        """Apply the fused sparse update for the last training lookup.

        Args:
          gradients: None to use the activations' ``.grad`` left by ``loss.backward()``, or a nest
            (same structure as ``feature_config``) of d(loss)/d(activation) tensors shaped like the
            activations; a ``None`` entry is a zero gradient (its rows are still "touched").

        Raises ``ValueError``/``TypeError`` for a bad gradient (wrong shape, dtype, NaN/Inf reaching
        a table) and ``RuntimeError`` when there is no training lookup to apply to; in every case no
        table or slot changes.
        """
        self._refuse_if_torn("apply_gradients")
        if self._last is None:
            raise RuntimeError(
                "DistributedEmbedding.apply_gradients: no training lookup to apply gradients to. Call the "
                "module (in train mode) or enqueue(..., training=True) + dequeue() first; each lookup takes "
                "one apply_gradients."
            )
        last = self._last
        if gradients is None:
            flat_g: list[Any] = [a.grad for a in last.activations]
            for f, g in zip(self._resolved.features, flat_g):
                if g is None:
                    logger.warning("feature %r: no gradient reached its activation; applying a zero gradient.", f.name)
        else:
            nest.assert_same_structure(self._feature_config, gradients, what="gradients", is_leaf=is_input_leaf)
            flat_g = nest.flatten(gradients)
            for f, g in zip(self._resolved.features, flat_g):
                if g is None:
                    logger.warning("feature %r: gradient is None; applying a zero gradient.", f.name)
        engine = self._engine
        refused: BaseException | None = None
        try:
            checked = [engine.check_gradient(i, b, g) for i, (b, g) in enumerate(zip(last.batches, flat_g))]
        except (ValueError, TypeError) as exc:
            if engine.world == 1:
                raise
            refused, checked = exc, [None] * len(flat_g)  # every rank refuses this step together
        self._flush()  # a held-back update lands first: phase 1 below reuses the tables' native workspaces
        table_grads = self._exchange(
            engine, "apply_gradients", lambda: engine.table_gradients(last.batches, checked, last.context, refused)
        )
        lrs = engine.learning_rates()
        update = _PendingUpdate(table_grads, lrs)
        if self.pipeline_execution_with_tensor_core:
            # Nothing changes the tables before this update lands, so check it now: a non-finite
            # update raises here, like in a synchronous run, instead of at the next lookup.
            self._run(lambda: engine.check(update.table_grads, update.lrs))
            self._pending = update
        else:
            self._run(lambda: engine.apply(update.table_grads, update.lrs))
        # Consumed only once applied: after any refusal the lookup stays, to retry with another gradient.
        self._last = None

    def _flush(self, *, observer: bool = False) -> None:
        """Apply a held-back (pipelined) update. ``observer=True`` is a flush forced by reading or
        moving the state before the next training lookup: the pre-update values of the touched rows
        are kept so that lookup still reads them one step stale (observing never changes training).
        A flush that fails (the update would not be finite) drops the update and changes nothing."""
        self._drop_prefetch()  # never write rows an early lookup is reading
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        stale: dict[str, tuple[Tensor, Tensor]] = {}
        staged = self._enqueued
        prefetched = staged is not None and staged.prefetch is not None  # that lookup already read them
        if observer and self.pipeline_execution_with_tensor_core and not prefetched:
            for tg in pending.table_grads:
                weights = self._engine.states[tg.table.name].weights
                if not tg.table.optimizer.lazy:  # non-lazy Adam touches every row
                    rows = torch.arange(weights.shape[0], device=weights.device)
                else:
                    touched = tg.materialized().rows
                    assert touched is not None
                    rows = torch.unique(touched).to(weights.device)
                stale[tg.table.name] = (rows, weights.index_select(0, rows))
        self._engine.apply(pending.table_grads, pending.lrs, agreed=True)  # the ranks agreed at apply_gradients
        self._stale.update({k: v for k, v in stale.items() if k not in self._stale})

    @contextlib.contextmanager
    def _stale_rows_swapped_in(self, training: bool) -> Iterator[None]:
        """For the first training lookup after an observer-triggered flush: the tables hold the
        pre-update values of the touched rows during the lookup, and the updated ones afterwards."""
        if not training or not self._stale:
            yield
            return
        stale, self._stale = self._stale, {}
        current = {}
        with torch.no_grad():
            for name, (rows, old) in stale.items():
                weights = self._engine.states[name].weights
                current[name] = weights.index_select(0, rows)
                weights.index_copy_(0, rows, old)
            try:
                yield
            finally:
                for name, (rows, _) in stale.items():
                    self._engine.states[name].weights.index_copy_(0, rows, current[name])
                    self._engine.note_values_kept(name)

    @_locked
    def flush(self) -> list[str]:
        """Write the lookup statistics gathered so far (all ranks' counts merged; rank 0 writes one
        JSON file per table into ``profile_data_directory``, merged with what is there, atomically)
        and start counting afresh. Returns the paths written (on rank 0). Collective when sharded."""
        if self._stats is None or self._profile_dir is None:
            return []
        stats, directory, engine = self._stats, self._profile_dir, self._engine
        parts = self._exchange(engine, "flush", lambda: comm.all_gather_object(stats.state(), engine.group))
        strategies = {n: p.strategy for n, p in engine.plans.items()}
        world, rank = engine.world, engine.rank
        stats.reset()
        paths: list[Path] = []
        error: str | None = None
        if rank == 0:
            try:
                paths = write_stats(directory, merge(parts), self._resolved, strategies, world)
            except (OSError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self._run(lambda: comm.broadcast_object(error, 0, engine.group))  # rank 0's error on every rank
        if error is not None:
            raise RuntimeError(
                f"DistributedEmbedding.flush: rank 0 could not write the lookup statistics to {directory} ({error}); "
                "training is unaffected. Fix the directory (profile_data_directory) or its permissions."
            )
        if paths:
            logger.info("lookup statistics: wrote %d file(s) to %s", len(paths), directory)
        return [str(p) for p in paths]

    @_locked
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        extra: dict[str, Any] | None = None,
        progress: bool | Callable[[int], None] | None = None,
    ) -> str:
        """Write a checkpoint under ``path`` (``path/ckpt-<step>``): the full logical tables and slots
        under TF's names, the step counter, the config as data, ``extra`` (JSON). Every rank writes
        only its own rows; the checkpoint restores into any number of ranks and any strategy.
        Collective when sharded. A pending pipelined update is applied first. Returns the directory."""
        self._refuse_if_torn("save")
        shards = self.local_shards()  # applies a pending pipelined update, keeping its pre-update rows
        group = self._engine.group
        self._exchange(self._engine, "save", lambda: None)
        # Pre-update rows the next training lookup must read (pipelining): saved with global row ids.
        stale = {name: (shards[name].rows[rows.cpu()], old) for name, (rows, old) in self._stale.items()}
        strategies = {n: p.strategy for n, p in self._engine.plans.items()}
        with progress_bar(progress, comm.get_rank(group), "save") as tick:
            out = checkpoint.save(
                path, self._resolved, shards, self._training_steps, strategies=strategies, extra=extra,
                keep_last=keep_last, progress=tick, group=group, stale=stale, settings=self._settings(),
            )  # fmt: skip
        if self._stats is not None:
            self.flush()
        return str(out)

    @_locked
    def restore(
        self, path: str | os.PathLike[str], *, progress: bool | Callable[[int], None] | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (by any number of ranks, any strategy), or the latest
        one under ``path``: tables, slots and the step counter. Verifies every block it reads; on any
        error raises ``CheckpointError`` naming the file and table, and nothing changes (on any rank).
        Returns the manifest (with the ``extra`` given to ``save``)."""
        self._drop_prefetch()
        engine = self._engine
        group = engine.group
        shards = engine.local_shards()
        self._exchange(engine, "restore", lambda: None)
        with progress_bar(progress, comm.get_rank(group), "restore") as tick:
            try:
                manifest = checkpoint.restore(path, self._resolved, shards, progress=tick, group=group)
            except checkpoint.TornRestore as exc:
                self._torn = str(exc)
                raise
        self._torn = None
        if self._enqueued is not None:
            self._enqueued.prefetch = None  # it read the old tables: look up again at dequeue
        self._pending, self._last = None, None
        device = self.device
        stale = manifest.pop("stale")
        # The pre-update rows of a pipelined update pending at save are read by the next training lookup
        # of a pipelined module only; a synchronous module reads the tables as they are (updated).
        self._stale = {}
        if self.pipeline_execution_with_tensor_core:
            self._stale = {n: (r.to(device), v.to(device)) for n, (r, v) in stale.items()}
        self._training_steps = int(manifest["step"])
        return manifest

    def _refuse_if_torn(self, what: str) -> None:
        if self._torn is not None:
            raise checkpoint.CheckpointError(
                f"DistributedEmbedding.{what}: refused, the last restore was interrupted half-way and the tables are "
                f"partly restored ({self._torn}). Restore again (or load_state_dict) first."
            )

    @_locked
    def local_shards(self) -> dict[str, LocalShard]:
        """``{table name: LocalShard}``: the rows this process owns, with their global row ids, as
        live storage (after any pipelined update). In one process every table is one whole shard."""
        self._flush(observer=True)
        return self._engine.local_shards()

    # ------------------------------------------------------------------ nn.Module integration
    @_locked
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DistributedEmbedding:
        """``.to()``, ``.cuda()``, ``.half()``...: tables and slots move between devices but stay float32
        (TF's numerics); a dtype change is refused before anything moves."""
        probe = fn(torch.zeros(1, dtype=torch.float32, device=self.device))
        if probe.dtype != torch.float32:
            raise TypeError(
                f"DistributedEmbedding: embedding tables and slots stay float32 (TF's TPU numerics); converting "
                f"them to {probe.dtype} is refused and nothing was changed. Convert only the dense part of the "
                "model (e.g. `model.dense.half()`) and cast the activations, or keep this module in float32."
            )
        self._flush(observer=True)
        if self._enqueued is not None and self._enqueued.prefetch is not None:
            self._enqueued.prefetch = None  # looked up on the old device: look up again at dequeue
        self._engine.map_tensors(fn)
        self._stale = {k: (fn(rows), fn(old)) for k, (rows, old) in self._stale.items()}
        if self._last is not None and probe.device != self._last.activations[0].device:
            self._last = None
            logger.warning(
                "DistributedEmbedding: moved between devices after a training lookup; its gradients are dropped. "
                "Call apply_gradients() before moving the module."
            )
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]

    @_locked
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._flush(observer=True)
        for key, t in self._exchange(self._engine, "state read", self._engine.full_state).items():
            destination[prefix + key] = t if keep_vars else t.detach()  # gathered copies when sharded

    @_locked
    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load ``<table>`` and ``<table>/<slot>`` keys. A bad value (shape, dtype, not finite as float32)
        loads nothing; with ``strict=True`` a missing or unexpected key loads nothing either, and with
        ``strict=False`` the keys present are loaded and the others keep their values."""
        strict = strict_of_caller(strict)
        engine = self._engine
        present, errors, missing, unexpected = validate_state_dict(
            state_dict, prefix, engine.logical_shapes(), engine.state_key_owners()
        )
        if strict:
            unexpected_keys.extend(unexpected)
        missing_keys.extend(missing)
        refuse = bool(errors) or (strict and bool(missing or unexpected))
        if self._exchange(engine, "state load", lambda: comm.any_rank(refuse, engine.group)):
            if not refuse:  # every rank loads, or none does
                error_msgs.append("DistributedEmbedding: another rank refused its state dict; nothing was loaded.")
            refuse = True
        error_msgs.extend(f"DistributedEmbedding: {e}." for e in errors)
        if refuse:
            return
        self._drop_prefetch()
        if self._enqueued is not None:
            self._enqueued.prefetch = None  # it read the old tables: look up again at dequeue
        self._pending = None  # a restored state replaces any update still held back
        self._last = None
        self._stale = {}
        self._torn = None if not missing else self._torn
        engine.load_logical(present)

    def extra_repr(self) -> str:
        tables = ", ".join(
            f"{t.name}: {t.vocabulary_size}x{t.dim} {type(t.optimizer).__name__}" for t in self._resolved.tables
        )
        where = ""
        if self._engine.world > 1:
            plans = ", ".join(f"{n}: {p.placement}" for n, p in self._engine.plans.items())
            where = f", rank={self._engine.rank}/{self._engine.world}, sharding=[{plans}]"
        return f"tables=[{tables}], features={len(self._resolved.features)}{where}"
