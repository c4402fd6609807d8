"""``OffloadedRows``: one offloaded table shard's rows and slots in files, with at most ``cache_rows`` rows in
memory (docs/offload.md).

The tensors the engine computes on are shared memory maps of the files ([N, D] each: weights, slots), so every
kernel, optimizer, combiner and input type runs unchanged and gives the bits of an in-memory table. What is
in memory is managed here, in groups of G rows (whole pages of every file):

* **admission** (before a lookup reads rows): the least used groups (ids looked up since they were read in,
  decayed by ``USE_DECAY`` a step; ``offload_residency.Residency`` keeps that bookkeeping and chooses) are
  dropped until the batch's fit in ``cache_rows`` (``MADV_DONTNEED``; those written since they were read are
  written back first, all together: ``sync_file_range``, then
  ``POSIX_FADV_DONTNEED``: neither the process nor the page cache keeps them); the batch's rows that were never
  initialized get their initial values (the initializer's draw for their block of ``INIT_BLOCK`` global rows, from
  the table's seed: the same values for any cache, shard layout or order of first reads), written with ``pwrite``;
  the groups not in memory are read in (timed: the disk wait). Groups used at or after ``pin_from`` (the current
  batch, and the previous one while its update is pending) are never dropped; when they alone exceed the cache,
  the lookup is refused before anything changes.
* **read-ahead** (a batch staged by ``enqueue``): its groups on disk start coming into the page cache.
* **whole-table access** (``state_dict``, ``embedding_tables``, ``load_state_dict``): every block is initialized
  first (``materialize``); the next admission writes back and drops everything (``release``). ``save`` reads
  the files with ``pread`` instead (``read_rows``), ``restore`` writes back and drops each piece it writes
  (``written``).

Shapes: N the shard's rows, D the width, G rows a group, U distinct rows of a batch.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import time
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.config.offload import Offload
from embtables.errors import InputError, TornFilesError
from embtables.tables.offload_files import DROP_CLEAN, DROP_WRITTEN, READ, SETTLE, WILL_NEED, ShardFiles
from embtables.tables.offload_initial import INIT_BLOCK, OffloadShard, initial_weights
from embtables.tables.offload_residency import NoRoom, Residency

logger = logging.getLogger("embtables")

# The cache's unit: whole pages of every file. Linux also maps the pages around a read fault that are in the page
# cache (fault-around): the cache keeps only the pages it counts there (initial values and evicted pages are
# written back and dropped), so a neighbour is never mapped behind its back.
_PAGE = mmap.PAGESIZE


def _group_rows(dim: int, itemsizes: list[int]) -> int:
    """G: the fewest rows whose bytes are whole pages in every file."""
    g = 1
    for size in itemsizes:
        row = dim * size
        g = math.lcm(g, _PAGE // math.gcd(_PAGE, row))
    return g


class OffloadedRows:
    """The files, cache and counters of one offloaded table shard (see the module docstring).

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
        logical, shard = where.logical, where.shard
        self.group = _group_rows(self.dim, [d.itemsize for d in parts.values()])
        self.block = -(-INIT_BLOCK // self.group) * self.group  # local rows initialized together
        if offload.cache_rows < self.group:
            raise InputError(
                f"table {table.name!r}: Offload(cache_rows={offload.cache_rows}) holds less than one page group of "
                f"{self.group} rows (whole {_PAGE}-byte pages of every file). Raise cache_rows to at least "
                f"{self.group}."
            )
        self.budget = offload.cache_rows // self.group  # groups in memory at most
        self.cache_rows = offload.cache_rows  # as the user passed it (the cache holds ``budget`` whole groups)
        self.files = ShardFiles(str(offload.directory), logical.name, shard, self.rows, self.dim, parts)
        self.tensors = self.files.tensors
        # A byte per block of >= INIT_BLOCK rows; everything else per group in memory (at most ``budget``), in
        # arrays by ascending group: the memory of the cache's bookkeeping is the cache's, not the table's.
        self._initialized = torch.zeros(-(-self.rows // self.block), dtype=torch.bool)
        self.residency = Residency(self.budget)  # the groups in memory, which leave first (no I/O)
        self._untracked = False  # a whole-table access mapped pages the cache does not count
        self._warned_whole = False  # a whole-table access beyond the cache was logged
        self._pending: list[tuple[str, Tensor]] = []  # (part, byte ranges [n, 2]) being written back
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
            ),
            0,
        )
        self.counters["initialized_rows"] = 0
        self.disk_wait_s = 0.0
        self.init_s = 0.0  # seconds drawing and writing initial values (a row's first touch)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in every file together."""
        return sum(t.element_size() * self.dim for t in self.tensors.values())

    # ------------------------------------------------------------------ initialization
    def _init_blocks(self, blocks: Tensor) -> None:
        """Write initial values into local blocks ``blocks`` (never initialized) of every file (timed: ``init_s``)."""
        start = time.perf_counter()
        try:
            self._init_each(blocks)
        finally:
            self.init_s += time.perf_counter() - start

    def _init_each(self, blocks: Tensor) -> None:
        written: list[tuple[str, int, int]] = []  # (part, offset, length): their write-backs run together
        try:
            self._init_written(blocks, written)
        finally:
            try:
                for part, offset, length in written:
                    self.files.settle(part, offset, length)
            except OSError as exc:  # the write-back failed: the files no longer hold what the cache believes
                self._tear(f"writing initial values to disk failed ({exc.strerror or exc})", exc)

    def _init_written(self, blocks: Tensor, written: list[tuple[str, int, int]]) -> None:
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

    def _init_range(self, lo: int, hi: int, written: list[tuple[str, int, int]]) -> None:
        for part, tensor in self.tensors.items():
            data = self._initial(part, lo, hi).contiguous().view(torch.uint8).numpy().tobytes()
            offset = lo * self.dim * tensor.element_size()
            self.files.write(part, offset, data, wait=False)
            written.append((part, offset, len(data)))

    def _initial(self, part: str, lo: int, hi: int) -> Tensor:
        """The initial values [hi - lo, D] of local rows [lo, hi) of ``part`` ("" or a slot) in its storage
        type, as an in-memory table holds them: the weights rounded to nearest into a half type, each slot
        filled with its initial value."""
        dtype = self.tensors[part].dtype
        if part:
            return torch.full((hi - lo, self.dim), self.slot_values[part], dtype=dtype)  # as an in-memory fill_
        rows = self.first + self.stride * torch.arange(lo, hi, dtype=torch.int64)
        return initial_weights(self.logical, rows, self.seed).to(dtype)

    def read_rows(self, part: str, lo: int, hi: int) -> Tensor:
        """Local rows [lo, hi) of ``part`` ("" or a slot) [hi - lo, D] in their storage type, read from the
        files with ``pread`` (nothing mapped): rows never read are their initial values as the table would store
        them, computed here, not written. What a checkpoint streams, file to file."""
        self.check_open()  # torn or cut files were refused before the save began (``check_whole``)
        dtype = self.tensors[part].dtype
        out = torch.empty((hi - lo, self.dim), dtype=dtype)
        size = self.dim * dtype.itemsize
        for b in range(lo // self.block, -(-hi // self.block)):
            a, z = max(lo, b * self.block), min(hi, (b + 1) * self.block)
            if bool(self._initialized[b]):
                data = bytearray(self.files.read(part, a * size, (z - a) * size))
                values = torch.frombuffer(data, dtype=dtype).view(z - a, self.dim)
            else:
                values = self._initial(part, a, z)
            out[a - lo : z - lo] = values
        return out

    def check_whole(self, what: str) -> None:
        """Raise unless the files hold the table, before ``what`` reads it whole (a whole-table access, a save):
        refused while closed or torn; a file cut short by something else tears them first (as admission does)."""
        self.check_open()
        if self.torn is None:
            self.torn = self._cut_short()
            if self.torn is None:
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
        """Initialize every block never read: the files then hold every row (before a whole-table access, which
        ``check_whole`` admits first). ``rewrite``: every row is written next (a full ``load_state_dict``): torn
        or cut files are accepted, their blocks reserved whole first (``before_restore``)."""
        if rewrite:
            self.before_restore("load_state_dict")
        else:
            self.check_whole("a whole-table access")
        todo = torch.nonzero(~self._initialized).flatten()
        if not self._warned_whole and self.rows > self.budget * self.group:
            self._warned_whole = True  # once a table: a training loop's state_dict() each epoch says it once
            fresh = int(torch.clamp(self.rows - todo * self.block, max=self.block).sum()) if todo.numel() else 0
            logger.warning(
                "table %r: a whole-table access (state_dict, embedding_tables, slot_variables, local_shards, "
                "load_state_dict) maps all %d rows (%.2f GiB with their slots), more than its cache of %d rows, "
                "and writes the initial values of the %d rows never read into its files first. save() streams the "
                "table a piece at a time instead (docs/offload.md, 'Whole-table access').",
                self.logical.name, self.rows, self.rows * self.row_bytes / 2**30, self.budget * self.group, fresh,
            )  # fmt: skip
        if todo.numel():
            self._init_blocks(todo)
        self._untracked = True

    def mark_untracked(self) -> None:
        """Pages were mapped outside admissions (a whole-table read or write): released at the next one."""
        self._untracked = True

    # ------------------------------------------------------------------ the cache
    def admit(self, rows: Tensor, step: int, pin_from: int, training: bool) -> None:
        """Bring local rows ``rows`` [any] into memory (initialized) before a lookup at ``step``: refuses
        (changing nothing) when the groups used since ``pin_from`` and these exceed the cache."""
        self.check_open()
        if self.torn is not None:
            raise TornFilesError(
                f"table {self.logical.name!r}: its working files are torn ({self.torn}): every lookup is refused "
                "until restore() of a checkpoint or load_state_dict() of the whole state. The last checkpoint is "
                "untouched."
            )
        cut = self._cut_short()
        if cut is not None:  # a touch of a mapping past its file's end would kill the process (SIGBUS)
            self._tear(cut)
        if self._untracked:
            self.release()
        ids = rows.reshape(-1).to("cpu", torch.int64)
        ids = ids[(ids >= 0) & (ids < self.rows)]  # ids are validated later, by the lookup
        if ids.numel() == 0:
            return
        rows = torch.unique(ids)
        groups, uses = torch.unique(torch.div(ids, self.group, rounding_mode="floor"), return_counts=True)
        try:
            victims = self.residency.victims(groups, step, pin_from)
        except NoRoom as room:
            needed = room.needed * self.group
            raise InputError(
                f"table {self.logical.name!r}: this lookup and the rows still in use need {needed} rows in "
                f"memory ({groups.numel()} groups of {self.group} rows for this batch's {rows.numel()} rows), "
                f"more than Offload(cache_rows={self.cache_rows}) holds ({self.budget} groups: "
                f"{self.budget * self.group} rows). Raise cache_rows (to at least {needed}; a pipelined step also "
                "keeps the previous batch's rows) or use smaller batches. Nothing was changed."
            ) from None
        if victims.numel():
            start = time.perf_counter()
            self._evict(self.residency.units[victims], self.residency.dirty[victims])
            self.residency.remove(victims)
            # their write-backs run together; once done, their pages leave the page cache, before any read
            # below could map one of them as a neighbour of its own page (fault-around)
            self._settle()
            self.disk_wait_s += time.perf_counter() - start  # the write-backs' wait is the disk's too
        _, present = self.residency.where(groups)
        missing = groups[~present]
        blocks = torch.unique_consecutive(torch.div(groups * self.group, self.block, rounding_mode="floor"))
        fresh = blocks[~self._initialized[blocks]]
        if fresh.numel():
            self._init_blocks(fresh)
        self.counters["rows_looked_up"] += rows.numel()
        _, per_group = torch.unique_consecutive(torch.div(rows, self.group, rounding_mode="floor"), return_counts=True)
        self.counters["hits"] += int(per_group[present].sum())  # rows and groups both ascending: aligned
        if missing.numel():
            self._read_in(missing)
            self.residency.insert(missing)
        self.residency.used(groups, uses, step, training)

    def prefetch(self, rows: Tensor) -> None:
        """Start reading the pages of local rows ``rows`` [any] that are on disk and not in memory into the page
        cache, asynchronously (a staged batch's, before its lookup admits them)."""
        if self.torn is not None or self.closed:
            return
        rows = rows.reshape(-1).to("cpu", torch.int64)
        rows = rows[(rows >= 0) & (rows < self.rows)]
        if rows.numel() == 0:
            return
        groups = torch.unique(torch.div(rows, self.group, rounding_mode="floor"))  # sorted
        groups = groups[~self.residency.where(groups)[1]]
        groups = groups[self._initialized[torch.div(groups * self.group, self.block, rounding_mode="floor")]]
        self.counters["rows_prefetched"] += groups.numel() * self.group
        self._will_need(groups)

    def _will_need(self, groups: Tensor) -> dict[str, Tensor]:
        """Start reading ``groups`` (sorted) into the page cache; returns their byte ranges [n, 2] in each file."""
        starts, lengths, _ = _run_bounds(groups, torch.zeros_like(groups, dtype=torch.bool))
        ranges = {part: self._byte_ranges(part, starts, lengths) for part in self.tensors}
        for part, byte_ranges in ranges.items():
            self.files.page_work(part, WILL_NEED, byte_ranges)
        return ranges

    def _byte_ranges(self, part: str, starts: Tensor, lengths: Tensor) -> Tensor:
        """[n, 2] (offset, length) in ``part``'s file of the runs of groups ``starts`` [n], ``lengths`` [n]."""
        size = self.group * self.dim * self.tensors[part].element_size()  # whole pages
        return torch.stack((starts * size, lengths * size), dim=1)

    def _read_in(self, groups: Tensor) -> None:
        """Fault the pages of ``groups`` in now (timed: the disk wait), not inside a kernel: their reads go in
        flight together, then each is read with ``pread`` (a read error is an error here, not a SIGBUS at the
        touch of the mapping), then one element a page is touched."""
        start = time.perf_counter()
        for part, byte_ranges in self._will_need(groups).items():
            try:
                self.files.page_work(part, READ, byte_ranges)
            except OSError as exc:
                what = "the weights" if not part else f"slot {part!r}"
                self._tear(f"reading {what} from disk failed ({exc.strerror or exc})", exc)
        for tensor in self.tensors.values():
            per_page = _PAGE // tensor.element_size()  # elements a page
            pages = self.group * self.dim // per_page  # pages a group (a whole number: see _group_rows)
            first = (groups * (pages * per_page))[:, None] + torch.arange(pages)[None, :] * per_page
            first = first.reshape(-1)
            tensor.view(-1).index_select(0, first[first < tensor.numel()])  # one element of every page
        self.disk_wait_s += time.perf_counter() - start
        n = int(torch.clamp(self.rows - groups * self.group, max=self.group).sum())
        self.counters["rows_read"] += n
        self.counters["bytes_read"] += n * self.row_bytes

    def _evict(self, groups: Tensor, written: Tensor) -> None:
        """Drop ``groups`` (sorted) from memory; those ``written`` since they were read start their write-back
        (all of them in flight together: ``_settle`` waits for them and drops their pages). The caller takes
        them out of the resident arrays."""
        starts, lengths, dirty = _run_bounds(groups, written)
        for part in self.tensors:
            clean = self._byte_ranges(part, starts[~dirty], lengths[~dirty])
            written = self._byte_ranges(part, starts[dirty], lengths[dirty])
            self._io(part, functools.partial(self.files.page_work, part, DROP_CLEAN, clean))
            self._io(part, functools.partial(self.files.page_work, part, DROP_WRITTEN, written))
            if written.numel():
                self._pending.append((part, written))
        rows = int(torch.clamp(self.rows - starts[dirty] * self.group, max=lengths[dirty] * self.group).sum())
        self.counters["rows_written"] += rows
        self.counters["bytes_written"] += rows * self.row_bytes
        self.counters["evictions"] += groups.numel()

    def _settle(self) -> None:
        """Wait for the write-backs the last evictions started, and drop their pages from the page cache."""
        pending, self._pending = self._pending, []
        for part, ranges in pending:
            self._io(part, functools.partial(self.files.page_work, part, SETTLE, ranges))

    def _io(self, part: str, operation: Callable[[], None]) -> None:
        """Run a write-back ``operation`` of ``part``; a failure tears the files (``torn``) and raises."""
        try:
            operation()
        except OSError as exc:
            what = "the weights" if not part else f"slot {part!r}"
            self._tear(f"writing {what} back to disk failed ({exc.strerror or exc})", exc)

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
        """A restore (``what``) writes every row through the maps next: the files' blocks are reserved whole
        first (files cut short grown back): a store through a map past a file's end, or into a hole of a full
        disk, would kill the process (SIGBUS). A full disk raises here, with nothing changed."""
        self.check_open()
        self.torn = self.torn or self._cut_short()  # stays torn if the reservation fails: the cut rows are gone
        try:
            self.files.allocate()
        except OSError as exc:
            total = sum(self.files.nbytes.values())
            raise RuntimeError(
                f"table {self.logical.name!r}: {what} writes all {self.rows} rows into its files under "
                f"{self.files.directory!r} ({total} bytes with their slots); reserving that space failed "
                f"({exc.strerror or exc}). Nothing was changed: every table and slot is as it was. Free space on "
                "that disk (or give the table a directory on a larger one) and try again."
            ) from exc

    def written(self, part: str, lo: int, hi: int) -> None:
        """Local rows [lo, hi) of ``part`` were just written through the maps outside a step (a restore's
        piece): write them back and drop them (their whole pages), so a restore's memory stays a piece."""
        size = self.dim * self.tensors[part].element_size()
        first = lo * size // _PAGE * _PAGE
        last = -(-hi * size // _PAGE) * _PAGE
        self._io(part, functools.partial(self.files.drop, part, first, last - first, dirty=True))

    def restored(self) -> None:
        """Every row was just written (a restore, a full load_state_dict): the files hold the whole table."""
        self.torn = None
        self._initialized[:] = True
        self.counters["initialized_rows"] = self.rows
        self._untracked = True

    def release(self) -> None:
        """Write back and drop every row from memory."""
        self._settle()
        written = int(self.residency.dirty.sum()) * self.group  # (the last group may be short: counted whole)
        for part, tensor in self.tensors.items():
            length = -(-self.rows * self.dim * tensor.element_size() // _PAGE) * _PAGE
            self._io(part, functools.partial(self.files.drop, part, 0, length, dirty=True))
        self.counters["rows_written"] += written
        self.counters["bytes_written"] += written * self.row_bytes
        self.residency.clear()
        self._untracked = False

    def resident_rows(self) -> int:
        return len(self.residency) * self.group

    def statistics(self) -> dict[str, float]:
        """Counters since construction: rows looked up, cache hits, rows and bytes read and written, seconds
        waiting for the disk, rows initialized and the seconds that took, evictions; ``resident_rows`` and
        ``cache_rows`` now."""
        out: dict[str, float] = dict(self.counters)
        out["disk_wait_s"] = self.disk_wait_s
        out["init_s"] = self.init_s
        out["resident_rows"] = self.resident_rows()
        out["cache_rows"] = self.cache_rows
        out["cache_groups"] = self.budget
        out["group_rows"] = self.group
        return out

    def state_tensors(self) -> tuple[Tensor, dict[str, Tensor]]:
        """(weights [N, D], {slot: [N, D]}): the live tensors over the files."""
        return self.tensors[""], {k: v for k, v in self.tensors.items() if k}

    def check_open(self) -> None:
        """Raise when the files were released (``close``): nothing may read or write through them."""
        self.files.check_open()

    def close(self) -> None:
        """Release the files and their lock (another module may then open the directory); every later access
        through this cache is refused. The tensors handed out keep their maps (memory-safe to read)."""
        self.files.close()


def _run_bounds(groups: Tensor, dirty: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The maximal runs of consecutive ``groups`` [K] (sorted) with the same ``dirty`` [K]: (first group [n],
    length in groups [n], dirty [n])."""
    if groups.numel() == 0:
        empty = groups.new_zeros(0)
        return empty, empty, dirty.new_zeros(0)
    breaks = torch.ones(groups.numel(), dtype=torch.bool)
    breaks[1:] = (groups[1:] != groups[:-1] + 1) | (dirty[1:] != dirty[:-1])
    first = torch.nonzero(breaks).flatten()
    ends = torch.cat((first[1:], torch.tensor([groups.numel()])))
    return groups[first], ends - first, dirty[first]
