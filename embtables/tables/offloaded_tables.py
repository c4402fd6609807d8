"""``OffloadedTables``: where a collection and its engines meet its tables on disk (docs/offload.md).

One object per collection holds the row cache of each offloaded table (``offload_cache.OffloadedRows``, whose
files are ``offload_files.ShardFiles``) and is the only way the collection, the engines and the checkpoint
code reach them:

* ``admit`` brings a lookup's rows into the caches before the lookup reads them and turns its ids into cache
  slots, which the lookup and its update compute on. The lookup's ``Admission`` (its step, the first step whose
  rows stay pinned, training or not) is made by the step pipeline: one process admits its batch's ids
  (``EmbeddingCollection.translate_keys``); a sharded owner admits the rows other ranks ask of it once the lookup
  has routed them (``admit_rows``); ``slots`` translates rows already in the cache.
* ``prefetch`` starts reading a staged batch's rows; ``whole`` and ``check_whole`` come before a whole-table
  access and a save; ``before_restore`` / ``restored`` around a restore or full load; ``before_update``
  before an update and ``refresh`` before stale rows are swapped in (what was written through the files' maps
  taken in); ``close`` releases the files; ``statistics`` gives each cache's counters.

Shapes: N ids of a batch's features of one table, R rows asked of this rank.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from embtables.config import ResolvedConfig
from embtables.tables.inputs import FeatureBatch
from embtables.tables.offload_cache import OffloadedRows
from embtables.tables.offload_files import io_engine

_T = TypeVar("_T")
PARALLEL_IDS = 16_384  # ids of one admission over 2+ tables from which the tables admit at once (``_each``)
_MOST_THREADS = 4  # 8 measured no faster at full size, with 210 MiB more resident (BENCHMARKS.md)


@dataclasses.dataclass(frozen=True)
class Admission:
    """What a lookup's admission needs to know: its ``step``, ``pin_from`` (rows used at or after this step
    stay in memory: the previous step's while its update is pending) and whether it is a ``training`` one."""

    step: int
    pin_from: int
    training: bool


def required(admission: Admission | None) -> Admission:
    """``admission``, which a lookup of offloaded tables cannot go without (None there is a bug)."""
    if admission is None:
        raise RuntimeError("embtables: a lookup of offloaded tables came without its Admission (a bug)")
    return admission


class OffloadedTables:
    """The offloaded tables of one collection, by table name (an empty one when it has none)."""

    def __init__(self, resolved: ResolvedConfig, caches: dict[str, OffloadedRows]) -> None:
        self.resolved = resolved
        self._caches = caches
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # see _pool
        self._executor_pid = 0

    # ------------------------------------------------------------------ which tables
    def __bool__(self) -> bool:
        return bool(self._caches)

    def __contains__(self, name: object) -> bool:
        return name in self._caches

    def __iter__(self) -> Iterator[str]:
        return iter(self._caches)

    def __getitem__(self, name: str) -> OffloadedRows:
        return self._caches[name]

    def get(self, name: str) -> OffloadedRows | None:
        return self._caches.get(name)

    def names(self) -> list[str]:
        return sorted(self._caches)

    # ------------------------------------------------------------------ a lookup's rows
    def admit(self, batches: Sequence[FeatureBatch], admission: Admission) -> list[FeatureBatch]:
        """``batches`` whose offloaded tables' features hold their cache's slots, every id [N] they look up
        brought into the cache first (refused, changing nothing, when a cache cannot hold them with the rows
        still pinned). Natively staged bags hold the old ids, so no batch keeps them once one is translated."""
        out = list(batches)
        work: list[tuple[OffloadedRows, Sequence[int], list[Tensor]]] = []  # (cache, features, their ids)
        for name, cache in self._caches.items():
            table_features = self.resolved.tables[self.resolved.table_names.index(name)].feature_indices
            if table_features:
                work.append((cache, table_features, [out[f].ids for f in table_features]))

        def admit_one(item: tuple[OffloadedRows, Sequence[int], list[Tensor]]) -> Tensor:
            cache, _, ids = item
            return cache.admit(torch.cat(ids) if len(ids) > 1 else ids[0], admission.step, admission.pin_from)

        size = sum(i.numel() for _, _, ids in work for i in ids)
        for (_, features, ids), slots in zip(work, self._each(admit_one, work, size)):
            for f, piece in zip(features, torch.split(slots, [i.numel() for i in ids])):
                out[f] = dataclasses.replace(out[f], ids=piece)
        return [b if b.staged is None else dataclasses.replace(b, staged=None) for b in out]

    def _each(self, fn: Callable[[_T], Tensor], items: Sequence[_T], size: int) -> list[Tensor]:
        """``fn`` of every item (a table's admission), in order. Where two or more tables admit at least
        ``PARALLEL_IDS`` ids together, they admit at once on a pool of threads (each table's reads, write-backs
        and bookkeeping are its own; the native calls and torch operations release the GIL), so one table's disk
        reads overlap another's; every table finishes before the first error, in table order, is raised."""
        if len(items) < 2 or size < PARALLEL_IDS:
            return [fn(item) for item in items]
        io_engine()  # chosen here, once, not by the threads at once
        futures = [self._pool().submit(fn, item) for item in items]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """This collection's admission threads (made at the first use in this process; a fork makes new ones)."""
        if self._executor is None or self._executor_pid != os.getpid():
            workers = min(len(self._caches), _MOST_THREADS)
            self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="embtables-admit")
            self._executor_pid = os.getpid()
        return self._executor

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_executor"], state["_executor_pid"] = None, 0
        return state

    def check_room(self, batches: Sequence[FeatureBatch], pin_from: int) -> None:
        """Raise ``InputError`` (nothing changed) when a dynamic offloaded table's cache could not hold a row for
        each distinct key of ``batches`` beside the rows pinned since ``pin_from``: checked before its key map
        gives keys rows, so a refused lookup leaves the map as it was."""
        for name, cache in self._caches.items():
            table = self.resolved.tables[self.resolved.table_names.index(name)]
            if table.config.dynamic is None:
                continue
            keys = self._table_ids(name, batches)
            if keys is not None:
                cache.check_room(int(torch.unique(keys).numel()), pin_from)

    def admit_rows(self, wanted: Sequence[tuple[str, Tensor]], admission: Admission) -> list[Tensor]:
        """Bring local rows [R] of each named table into its cache (what other ranks asked of this one) and
        return their slots [R] (the rows themselves for a table in memory)."""
        out = []
        for name, rows in wanted:
            cache = self._caches.get(name)
            out.append(rows if cache is None else cache.admit(rows, admission.step, admission.pin_from))
        return out

    def slots(self, name: str, rows: Tensor) -> Tensor:
        """The cache slots [R] of admitted local rows [R] of table ``name`` (rows unchanged when it is in memory)."""
        cache = self._caches.get(name)
        return rows if cache is None else cache.translate(rows)

    def local_rows(self, name: str, slots: Tensor) -> Tensor:
        """The local rows [R] held by cache ``slots`` [R] of offloaded table ``name``."""
        return self._caches[name].local_rows(slots)

    def prefetch(self, batches: Sequence[FeatureBatch]) -> None:
        """Start reading a staged batch's rows from disk (``OffloadedRows.prefetch``). A dynamic table's batch
        holds keys, whose rows its key map gives only at the lookup: it is not read ahead."""
        for name, cache in self._caches.items():
            if self.resolved.tables[self.resolved.table_names.index(name)].config.dynamic is not None:
                continue
            ids = self._table_ids(name, batches)
            if ids is not None:
                cache.prefetch(ids)

    def _table_ids(self, name: str, batches: Sequence[FeatureBatch]) -> Tensor | None:
        """Every id [N] the features of table ``name`` look up in ``batches`` (None: it has no feature)."""
        index = self.resolved.table_names.index(name)
        ids = [batches[f].ids for f in self.resolved.tables[index].feature_indices]
        return torch.cat(ids) if ids else None

    # ------------------------------------------------------------------ whole tables, checkpoints, life
    def whole(self, rewritten: Collection[str] = ()) -> None:
        """Every table initialized in full before its tensors are read or written whole (refused while its
        files are torn or cut short); those in ``rewritten`` have every row and slot written next (a full
        load), which their files may be torn for (``OffloadedRows.materialize``)."""
        for name, cache in self._caches.items():
            cache.materialize(rewrite=name in rewritten)

    def check_whole(self, what: str) -> None:
        """Raise unless every table's files hold it whole, before ``what`` reads them (a save)."""
        for cache in self._caches.values():
            cache.check_whole(what)

    def before_restore(self) -> None:
        """A restore writes every row next (``OffloadedRows.before_restore``)."""
        for cache in self._caches.values():
            cache.before_restore()

    def restored(self) -> None:
        """Every table was written whole (a restore, a full load): its files are whole again."""
        for cache in self._caches.values():
            cache.restored()

    def before_update(self, names: Collection[str]) -> None:
        """Before an update of tables ``names``: raise when one had its files released (``close``); take in what
        was written through a table's files' maps since its lookup (``OffloadedRows.refresh``)."""
        for name in names:
            cache = self._caches.get(name)
            if cache is not None:
                cache.check_open()
                cache.refresh()

    def refresh(self) -> None:
        """Every cache takes in what was written through its files' maps (before stale rows are swapped in)."""
        for cache in self._caches.values():
            cache.refresh()

    def close(self) -> None:
        """Release every table's files and lock (and the admission threads)."""
        for cache in self._caches.values():
            cache.close()
        if self._executor is not None and self._executor_pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor = None

    def statistics(self) -> dict[str, dict[str, float]]:
        """Per table, its row cache's counters (``OffloadedRows.statistics``)."""
        return {name: cache.statistics() for name, cache in self._caches.items()}


__all__ = ["Admission", "OffloadedTables", "required"]
