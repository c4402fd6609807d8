"""The engine interface ``DistributedEmbedding`` drives, and its one-process implementation.

``Engine`` is what both engines offer: the sharded one (``sharding.ShardedEmbeddingCollection``) and
``OneProcessEngine`` here, which is the world-of-one case: no exchanges, no phase headers, rank 0 of 1,
every table one whole ``div`` shard. The facade never asks which one it holds; it asks ``world`` only
where the rules differ by world size (one process raises a bad batch at once, several ranks refuse it
together at the lookup).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.tables.collection import EmbeddingCollection
from embtables.tables.dynamic_vocabularies import ROW_FIELDS, Vocabularies
from embtables.tables.inputs import FeatureBatch
from embtables.tables.offloaded_tables import Admission, OffloadedTables
from embtables.tables.state import LocalShard, TableState
from embtables.tables.table_gradient import TableGradient


class Engine(Protocol):
    """The tables of a resolved config on ``world`` ranks (1 for one process), with the TF verbs.

    Collective methods (lookup, table_gradients, check, apply, full_state) must be called by every
    rank in the same order, after ``check_phase``; in one process they are ordinary calls."""

    resolved: ResolvedConfig
    group: Any
    rank: int
    world: int
    # Pipelined and sharded: the early lookup, the exchange and the held-back update run on a thread of their
    # own, overlapping the caller's dense compute (chosen once, the same on every rank: ``exchange_thread``).
    background_exchange: bool

    @property
    def plans(self) -> dict[str, Any]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def states(self) -> dict[str, TableState]: ...

    @property
    def vocabularies(self) -> Vocabularies: ...

    def check_phase(self, phase: str, step: int) -> None: ...

    def translate_keys(
        self,
        batches: Sequence[FeatureBatch],
        training: bool,
        step: int,
        pin_from: int,
        refused: BaseException | None = None,
    ) -> list[FeatureBatch]: ...

    def vocabulary_state(self) -> dict[str, dict[str, Tensor]]: ...

    def load_vocabulary_state(self, values: dict[str, dict[str, Tensor]], step: int) -> None: ...

    def vocabulary_statistics(self) -> dict[str, dict[str, int]]: ...

    def offload_statistics(self) -> dict[str, dict[str, float]]: ...

    def vocabulary_shards(self) -> dict[str, dict[str, Tensor]]: ...

    def lookup(
        self,
        batches: Sequence[FeatureBatch],
        refused: BaseException | None = None,
        concat: bool = False,
        admission: Admission | None = None,
    ) -> tuple[list[Tensor], Any]: ...

    def check_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Any]) -> list[Tensor | None]: ...

    def device_checks(self) -> Any: ...

    def changed_rows(self, shards: dict[str, LocalShard]) -> dict[str, Tensor]: ...

    def changed_local(self) -> dict[str, Tensor]: ...

    def clear_changed(self) -> None: ...

    def settle(self) -> None: ...

    def mark_all_changed(self) -> None: ...

    @property
    def offloaded(self) -> OffloadedTables: ...

    def prefetch_rows(self, batches: Sequence[FeatureBatch]) -> None: ...

    def table_gradients(
        self,
        batches: Sequence[FeatureBatch],
        grads: Sequence[Tensor | None],
        context: Any,
        refused: BaseException | None = None,
    ) -> list[TableGradient]: ...

    def gradients_finite(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> bool: ...

    def agree_gradients(self, refused: BaseException | None) -> None: ...

    def learning_rates(self) -> dict[str, float]: ...

    def check(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None: ...

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None: ...

    def full_state(self) -> dict[str, Tensor]: ...

    def logical_shapes(self) -> dict[str, tuple[int, int]]: ...

    def state_key_owners(self) -> dict[str, tuple[ResolvedTable, str]]: ...

    def load_logical(self, values: dict[str, Tensor]) -> None: ...

    def local_shards(self, whole: bool = True) -> dict[str, LocalShard]: ...

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> None: ...


class LocalTables:
    """What both engines answer from the rows this process holds (``local``, an ``EmbeddingCollection``
    over them): shared by ``OneProcessEngine`` and the sharded engine."""

    local: EmbeddingCollection

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def vocabularies(self) -> Vocabularies:
        """The key maps of this process's dynamic tables (spec §11)."""
        return self.local.vocabularies

    @property
    def states(self) -> dict[str, TableState]:
        """This process's rows of every table (local row ids; see ``local_shards`` for the global ones)."""
        return self.local.states

    def check_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Any]) -> list[Tensor | None]:
        return self.local.check_gradients(batches, grads)

    def vocabulary_shards(self) -> dict[str, dict[str, Tensor]]:
        """Per dynamic table, this process's vocabulary arrays by its rows (``local_shards``' rows), for
        checkpoints: row fields cut to the rows it owns, its pending keys."""
        owned = {name: int(shard.rows.numel()) for name, shard in self.local_shards(whole=False).items()}
        out = {}
        for name, arrays in self.local.vocabularies.arrays().items():
            out[name] = {f: (v[: owned[name]] if f in ROW_FIELDS else v) for f, v in arrays.items()}
        return out

    def learning_rates(self) -> dict[str, float]:
        return self.local.learning_rates()

    def changed_rows(self, shards: dict[str, LocalShard]) -> dict[str, Tensor]:
        """Per table, the global ids [R] (int64, CPU, ascending) of this process's rows that the engine's writes
        changed since the last save or restore (``ChangedRows``); ``shards``: this engine's ``local_shards``."""
        out = {}
        for name, local in self.local.changed.rows().items():
            rows = shards[name].rows
            out[name] = rows[local.to(rows.device)].cpu()
        return out

    def changed_local(self) -> dict[str, Tensor]:
        """Per table, the positions [R] (ascending) in this engine's ``local_shards`` rows of the rows changed
        since the last save or restore."""
        return self.local.changed.rows()

    def clear_changed(self) -> None:
        self.local.changed.clear()

    def settle(self) -> None:
        """Raise every error the backend found and has not raised yet (the GPU's deferred device checks)."""
        self.local.backend.settle()

    def mark_all_changed(self) -> None:
        self.local.changed.mark_all()

    @property
    def offloaded(self) -> OffloadedTables:
        """This process's offloaded tables (their row caches and files): the one way to them."""
        return self.local.offloaded

    def rewritten_tables(self, keys: Collection[str]) -> set[str]:
        """The offloaded tables whose every state key (weights and slots) is in ``keys``: a load writes them
        whole."""
        owners = self.local.state_key_owners()
        return {
            name for name in self.local.offloaded
            if all(key in keys for key, (t, _) in owners.items() if t.name == name)
        }  # fmt: skip

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.local.map_tensors(fn)

    def local_shards(self, whole: bool = True) -> dict[str, LocalShard]:
        raise NotImplementedError  # each engine says which global rows its local rows are


class _WholeTable:
    """The plan of a table held whole by the only rank (what ``TablePlan("div", V, 1)`` says)."""

    strategy = "div"


class OneProcessEngine(LocalTables):
    """``Engine`` for one process: an ``EmbeddingCollection`` (``local``, as in the sharded engine)."""

    rank = 0
    world = 1
    background_exchange = False  # one process: a held-back update lands in the calling thread

    def __init__(self, resolved: ResolvedConfig, device: torch.device, group: Any = None) -> None:
        self.resolved = resolved
        self.group = group  # a process group of one rank, or None
        self.local = EmbeddingCollection(resolved, device)

    @property
    def plans(self) -> dict[str, Any]:
        return {t.name: _WholeTable() for t in self.resolved.tables}

    def check_phase(self, phase: str, step: int) -> None:
        """Nothing to agree on with no other rank."""

    def check_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Any]) -> list[Tensor | None]:
        # one process: phase 1 reads a feature's columns of a concatenated gradient in place
        return self.local.check_gradients(batches, grads, column_block=True)

    def translate_keys(
        self,
        batches: Sequence[FeatureBatch],
        training: bool,
        step: int,
        pin_from: int,
        refused: BaseException | None = None,
    ) -> list[FeatureBatch]:
        """Dynamic tables' keys turned into rows (spec §11): the other batches unchanged."""
        if refused is not None:
            raise refused
        return self.local.translate_keys(batches, training, step, pin_from)

    def vocabulary_state(self) -> dict[str, dict[str, Tensor]]:
        """``{table: {field: tensor}}``: every dynamic table's vocabulary (``VOCABULARY_FIELDS``)."""
        return self.local.vocabularies.arrays()

    def load_vocabulary_state(self, values: dict[str, dict[str, Tensor]], step: int) -> None:
        self.local.vocabularies.load(values, step)

    def vocabulary_statistics(self) -> dict[str, dict[str, int]]:
        return {name: m.stats() for name, m in self.local.vocabularies.maps.items()}

    def prefetch_rows(self, batches: Sequence[FeatureBatch]) -> None:
        """Start reading a staged batch's offloaded rows from disk before its lookup (docs/offload.md)."""
        self.local.offloaded.prefetch(batches)

    def offload_statistics(self) -> dict[str, dict[str, float]]:
        """Per offloaded table, its row cache's counters (``OffloadedRows.statistics``)."""
        return self.local.offloaded.statistics()

    def device_checks(self) -> Any:
        """The GPU backend's deferred device checks, which the input staging reports to (its input rules
        then read back at the next call, with the lookup's); None when errors are raised in each call."""
        checks = getattr(self.local.backend, "checks", None)
        return None if checks is None or checks.immediate else checks

    def lookup(
        self,
        batches: Sequence[FeatureBatch],
        refused: BaseException | None = None,
        concat: bool = False,
        admission: Admission | None = None,
    ) -> tuple[list[Tensor], None]:
        if refused is not None:  # one process raises a bad batch at enqueue; kept for the interface
            raise refused
        return self.local.lookup(batches, concat), None  # offloaded rows were admitted by translate_keys

    def table_gradients(
        self,
        batches: Sequence[FeatureBatch],
        grads: Sequence[Tensor | None],
        context: Any = None,
        refused: BaseException | None = None,
    ) -> list[TableGradient]:
        if refused is not None:
            raise refused
        return self.local.table_gradients(batches, grads)

    def gradients_finite(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> bool:
        """True when no gradient value is NaN or Inf (one process checks this in ``table_gradients``)."""
        return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)

    def agree_gradients(self, refused: BaseException | None) -> None:
        """No other rank to agree with: this process's own error, if any."""
        if refused is not None:
            raise refused

    def check(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        self.local.check(table_grads, lrs, step=step)

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        self.local.apply(table_grads, lrs, step=step)

    def full_state(self) -> dict[str, Tensor]:
        """``{"<table>" | "<table>/<slot>": [V, D]}``: the live tensors (no copy in one process)."""
        self.local.offloaded.whole()
        return self.local.state_keys()

    def logical_shapes(self) -> dict[str, tuple[int, int]]:
        return {k: (int(t.shape[0]), int(t.shape[1])) for k, t in self.local.state_keys().items()}

    def state_key_owners(self) -> dict[str, tuple[ResolvedTable, str]]:
        return self.local.state_key_owners()

    def load_logical(self, values: dict[str, Tensor]) -> None:
        """Copy full logical tables/slots ``{key: [V, D]}`` (already validated) into place."""
        self.local.offloaded.whole(self.rewritten_tables(values))
        expected = self.local.state_keys()
        with torch.no_grad():
            for key, value in values.items():
                expected[key].copy_(value.to(expected[key].dtype))

    def local_shards(self, whole: bool = True) -> dict[str, LocalShard]:
        """Every table as one whole shard (rows ``arange(V)``), as live storage. ``whole=False``: an
        offloaded table's rows never read are not initialized first (a checkpoint reads them from its files)."""
        if whole:
            self.local.offloaded.whole()
        out = {}
        for t in self.resolved.tables:
            rows = torch.arange(t.vocabulary_size, dtype=torch.int64)
            offloaded = self.local.offloaded.get(t.name)
            out[t.name] = LocalShard(t.name, t.vocabulary_size, rows, self.local.whole_tensors(t.name), offloaded)
        return out
