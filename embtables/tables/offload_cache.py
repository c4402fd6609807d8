"""``OffloadedRows``: one offloaded table shard's rows and slots in files, with at most ``cache_rows`` rows in
memory, in a cache of rows (docs/offload.md).

The tensors the engine computes on are the cache: one block [C, D] per tensor (weights, each slot), C =
``min(cache_rows, N)`` slots. A lookup's ids are local rows; ``admit`` brings them into slots and returns the
slot of each id, so every kernel, optimizer, combiner and input type runs on the block unchanged and
gives the bits of an in-memory table (a half-precision table rounds each slot with its row's global id:
``slot_global``). What is in the cache is managed here, a row at a time:

* **admission** (before a lookup reads rows): the least used rows (their ids looked up since they were read
  in, decayed by ``USE_DECAY`` a step; ``offload_residency.Residency`` keeps that bookkeeping and the slots,
  and chooses) leave until the batch's rows fit; those written since they were read (``dirty``, marked by the
  update's own writes) are written back first: appended to the shard's write log with ``pwrite``
  (``offload_log.WriteLog``, merged into the row file a chunk of whole pages at a time; a full disk is an error
  here, never a fault).
  The batch's rows that were never initialized get their initial values in the files (the initializer's draw
  for their block of ``INIT_BLOCK`` global rows, from the table's seed: the same values for any cache, shard
  layout or order of first reads); the rows not in the cache are read with ``pread`` (timed: the disk wait).
  Rows used at or after ``pin_from`` (the current batch, and the previous one while its update is pending) never
  leave; when they alone exceed the cache, the lookup is refused before anything changes.
* **read-ahead** (a batch staged by ``enqueue``): its rows not in the cache are read in the background
  (``ReadAhead``), and its admission takes them instead of reading them, when nothing wrote the files since.
* **whole-table access** (``state_dict``, ``embedding_tables``, ``load_state_dict``, ``restore``): the written rows
  are written back (``flush``), every block is initialized, and the files' maps (``file_tensors``) are handed out;
  the next lookup or update takes in what was written through them (``refresh``: the maps' pages written back and
  dropped, every cached row read again). ``save`` reads the files with ``pread`` (``read_records``) after a flush.
* **changed rows**: a bit a row (``PackedBits``), set when a written row goes back to the files; the rows of
  written slots not yet back are added when asked (``changed_rows``).

Shapes: N the shard's rows, C cache slots, D the width, U distinct rows of a batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.config.offload import Offload
from embtables.errors import InputError, TornFilesError
from embtables.tables.offload_files import ShardFiles
from embtables.tables.offload_initial import INIT_BLOCK, OffloadShard, initial_weights
from embtables.tables.offload_read_ahead import ReadAhead
from embtables.tables.offload_residency import NoRoom, Residency
from embtables.tables.packed_bits import PackedBits

logger = logging.getLogger("embtables")

_PAGE = 4096  # the page-cache unit read-ahead ranges are aligned to (a multiple of every page size's divisor)


class OffloadedRows:
    """The files, row cache and counters of one offloaded table shard (see the module docstring).

    Args:
      table: the shard's resolved table (``vocabulary_size`` = N); ``where``: which shard it is.
      parts: ``{"" (weights) or slot name: storage dtype}``; ``slot_values``: each slot's initial value.
    """

    def __init__(
        self, table: ResolvedTable, where: OffloadShard, parts: dict[str, torch.dtype], slot_values: dict[str, float]
    ) -> None:
        offload = table.config.offload
        assert isinstance(offload, Offload)
        self.table, self.logical, self.seed = table, where.logical, where.seed
        self.rows, self.dim = table.vocabulary_size, table.dim
        self.first, self.stride = where.first, where.stride
        self.slot_values = slot_values
        self.dtypes = dict(parts)
        self.block = INIT_BLOCK  # local rows initialized together
        self.cache_rows = offload.cache_rows  # as the user passed it
        self.capacity = max(1, min(offload.cache_rows, self.rows))  # C: the cache's slots
        # a write log as large as the cache, when rows leave it (a table the cache holds whole needs none)
        log_rows = self.capacity if self.rows > self.capacity else 0
        self.files = ShardFiles(
            str(offload.directory), where.logical.name, where.shard, self.rows, self.dim, parts, log_rows
        )
        try:
            # the cache: C rows of every tensor, each slot's row written since it was read (the update marks it:
            # ``ChangedRows`` holds this tensor as the table's flags) and, for a half table only, its global row
            # id (its rounding; empty otherwise); free slots hold zeros and global row 0
            self.cache = {p: torch.zeros((self.capacity, self.dim), dtype=d) for p, d in parts.items()}
            self.dirty = torch.zeros(self.capacity, dtype=torch.bool)
            self._rounds = table.config.half
            self.slot_global = torch.zeros(self.capacity if self._rounds else 0, dtype=torch.int64)
        except BaseException:
            self.files.close()
            raise
        # A byte per block of INIT_BLOCK rows and a bit a row (changed since the last save); everything else per
        # cached row: the memory of the cache's bookkeeping is the cache's, not the table's.
        self._initialized = torch.zeros(-(-self.rows // self.block), dtype=torch.bool)
        self.changed = PackedBits(self.rows)
        self.residency = Residency(self.capacity, self.rows)  # the rows in the cache and their slots (no I/O)
        self._untracked = False  # the files' maps were handed out: the next lookup or update refreshes
        self.read_ahead = ReadAhead()  # a staged batch's missing rows, read while the step before it computes
        self._epoch = 0  # admissions and other writes to the files so far: a read-ahead is good for one epoch
        self._warned_whole = False  # a whole-table access beyond the cache was logged
        # the id each local row [N] rounds with when it is not its global id: a dynamic half table's keys (kept
        # current by its key map's lookups; ``round_by``)
        self._row_ids: Tensor | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "rows_looked_up",
                "hits",
                "rows_read",
                "rows_written",
                "bytes_read",
                "bytes_written",
                "evictions",
                "rows_prefetched",
                "rows_read_ahead",
            ),
            0,
        )
        self.counters["initialized_rows"] = 0
        self.disk_wait_s = 0.0
        self.init_s = 0.0  # seconds drawing and writing initial values (a row's first touch)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's record in the file (its weights and slots, padded: ``RecordLayout``)."""
        return self.files.layout.nbytes

    # ------------------------------------------------------------------ initialization
    def _init_blocks(self, blocks: Tensor) -> None:
        """Write initial values into local blocks ``blocks`` (never initialized) of every file (timed: ``init_s``)."""
        start = time.perf_counter()
        try:
            self._init_each(blocks)
        finally:
            self.init_s += time.perf_counter() - start

    def _init_each(self, blocks: Tensor) -> None:
        written: list[tuple[int, int]] = []  # (offset, length): their write-backs run together
        try:
            self._init_written(blocks, written)
        finally:
            try:
                for offset, length in written:
                    self.files.settle(offset, length)
            except OSError as exc:  # the write-back failed: the files no longer hold what the cache believes
                self._tear(f"writing initial values to disk failed ({exc.strerror or exc})", exc)

    def _init_written(self, blocks: Tensor, written: list[tuple[int, int]]) -> None:
        for b in blocks.tolist():
            lo, hi = b * self.block, min((b + 1) * self.block, self.rows)
            try:
                self._init_range(lo, hi, written)
            except OSError as exc:  # a full disk, an I/O error: the block stays uninitialized, nothing changed
                raise RuntimeError(
                    f"table {self.logical.name!r}: writing the initial values of rows {lo}-{hi - 1} into its files "
                    f"under {self.files.directory!r} failed ({exc.strerror or exc}); no table or slot was changed. "
                    "Free space on that disk (or give the table a larger one) and run the step again."
                ) from exc
            self._initialized[b] = True
            self.counters["initialized_rows"] += hi - lo

    def _init_range(self, lo: int, hi: int, written: list[tuple[int, int]]) -> None:
        records = self.files.layout.pack({part: self._initial(part, lo, hi) for part in self.dtypes})
        offset = lo * self.row_bytes
        self.files.write(offset, records.reshape(-1).numpy().data, wait=False)
        written.append((offset, records.numel()))

    def _initial(self, part: str, lo: int, hi: int) -> Tensor:
        """The initial values [hi - lo, D] of local rows [lo, hi) of ``part`` ("" or a slot) in its storage
        type, as an in-memory table holds them: the weights rounded to nearest into a half type, each slot
        filled with its initial value."""
        dtype = self.dtypes[part]
        if part:
            return torch.full((hi - lo, self.dim), self.slot_values[part], dtype=dtype)  # as an in-memory fill_
        rows = self.first + self.stride * torch.arange(lo, hi, dtype=torch.int64)
        return initial_weights(self.logical, rows, self.seed).to(dtype)

    def read_records(self, lo: int, hi: int) -> Tensor:
        """The records [hi - lo, R] (uint8: every part, ``files.layout``) of local rows [lo, hi), read from the row
        file with ``pread`` (nothing mapped): rows never read are their initial values as the table would store
        them, computed here, not written. What a checkpoint streams, file to file."""
        self.check_open()  # torn or cut files were refused before the save began (``check_whole``), which
        # also wrote every written row of the cache back and merged the write log
        size = self.row_bytes
        out = torch.empty((hi - lo, size), dtype=torch.uint8)
        for b in range(lo // self.block, -(-hi // self.block)):
            a, z = max(lo, b * self.block), min(hi, (b + 1) * self.block)
            if bool(self._initialized[b]):
                self.files.read_into(a * size, out[a - lo : z - lo])
            else:
                out[a - lo : z - lo] = self.files.layout.pack({part: self._initial(part, a, z) for part in self.dtypes})
        return out

    def check_whole(self, what: str) -> None:
        """Raise unless the files hold the table, before ``what`` reads it whole (a whole-table access, a save):
        refused while closed or torn; a file cut short by something else tears them first (as admission does).
        Every written row of the cache is written back first: the files then hold the table as it is."""
        self.check_open()
        if self.torn is None:
            self.torn = self._cut_short()
            if self.torn is None:
                self.flush()
                self._compact()
                return
        raise TornFilesError(
            f"table {self.logical.name!r}: {what} refused: its working files under {self.files.directory!r} are torn "
            f"({self.torn}) and no longer hold the table. Lookups, whole-table reads (state_dict, embedding_tables, "
            "slot_variables, local_shards, changed_rows) and save are refused until restore() of a checkpoint or "
            "load_state_dict() of the whole state; the last checkpoint is untouched."
        )

    def _cut_short(self) -> str | None:
        """Why the files no longer hold the table when something else cut one short (its name and sizes), or None."""
        short = self.files.short_files()
        return f"files were cut short by something else ({'; '.join(short)})" if short else None

    def materialize(self, *, rewrite: bool = False) -> None:
        """Write the cache's written rows back and initialize every block never read: the files then hold every
        row, and their maps are handed out (``file_tensors``: taken in again at the next lookup or update).
        ``rewrite``: every row is written next (a full ``load_state_dict``): torn or cut files are accepted, their
        blocks reserved whole first (``before_restore``)."""
        if rewrite:
            self.before_restore("load_state_dict")
        else:
            self.check_whole("a whole-table access")
        todo = torch.nonzero(~self._initialized).flatten()
        if not self._warned_whole and self.rows > self.capacity:
            self._warned_whole = True  # once a table: a training loop's state_dict() each epoch says it once
            fresh = int(torch.clamp(self.rows - todo * self.block, max=self.block).sum()) if todo.numel() else 0
            logger.warning(
                "table %r: a whole-table access (state_dict, embedding_tables, slot_variables, local_shards, "
                "load_state_dict) maps all %d rows (%.2f GiB with their slots), more than its cache of %d rows, "
                "and writes the initial values of the %d rows never read into its files first. save() streams the "
                "table a piece at a time instead (docs/offload.md, 'Whole-table access').",
                self.logical.name, self.rows, self.rows * self.row_bytes / 2**30, self.capacity, fresh,
            )  # fmt: skip
        if todo.numel():
            self._init_blocks(todo)
        self._untracked = True

    def mark_untracked(self) -> None:
        """The files' maps were read or written outside a step: taken in again at the next lookup or update."""
        self._untracked = True

    # ------------------------------------------------------------------ the cache
    def _check_usable(self) -> None:
        """Raise unless lookups may read the files: open, not torn; a file cut short tears them first."""
        self.check_open()
        if self.torn is not None:
            raise TornFilesError(
                f"table {self.logical.name!r}: its working files are torn ({self.torn}): every lookup is refused "
                "until restore() of a checkpoint or load_state_dict() of the whole state. The last checkpoint is "
                "untouched."
            )
        cut = self._cut_short()
        if cut is not None:  # a read past a file's end would give no row
            self._tear(cut)

    def admit(self, rows: Tensor, step: int, pin_from: int) -> Tensor:
        """Bring local rows ``rows`` [any] into the cache before a lookup at ``step``, and return their slots (the
        same shape, dtype and device; an id outside [0, N) becomes C, outside the cache, which the lookup refuses
        as an id that changed after it was validated). Refuses (changing nothing) when the rows used since
        ``pin_from`` and these exceed the cache."""
        self._check_usable()
        self.refresh()
        return self._slots_of_valid(rows, lambda ids: self._admit_ids(ids, step, pin_from))

    def _slots_of_valid(self, rows: Tensor, slots: Callable[[Tensor], Tensor]) -> Tensor:
        """``rows`` [any] as slots (same shape, dtype and device): ``slots`` of the ids in [0, N) [K] (CPU int64,
        in order), C (outside the cache) for the others."""
        flat = rows.reshape(-1).to("cpu", torch.int64)
        valid = (flat >= 0) & (flat < self.rows)
        if bool(valid.all()):
            out = slots(flat) if flat.numel() else flat
        else:
            out = torch.full_like(flat, self.capacity)
            if bool(valid.any()):
                out[valid] = slots(flat[valid])
        return out.to(rows.device, rows.dtype).reshape(rows.shape)

    def _admit_ids(self, ids: Tensor, step: int, pin_from: int) -> Tensor:
        """``admit`` of valid local rows ``ids`` [N]: their slots [N]."""
        ordered = torch.sort(ids)
        wanted, inverse, uses = torch.unique_consecutive(ordered.values, return_inverse=True, return_counts=True)
        found = self.residency.where(wanted)
        at, present = found
        try:
            victims = self.residency.victims(wanted, step, pin_from, found)
        except NoRoom as room:
            raise InputError(
                f"table {self.logical.name!r}: this lookup and the rows still in use need {room.needed} rows in "
                f"memory (this batch has {wanted.numel()} distinct rows), more than Offload(cache_rows="
                f"{self.cache_rows}) holds. Raise cache_rows (to at least {room.needed}; a pipelined step also keeps "
                "the previous batch's rows) or use smaller batches. Nothing was changed."
            ) from None
        start = time.perf_counter()
        slots = torch.empty_like(wanted)
        slots[present] = self.residency.slots[at[present]].to(torch.int64)  # a row asked for stays in its slot
        if victims.numel():
            self._write_back(*self.residency.units_at(victims))
            self.residency.remove(victims)
            self.counters["evictions"] += int(victims.numel())
        missing = wanted[~present]
        self.counters["rows_looked_up"] += int(wanted.numel())
        self.counters["hits"] += int(wanted.numel() - missing.numel())
        if missing.numel():
            blocks = torch.unique_consecutive(torch.div(missing, self.block, rounding_mode="floor"))
            fresh = blocks[~self._initialized[blocks]]
            if fresh.numel():
                init_start = time.perf_counter()
                self._init_blocks(fresh)
                start += time.perf_counter() - init_start  # counted in init_s, not as the disk's wait
            given = self.residency.insert(missing)
            try:
                self._read_in(missing, given, ahead=True)
            except BaseException:
                self.residency.remove(self.residency.where(missing)[0])  # nothing half-read stays
                raise
            if self._rounds:
                self.slot_global[given] = self._rounding_ids(missing)
            slots[~present] = given
        self.residency.used(wanted, uses, step)
        self.disk_wait_s += time.perf_counter() - start
        self._epoch += 1  # rows were written back: a read-ahead started before now may be stale
        out = torch.empty_like(ids)
        out[ordered.indices] = slots[inverse]
        return out

    def check_room(self, distinct: int, pin_from: int) -> None:
        """Raise ``InputError`` when ``distinct`` rows beside those used since ``pin_from`` exceed the cache (a
        bound that counts a pinned row the batch asks for twice: a dynamic table's keys are checked before they
        have rows)."""
        pinned = int((self.residency.last_use >= min(pin_from, 2**31 - 1)).sum())
        if distinct + pinned > self.capacity:
            raise InputError(
                f"table {self.logical.name!r}: this lookup's {distinct} distinct keys and the {pinned} rows still in "
                f"use may need {distinct + pinned} rows in memory, more than Offload(cache_rows={self.cache_rows}) "
                f"holds. Raise cache_rows (to at least {distinct + pinned}; a pipelined step also keeps the previous "
                "batch's rows) or use smaller batches. Nothing was changed."
            )

    def reset(self, rows: Tensor, weights: Tensor, slots: dict[str, Tensor]) -> None:
        """Give local rows ``rows`` [R] (distinct) the values ``weights`` [R, D] and ``slots`` ({slot: [R, D]}): a
        dynamic table's rows handed to new keys. A cached row's slot is written (and written back later); any
        other row is written into the files now (its block initialized first), and counts as changed."""
        self._check_usable()
        self.refresh()
        rows = rows.to("cpu", torch.int64)
        values = {"": weights, **slots}
        at, present = self.residency.where(rows)
        if bool(present.any()):
            where = self.residency.slots[at[present]]
            with torch.no_grad():
                for part, block in self.cache.items():
                    block[where] = values[part][present].to(block.dtype)
            self.dirty[where] = True
            if self._rounds:
                self.slot_global[where] = self._rounding_ids(rows[present])  # a row handed to a new key
        rest = ~present
        if bool(rest.any()):
            order = torch.argsort(rows[rest])
            files_rows = rows[rest][order]
            blocks = torch.unique_consecutive(torch.div(files_rows, self.block, rounding_mode="floor"))
            fresh = blocks[~self._initialized[blocks]]
            if fresh.numel():
                self._init_blocks(fresh)
            records = self.files.layout.pack({part: values[part][rest][order] for part in self.dtypes})
            try:
                self.files.row_io(files_rows, records, write=True)
            except OSError as exc:
                self._tear(f"writing rows to disk failed ({exc.strerror or exc})", exc)
            self.changed.mark(files_rows)
            self._epoch += 1

    def round_by(self, row_ids: Tensor) -> None:
        """Round each local row's updates with ``row_ids[row]`` ([N] int64, read at each admission: a dynamic
        half table's keys, which its key map's lookups keep current) instead of its global id."""
        self._row_ids = row_ids

    def _rounding_ids(self, rows: Tensor) -> Tensor:
        """What local ``rows`` [K] round with [K]: their global ids, or the ids ``round_by`` gave."""
        if self._row_ids is not None:
            return self._row_ids[rows].to(torch.int64)
        return self.first + self.stride * rows

    def translate(self, ids: Tensor) -> Tensor:
        """The slots of cached local rows ``ids`` [any] (same shape and dtype); an id outside [0, N) becomes C
        (outside the cache), which the lookup refuses as an id that changed after it was validated."""
        return self._slots_of_valid(ids, self.residency.slots_of)

    def local_rows(self, slots: Tensor) -> Tensor:
        """The local rows [K] held by cached ``slots`` [K] (a written slot's row, for the stale rows a pipelined
        lookup reads)."""
        by_slot = torch.full((self.capacity,), -1, dtype=torch.int64)
        by_slot[self.residency.slots] = self.residency.units.to(torch.int64)
        rows = by_slot[slots.to("cpu", torch.int64)]
        if bool((rows < 0).any()):
            raise RuntimeError(f"table {self.logical.name!r}: a slot of the row cache holds no row (a bug)")
        return rows

    def prefetch(self, rows: Tensor) -> None:
        """Start reading local rows ``rows`` [any] that are on disk and not cached, in the background (a staged
        batch's, before its lookup admits them: ``ReadAhead``)."""
        if self.torn is not None or self.closed:
            return
        rows = rows.reshape(-1).to("cpu", torch.int64)
        rows = torch.unique(rows[(rows >= 0) & (rows < self.rows)])
        if rows.numel() == 0:
            return
        rows = rows[~self.residency.where(rows)[1]]
        rows = rows[self._initialized[torch.div(rows, self.block, rounding_mode="floor")]]
        self.counters["rows_prefetched"] += int(rows.numel())
        files = self.files
        self.read_ahead.start(rows, files.layout.empty, lambda r, v: files.row_io(r, v, write=False), self._epoch)

    def _read_in(self, rows: Tensor, slots: Tensor, *, ahead: bool = False) -> None:
        """Read local rows ``rows`` [K] (ascending) of every file into cache ``slots`` [K] (``pread``; ``ahead``:
        those read ahead for this epoch taken from there): a read error tears the files and raises."""
        layout = self.files.layout
        got = self.read_ahead.take(rows, self._epoch) if ahead else None
        if got is not None:
            found, ahead_records = got
            for part, block in self.cache.items():
                block[slots[found]] = layout.view(ahead_records, part)
            self.counters["rows_read_ahead"] += int(found.sum())
            rows, slots, done = rows[~found], slots[~found], slots[found]
            self.dirty[done] = False
            self.counters["rows_read"] += int(done.numel())
            self.counters["bytes_read"] += int(done.numel()) * self.row_bytes
        records = layout.empty(int(rows.numel()))
        try:
            self.files.row_io(rows, records, write=False)
        except OSError as exc:
            self._tear(f"reading rows from disk failed ({exc.strerror or exc})", exc)
        for part, block in self.cache.items():
            block[slots] = layout.view(records, part)
        self.dirty[slots] = False
        n = int(rows.numel())
        self.counters["rows_read"] += n
        self.counters["bytes_read"] += n * self.row_bytes

    def _write_back(self, rows: Tensor, slots: Tensor) -> None:
        """Write the written ones of cached ``rows`` [K] (ascending) in ``slots`` [K] back to the files
        (``pwrite``; they count as changed since the last save): a failure (a full disk) tears the files and
        raises."""
        written = self.dirty[slots]
        if not bool(written.any()):
            return
        rows, slots = rows[written], slots[written]
        records = self.files.layout.pack({part: block[slots] for part, block in self.cache.items()})
        try:
            self.files.row_io(rows, records, write=True)
        except OSError as exc:
            self._tear(f"writing rows back to disk failed ({exc.strerror or exc})", exc)
        self.dirty[slots] = False
        self.changed.mark(rows)
        n = int(rows.numel())
        self.counters["rows_written"] += n
        self.counters["bytes_written"] += n * self.row_bytes

    def flush(self) -> None:
        """Write every written row of the cache back to the files (they stay cached, clean)."""
        if len(self.residency) and bool(self.dirty.any()):
            start = time.perf_counter()
            self._write_back(*self.residency.units_at())
            self.disk_wait_s += time.perf_counter() - start

    def _compact(self) -> None:
        """Merge the write log into the row file (whose maps and ``read_records`` then hold every row written
        back): a failure tears the files and raises."""
        try:
            self.files.compact()
        except OSError as exc:
            self._tear(f"merging written rows into the row file failed ({exc.strerror or exc})", exc)

    def refresh(self) -> None:
        """After the files' maps were handed out (``materialize``, a restore): write back and drop their pages,
        then read every cached row again, so a lookup or update computes on what was written through them."""
        if not self._untracked:
            return
        self._epoch += 1  # what was written through the maps may be newer than a read-ahead
        self._check_usable()
        self.flush()  # none is written here: a whole-table access flushed, and every write since refreshed first
        try:
            self.files.drop(0, -(-self.files.nbytes // _PAGE) * _PAGE, dirty=True)
        except OSError as exc:
            self._tear(f"writing rows back to disk failed ({exc.strerror or exc})", exc)
        if len(self.residency):
            start = time.perf_counter()
            self._read_in(*self.residency.units_at())
            self.disk_wait_s += time.perf_counter() - start
        self._untracked = False

    def _tear(self, why: str, cause: BaseException | None = None) -> NoReturn:
        """The files no longer hold the table (``why``): every lookup is refused until a restore; raises."""
        self.files.tear(why, cause)

    @property
    def torn(self) -> str | None:
        """Why the files no longer hold the table (``ShardFiles.torn``), or None."""
        return self.files.torn

    @torn.setter
    def torn(self, why: str | None) -> None:
        self.files.torn = why

    @property
    def closed(self) -> bool:
        """The files were released (``close``)."""
        return self.files.closed

    def before_restore(self, what: str = "restore") -> None:
        """A restore (``what``) writes every row through the maps next: the cache's written rows go back first
        (a refused restore then loses nothing) and the files' blocks are reserved whole (files cut short grown
        back): a store through a map past a file's end, or into a hole of a full disk, would kill the process
        (SIGBUS). A full disk raises here, with nothing changed."""
        self.check_open()
        self.torn = self.torn or self._cut_short()  # stays torn if the reservation fails: the cut rows are gone
        if self.torn is None:
            self.flush()
            self._compact()
        try:
            self.files.allocate()
        except OSError as exc:
            total = self.files.nbytes
            raise RuntimeError(
                f"table {self.logical.name!r}: {what} writes all {self.rows} rows into its files under "
                f"{self.files.directory!r} ({total} bytes with their slots); reserving that space failed "
                f"({exc.strerror or exc}). Nothing was changed: every table and slot is as it was. Free space on "
                "that disk (or give the table a directory on a larger one) and try again."
            ) from exc
        self._untracked = True

    def written(self, part: str, lo: int, hi: int) -> None:
        """Local rows [lo, hi) of ``part`` were just written through the maps outside a step (a restore's
        piece): their pages leave the process, so a restore's memory stays a piece. The other parts of those
        records are written too (by the same restore), so only the last part's writes send the pages to the disk
        and out of the page cache; the others leave them there, dirty, for the next part to find."""
        size = self.row_bytes
        first = lo * size // _PAGE * _PAGE
        last = -(-hi * size // _PAGE) * _PAGE
        final = part == list(self.dtypes)[-1]
        try:
            self.files.drop(first, last - first, dirty=True, unmap_only=not final)
        except OSError as exc:
            self._tear(f"writing rows back to disk failed ({exc.strerror or exc})", exc)

    def restored(self) -> None:
        """Every row was just written (a restore, a full load_state_dict): the files hold the whole table, and the
        cache starts empty (its rows were written back by ``before_restore``; a restore's steps may go back)."""
        self.torn = None
        self.files.forget_log()  # older than what the restore wrote
        self._initialized[:] = True
        self.counters["initialized_rows"] = self.rows
        self.dirty.zero_()
        self.residency.clear()
        self._epoch += 1
        self._untracked = True  # the maps' pages written by the restore are dropped at the next lookup

    # ------------------------------------------------------------------ changed rows
    def changed_rows(self) -> Tensor:
        """The local rows [R] (ascending) written since the last ``clear_changed``: those written back, and the
        cached ones written and not back yet."""
        marked = self.changed.rows()
        pending = self.residency.units[self.dirty[self.residency.slots]].to(torch.int64)
        return torch.unique(torch.cat((marked, pending))) if pending.numel() else marked

    def mark_all_changed(self) -> None:
        self.changed.mark_all()

    def clear_changed(self) -> None:
        """A save or restore: nothing changed since (the written cached rows were written back first)."""
        self.changed.clear()

    # ------------------------------------------------------------------ counters, tensors, life
    def resident_rows(self) -> int:
        return len(self.residency)

    def statistics(self) -> dict[str, float]:
        """Counters since construction: rows looked up, cache hits, rows and bytes read and written, seconds
        waiting for the disk, rows initialized and the seconds that took, evictions, the write log's merges into
        the row file; ``resident_rows``, ``cache_rows`` (as passed) and ``cache_slots`` (the rows the cache
        holds) now."""
        out: dict[str, float] = dict(self.counters)
        out["log_merges"] = self.files.log.merges if self.files.log is not None else 0
        out["disk_wait_s"] = self.disk_wait_s
        out["init_s"] = self.init_s
        out["resident_rows"] = self.resident_rows()
        out["cache_rows"] = self.cache_rows  # as passed
        out["cache_slots"] = self.capacity  # the rows it holds: min(cache_rows, the shard's rows)
        return out

    def state_tensors(self) -> tuple[Tensor, dict[str, Tensor]]:
        """(weights [C, D], {slot: [C, D]}): the cache, what the engine computes on."""
        return self.cache[""], {k: v for k, v in self.cache.items() if k}

    def file_tensors(self) -> dict[str, Tensor]:
        """``{"" or slot: [N, D]}``: the maps of the files, the whole table (after ``materialize``)."""
        self.check_open()
        return dict(self.files.tensors)

    def check_open(self) -> None:
        """Raise when the files were released (``close``): nothing may read or write through them."""
        self.files.check_open()

    def close(self) -> None:
        """Release the files and their lock (another module may then open the directory); every later access
        through this cache is refused. The tensors handed out keep their maps (memory-safe to read)."""
        self.read_ahead.close()
        self.files.close()
