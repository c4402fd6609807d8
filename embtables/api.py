"""``DistributedEmbedding``: the TPUEmbedding programming model as a ``torch.nn.Module``.

    emb = DistributedEmbedding(feature_config, optimizer=embtables.Adagrad(0.1))
    acts = emb(features)               # or emb.enqueue(features); acts = emb.dequeue()
    loss(acts).backward()
    emb.apply_gradients()              # or emb.apply_gradients(d_loss_d_acts)

Tables and slots are not ``nn.Parameter``s: like on a TPU they are updated only by the fused
sparse optimizer, so a ``torch.optim`` over ``model.parameters()`` never touches them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from embtables.checkpoint.persistence import Persistence, Progress
from embtables.config import Optimizer, ResolvedConfig, TableConfig, nest, resolve
from embtables.sharding.engine_choice import choose_engine, describe
from embtables.sharding.pipeline import StepPipeline
from embtables.sharding.statistics import LookupStatistics
from embtables.tables.batch_ownership import InputStager
from embtables.tables.concatenated import ConcatLayout
from embtables.tables.state import LocalShard
from embtables.tables.state_dict_io import TableDict

logger = logging.getLogger("embtables")


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` holding the module's lock: one thread at a time touches tables, slots and the
    native workspaces (ctypes releases the GIL, so two threads could otherwise race in C)."""

    @functools.wraps(method)
    def wrapper(self: DistributedEmbedding, *args: Any, **kwargs: Any) -> Any:
        with self._pipeline.lock:
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


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
      concat_activations: when True, the activations come back as one tensor [B, sum(D)]: every feature's
        pooled [B, D] side by side in flattened feature order (``activation_columns`` says where), and
        ``apply_gradients`` takes one gradient of that shape. Every feature must pool to [B, D] (no
        sequence features, one-dimensional ``output_shape``). For models that concatenate anyway.

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
        concat_activations: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(pipeline_execution_with_tensor_core, bool):
            raise TypeError(
                "DistributedEmbedding: `pipeline_execution_with_tensor_core` must be a bool, got "
                f"{pipeline_execution_with_tensor_core!r}."
            )
        if not isinstance(concat_activations, bool):
            raise TypeError(f"DistributedEmbedding: `concat_activations` must be a bool, got {concat_activations!r}.")
        self._resolved: ResolvedConfig = resolve(feature_config, optimizer)
        self._concat = ConcatLayout(self._resolved) if concat_activations else None
        self._feature_config = feature_config
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # Module settings that change results, beyond the config: in the rank fingerprint and manifests.
        settings = {"pipeline_execution_with_tensor_core": pipeline_execution_with_tensor_core}
        args = (sharding, process_group, timeout, profile_data_directory, settings)
        engine, plans = choose_engine(self._resolved, dev, *args)
        self._stats = None
        if profile_data_directory is not None:
            sampling = (profile_sample_rate, profile_seed)
            self._stats = LookupStatistics(self._resolved, plans, profile_data_directory, *sampling)
        recorder = None if self._stats is None else self._stats.recorder
        self._engine = engine
        pipelined = pipeline_execution_with_tensor_core
        self._pipeline = StepPipeline(engine, pipelined, recorder, concat=concat_activations)
        self._persistence = Persistence(self._resolved, self._pipeline, settings)
        self._inputs = InputStager(feature_config, self._resolved)
        self._names_by_config = {id(t.config): t.name for t in self._resolved.tables}
        self._built = False

    # ------------------------------------------------------------------ properties
    @property
    def feature_config(self) -> Any:
        return self._feature_config

    @property
    def pipeline_execution_with_tensor_core(self) -> bool:
        """Whether the lookup of step t+1 reads the tables before the update of step t (spec §6)."""
        return self._pipeline.pipelined

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
    def activation_columns(self) -> dict[str, tuple[int, int]]:
        """``{feature name: (start, stop)}``: the columns of each feature in the concatenated activation
        (``concat_activations=True``; empty otherwise)."""
        return dict(self._concat.columns) if self._concat is not None else {}

    @property
    @_locked
    def embedding_tables(self) -> dict[str, Tensor]:
        """``{table name: weights [V, D]}`` (live tensors, after any pipelined update); the
        ``TableConfig`` object works as a key too, as in TF."""
        full = self._pipeline.full_state()
        return TableDict({t.name: full[t.name] for t in self._resolved.tables}, self._names_by_config)

    @property
    @_locked
    def slot_variables(self) -> dict[str, dict[str, Tensor]]:
        """``{table name: {slot name: [V, D]}}`` with TF's slot names (live tensors); the
        ``TableConfig`` object works as a key too."""
        full = self._pipeline.full_state()
        slots = {t.name: {s: full[f"{t.name}/{s}"] for s in t.optimizer.slot_names} for t in self._resolved.tables}
        return TableDict(slots, self._names_by_config)

    @_locked
    def vocabulary(self, table: str | TableConfig) -> tuple[Tensor, Tensor]:
        """A dynamic table's live keys [L] and their rows [L] (int64, by row; spec §11). Collective when
        sharded (global rows)."""
        arrays = self._pipeline.exchange("state read", self._engine.vocabulary_state)[self._dynamic_table(table)]
        rows = torch.nonzero(arrays["counts"] > 0).flatten()
        return arrays["keys"][rows], rows

    @_locked
    def vocabulary_statistics(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: keys admitted, evicted, expired, rejected (no row to give), untracked (the
        pending set was full), since construction or the last restore; live rows, pending keys, capacity
        (summed over the ranks when sharded: collective)."""
        return self._pipeline.exchange("state read", self._engine.vocabulary_statistics)

    @_locked
    def offload_statistics(self) -> dict[str, dict[str, float]]:
        """Per offloaded table (``TableConfig.offload``, docs/offload.md), since construction: rows looked up,
        cache ``hits`` (rows already in memory), rows and bytes read from and written to its files, seconds
        waiting for the disk, rows initialized (and ``init_s``, the seconds that took), groups evicted;
        ``resident_rows`` and ``cache_rows`` now. Summed over the ranks when sharded (collective)."""
        return self._pipeline.exchange("state read", self._engine.offload_statistics)

    def _dynamic_table(self, table: str | TableConfig) -> str:
        name = self._names_by_config.get(id(table), "") if isinstance(table, TableConfig) else table
        if name not in self._engine.vocabularies.maps:
            dynamic = sorted(self._engine.vocabularies.maps)
            raise KeyError(f"DistributedEmbedding.vocabulary: {table!r} is not a dynamic table (those are {dynamic}).")
        return name

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

    # ------------------------------------------------------------------ the TF verbs
    @_locked
    def enqueue(self, features: Any, weights: Any = None, training: bool = True) -> None:
        """Validate and stage a batch (TF ``enqueue``); ``training=False`` is a forward-only lookup.

        ``features`` / ``weights`` follow the nest of ``feature_config``; see ``embtables.Ragged``
        for the accepted input types. Raises (and stages nothing) on any invalid input; sharded, every
        rank raises the refusing rank's error at the lookup (``dequeue``) instead. An offloaded table's rows
        of the batch start coming in from disk now (docs/offload.md).
        """
        self._enqueue(features, weights, training, read_ahead=True)

    def _enqueue(self, features: Any, weights: Any, training: bool, *, read_ahead: bool) -> None:
        """``enqueue``; ``read_ahead``: start reading offloaded rows now (not when the lookup follows at once)."""
        training = bool(training)
        if training:
            self._persistence.refuse_if_torn("enqueue")
        try:
            batches = self._inputs.stage(
                features, weights, self.device, self._pipeline.busy_pointers(), self._engine.device_checks()
            )
            if self._concat is not None:
                self._concat.check_batches(batches)
        except (ValueError, TypeError) as exc:
            if self._engine.world == 1:
                raise  # a bad enqueue changes nothing
            self._pipeline.stage(None, training, refused=exc)  # every rank refuses this step together
            return
        self._pipeline.stage(batches, training, read_ahead=read_ahead)

    @_locked
    def dequeue(self) -> Any:
        """The activations of the last enqueued batch, in the nest of ``feature_config``.

        In training mode each activation is a leaf tensor that requires grad, so ``loss.backward()``
        leaves d(loss)/d(activation) in its ``.grad`` for ``apply_gradients()``.
        """
        acts = self._pipeline.dequeue()
        if self._concat is not None:
            return acts[0]
        flat = self._inputs.flat
        return flat.pack(acts) if flat is not None else nest.pack_sequence_as(self._feature_config, acts)

    @_locked
    def forward(self, features: Any, weights: Any = None) -> Any:
        """``enqueue(features, weights, training=self.training)`` then ``dequeue()`` (nothing read ahead: the
        lookup follows at once)."""
        self._enqueue(features, weights, self.training, read_ahead=False)
        return self.dequeue()

    @_locked
    def apply_gradients(self, gradients: Any = None) -> None:
        """Apply the fused sparse update for the last training lookup.

        Args:
          gradients: None to use the activations' ``.grad`` left by ``loss.backward()``, or a nest
            (same structure as ``feature_config``) of d(loss)/d(activation) tensors shaped like the
            activations; a ``None`` entry is a zero gradient (its rows are still "touched"). With
            ``concat_activations=True``: one tensor shaped like the concatenated activation, or None.

        Raises ``ValueError``/``TypeError`` for a bad gradient (wrong shape, dtype, NaN/Inf reaching
        a table) and ``RuntimeError`` when there is no training lookup to apply to; in every case no
        table or slot changes. Pipelined and sharded, the exchange and the update's own check run in
        the background after this returns: an owner's sum or an update that overflows float32 is
        raised on every rank by the next call that waits for it (docs/sharding.md, Pipelining).
        """
        self._persistence.refuse_if_torn("apply_gradients")
        activations = self._pipeline.training_lookup().activations
        if self._concat is not None:
            grad = activations[0].grad if gradients is None else gradients
            if self._concat.whole_gradient_ok(grad, activations[0]):  # checked whole, not block by block
                self._pipeline.apply_gradients(self._concat.blocks(grad), checked_blocks=True)
                return
            try:
                flat_g: list[Any] = self._concat.split_gradient(grad, activations[0], gradients is not None)
            except (ValueError, TypeError) as exc:
                if self._engine.world == 1:
                    raise
                self._pipeline.apply_gradients([None] * len(self._resolved.features), refused=exc)
                return  # not reached: every rank raises the refusal together
        else:
            flat_g = self._inputs.flat_gradients(gradients, activations)
        self._pipeline.apply_gradients(flat_g)

    # ------------------------------------------------------------------ statistics and persistence
    @_locked
    def flush(self) -> list[str]:
        """Write the lookup statistics gathered so far (all ranks' counts merged; rank 0 writes one
        JSON file per table into ``profile_data_directory``, merged with what is there, atomically)
        and start counting afresh. Returns the paths written (on rank 0). Collective when sharded."""
        return [] if self._stats is None else self._stats.flush(self._pipeline)

    @_locked
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        extra: dict[str, Any] | None = None,
        progress: Progress = None,
        incremental: bool = False,
        full_every: int | None = None,
    ) -> str:
        """Write a checkpoint under ``path`` (``path/ckpt-<step>``): the full logical tables and slots
        under TF's names, the step counter, the config as data, ``extra`` (JSON). Every rank writes
        only its own rows; the checkpoint restores into any number of ranks and any strategy.
        Collective when sharded. A pending pipelined update is applied first. Returns the directory.

        ``incremental=True``: only the rows changed since this module's last ``save`` or ``restore``
        (``changed_rows``), on top of that checkpoint when it is the newest under ``path``; otherwise (the
        first save, a restore from elsewhere, ``full_every`` increments in a row) a full checkpoint, logged.
        ``restore`` resolves the chain; ``keep_last`` never deletes a checkpoint a kept one builds on.
        A dynamic table goes whole into each increment (docs/checkpoints.md, "Incremental checkpoints")."""
        out = self._persistence.save(path, keep_last, extra, progress, incremental=incremental, full_every=full_every)
        self.flush()
        return str(out)

    @_locked
    def restore(self, path: str | os.PathLike[str], *, progress: Progress = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (by any number of ranks, any strategy), or the latest
        one under ``path``: tables, slots and the step counter. Verifies every block it reads; on any
        error raises ``CheckpointError`` naming the file and table, and nothing changes (on any rank).
        Returns the manifest (with the ``extra`` given to ``save``)."""
        return self._persistence.restore(path, progress)

    @_locked
    def close(self) -> None:
        """Release the offloaded tables' working files and their locks (docs/offload.md): another module or
        process may then open the same directories. Afterwards every lookup, update, save and whole-table access of
        an offloaded table is refused (their files are scratch: ``save`` first to keep them); tables in memory are
        untouched. Python releases them too when the module is garbage-collected, but not at a known time. Safe to
        call again; with no offloaded table there is nothing to release."""
        self._engine.offloaded.close()

    @_locked
    def changed_rows(self) -> dict[str, Tensor]:
        """``{table name: global row ids [R]}`` (int64, CPU, ascending) of the rows this process's writes changed
        since the last ``save`` or ``restore``: the rows of every applied update (every row of a non-lazy
        optimizer's table), of a dynamic table's new keys, and every row after ``load_state_dict``; after a
        pending pipelined update lands. Sharded: this rank's rows. Writes into the tensors the module hands
        out are not seen. The base of incremental checkpoints and serving deltas (docs/checkpoints.md)."""
        # a pending pipelined update lands first; an offloaded table's files are checked (not torn, not cut
        # short), never initialized whole: the row ids are all this reads
        shards = self._pipeline.local_shards(whole=False)
        self._engine.offloaded.check_whole("changed_rows()")
        return self._engine.changed_rows(shards)

    @_locked
    def local_shards(self) -> dict[str, LocalShard]:
        """``{table name: LocalShard}``: the rows this process owns, with their global row ids, as
        live storage (after any pipelined update). In one process every table is one whole shard."""
        return self._pipeline.local_shards()

    # ------------------------------------------------------------------ nn.Module integration
    @_locked
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DistributedEmbedding:
        """``.to()``, ``.cuda()``, ``.half()``...: tables and slots move between devices and keep their storage
        types (``TableConfig(dtype=, slot_dtype=)``); ``.half()``, ``.bfloat16()``, ``.double()`` are refused before
        anything moves, naming each table's type; ``.float()`` leaves half tables half, with a warning."""
        self._pipeline.move(fn)
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]

    @_locked
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._persistence.state_dict_into(destination, prefix, keep_vars)

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
        args = (state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)
        self._persistence.load_state_dict(*args)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_concat", None)  # pickled before concat_activations existed
        super().__setstate__(state)  # type: ignore[no-untyped-call]

    def extra_repr(self) -> str:
        return describe(self._engine)
