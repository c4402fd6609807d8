"""The working files of an offloaded table shard (docs/offload.md): one file of records, a row's weights and
its slots side by side (``RecordLayout``), a JSON record of what embtables wrote, and a lock held while the
files are open.

    <directory>/<table>.<shard>.meta.json   what embtables wrote (magic, table, shard, files, shape, dtypes, layout)
    <directory>/<table>.<shard>.lock        flock'ed by the process that has the files open
    <directory>/<table>.<shard>.rows        [N, R] records (R bytes: the weights, then each slot), created sparse

A row that is not in memory is one read and one write of R contiguous bytes (one page when R divides 4096),
not one in each of 1 + S files. A directory holding any file that no valid record lists is refused: embtables
never overwrites or deletes a file it did not write. The row file is scratch: a new module starts it afresh
(``save``/``restore`` keep a table). The row cache reads and writes records by row index (``row_io``:
``pread``/``pwrite``); a whole-table access and a restore go through a shared memory map of the file
(``tensors``: a strided [N, D] view per part).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from embtables.errors import ClosedFilesError, ConfigError, TornFilesError
from embtables.kernels import native_abi, native_library
from embtables.tables.offload_log import WriteLog, chunk_bytes

MAGIC = "embtables-offload-v1"
IO_DEPTH = 32  # row reads and writes in flight at once (``et_offload_rows``; docs/offload.md)
# How they are kept in flight: "io_uring" (one ring in the calling thread, where the kernel allows it; else
# threads) or "threads" (each with one pread/pwrite). Chosen once, at the first row I/O (``io_engine``);
# EMBTABLES_OFFLOAD_IO overrides it (measured: docs/offload.md, "Measured").
IO_ENGINE = "io_uring"
# Whether a row's pages leave the page cache once read (measured: docs/offload.md, "Measured"). Left there, a
# row's write-back finds its page (else the kernel reads the page from the disk first, as pwrite changes part of it)
DROP_AFTER_READ = False
META = ".meta.json"


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)
_SYNC_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER
_SYNC_START = 2  # SYNC_FILE_RANGE_WRITE: start the write-back, do not wait


def _sync_range(fd: int, offset: int, length: int, flags: int = _SYNC_WAIT) -> None:
    """Write bytes [offset, offset + length) of ``fd`` back to the disk and wait (``flags``: only start it), with
    ``sync_file_range`` (the whole file's ``fdatasync`` where the C library lacks it). An I/O error raises
    ``OSError``."""
    if _SYNC_FILE_RANGE is None:
        os.fdatasync(fd)
        return
    if _SYNC_FILE_RANGE(fd, ctypes.c_int64(offset), ctypes.c_int64(length), ctypes.c_uint(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass(frozen=True)
class RecordLayout:
    """Where each part ("" for the weights, then each slot by its TF name) of a row lies in its record: ``offsets``
    in bytes, each a multiple of 8; ``nbytes`` (R) the record's size, a multiple of 8 (zero padding after a part
    of a half type whose width is not a multiple of 4)."""

    dim: int
    dtypes: dict[str, torch.dtype]
    offsets: dict[str, int]
    nbytes: int

    @classmethod
    def of(cls, dim: int, dtypes: dict[str, torch.dtype]) -> RecordLayout:
        offsets, at = {}, 0
        for part, dtype in dtypes.items():
            offsets[part] = at
            at += -(-dim * dtype.itemsize // 8) * 8
        return cls(dim, dict(dtypes), offsets, max(at, 8))

    def empty(self, rows: int) -> Tensor:
        """Records [rows, R] (uint8) to read into, or to ``pack`` (padding zeroed)."""
        out = torch.empty((rows, self.nbytes), dtype=torch.uint8)
        padded = self.nbytes > sum(self.dim * d.itemsize for d in self.dtypes.values())
        return out.zero_() if padded else out

    def view(self, records: Tensor, part: str) -> Tensor:
        """``part``'s values [K, D] in ``records`` [K, R] (uint8, rows of stride R), a view: writing it writes
        the records."""
        dtype, at = self.dtypes[part], self.offsets[part]
        return records[:, at : at + self.dim * dtype.itemsize].view(dtype)

    def unpack(self, records: Tensor) -> dict[str, Tensor]:
        """``{part: [K, D] view}`` of ``records`` [K, R]."""
        return {part: self.view(records, part) for part in self.dtypes}

    def pack(self, values: dict[str, Tensor]) -> Tensor:
        """Records [K, R] holding ``values`` ({part: [K, D]}, each converted to its part's type)."""
        rows = int(next(iter(values.values())).shape[0])
        out = self.empty(rows)
        for part, v in values.items():
            self.view(out, part).copy_(v)
        return out


_ENGINE: list[str] = []  # the engine in use, once chosen


def set_io_engine(name: str, *, always: bool = False) -> str:
    """Keep ``et_offload_rows``' requests in flight with ``name`` ("io_uring" or "threads"); ``always``: from the
    first run of a call, without first timing whether the disk or the page cache answers (tests, benchmarks).
    Returns the engine in use: "threads" where io_uring is refused (an old kernel, a seccomp policy) or the
    native library is not built."""
    lib = native_library.library()
    got = 0 if lib is None else int(lib.et_offload_io_engine((1 if name == "io_uring" else 0) | (2 if always else 0)))
    _ENGINE[:] = ["io_uring" if got & 1 else "threads"]
    return _ENGINE[0]


def io_engine() -> str:
    """The engine in use: ``IO_ENGINE`` (or the environment's ``EMBTABLES_OFFLOAD_IO``), chosen at the first
    call (``set_io_engine``)."""
    if not _ENGINE:
        set_io_engine(os.environ.get("EMBTABLES_OFFLOAD_IO", IO_ENGINE))
    return _ENGINE[0]


def file_stem(table: str, shard: str) -> str:
    """``<table>.<shard>`` with the table's name made a safe file name (percent-encoded; long names hashed)."""
    safe = urllib.parse.quote(table, safe="-_")
    if len(safe) > 100:
        safe = safe[:60] + "-" + hashlib.sha256(table.encode()).hexdigest()[:16]
    return f"{safe}.{shard}"


def _read_record(path: str) -> dict[str, Any] | None:
    """The record at ``path`` when embtables wrote it (a small JSON object with the magic), else None."""
    try:
        if os.path.getsize(path) > 1 << 20:
            return None
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("magic") != MAGIC:
        return None
    files = record.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return None
    if not isinstance(record.get("lock"), str):
        return None
    return record


def _ours(directory: str) -> tuple[set[str], list[str]]:
    """(the names in ``directory`` that embtables wrote, the others)."""
    names = sorted(os.listdir(directory))
    ours: set[str] = set()
    for name in names:
        for suffix in (META, META + ".tmp"):
            if name.endswith(suffix):
                record = _read_record(os.path.join(directory, name))
                if record is not None:
                    ours.add(name)
                    ours.update(os.path.basename(f) for f in record["files"].values())
                    ours.add(os.path.basename(record["lock"]))
    return ours, [n for n in names if n not in ours]


class ShardFiles:
    """The files of one table shard, open and locked: ``tensors[part]`` [rows, dim] views their rows (strided:
    the records of ``layout``).

    Their life: open (constructed), then possibly *torn* (``tear``: a write-back or read failed, or something
    else cut a file short: they no longer hold the table; ``torn`` says why, until a restore writes every row
    and clears it), and finally *closed* (``close``: released; ``check_open`` refuses every later access).

    Args:
      directory: the ``Offload`` directory (created when missing).
      table: the table's name; ``shard``: which shard of it (``w<W>r<rank>``).
      parts: ``{part: dtype}``, "" for the weights and each slot's TF name.
    """

    def __init__(
        self,
        directory: str,
        table: str,
        shard: str,
        rows: int,
        dim: int,
        parts: dict[str, torch.dtype],
        log_rows: int = 0,
    ):
        self.directory = directory
        self.table = table
        self.torn: str | None = None  # why the files no longer hold the table (``tear``)
        self.closed = False  # released (``close``): every access is refused
        self._lock_fd = -1
        self._fd = -1
        self._map: mmap.mmap | None = None
        self.layout = RecordLayout.of(dim, parts)
        self.rows = rows
        # the row file's size: whole chunks (what a merge of the write log reads and writes), rows past N unused
        unit = chunk_bytes(self.layout.nbytes)
        self.nbytes = -(-rows * self.layout.nbytes // unit) * unit
        self.log: WriteLog | None = None  # written-back records, merged into the row file later (``log_rows`` > 0)
        self._io_lock = threading.Lock()
        self.tensors: dict[str, Tensor] = {}
        try:
            os.makedirs(directory, exist_ok=True)
            if not os.path.isdir(directory):
                raise ConfigError(f"table {table!r}: offload directory {directory!r} is not a directory.")
            foreign = _ours(directory)[1]
            for _ in range(100):  # another rank's record being written (its .tmp renamed a moment later)
                if not foreign or not all(n.endswith(META + ".tmp") for n in foreign):
                    break
                time.sleep(0.01)
                foreign = _ours(directory)[1]
        except OSError as exc:
            raise ConfigError(f"table {table!r}: cannot use offload directory {directory!r}: {exc}") from exc
        if foreign:
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            listed = ", ".join(repr(n) for n in foreign[:5]) + more
            raise ConfigError(
                f"table {table!r}: offload directory {directory!r} holds files embtables did not write ({listed}); "
                "embtables never overwrites or deletes them. Give the table an empty directory of its own."
            )
        stem = file_stem(table, shard)
        self.name = f"{stem}.rows"
        self.log_name = f"{stem}.log"
        lock_name = f"{stem}.lock"
        record = {
            "magic": MAGIC,
            "table": table,
            "shard": shard,
            "rows": rows,
            "dim": dim,
            "dtypes": {part: str(dtype).removeprefix("torch.") for part, dtype in parts.items()},
            "files": {"records": self.name, **({"log": self.log_name} if log_rows > 0 else {})},
            "record_bytes": self.layout.nbytes,
            "offsets": self.layout.offsets,
            "lock": lock_name,
        }
        meta = os.path.join(directory, stem + META)
        existing = _read_record(meta) if os.path.exists(meta) else None
        lock = os.path.join(directory, lock_name)  # the name this code gives it, never a name read from a file
        try:
            if existing is not None:
                self._lock(lock)  # the shard's files are another module's until its lock is taken
            # the files an earlier record of this shard listed are embtables' own: those not written again (an
            # older layout's) are removed once the new record no longer lists them
            old = [] if existing is None else [os.path.basename(f) for f in existing["files"].values()]
            self._write_record(meta, record)  # lists the lock before a new one is created
            if existing is None:
                self._lock(lock)
            for name in old:  # only a row file of this shard's own naming: a record is read, not trusted
                ours = name.startswith(stem + ".") and name.endswith((".rows", ".log"))
                if ours and name != self.name and (name != self.log_name or log_rows == 0):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(directory, name))
            self._open_rows(rows)
            if log_rows > 0:
                self._open_log(log_rows)
        except OSError as exc:  # a read-only directory, a file-size limit, a full disk
            self.close()
            raise ConfigError(
                f"table {table!r}: cannot create its working files in its offload directory {directory!r} (the "
                f"Offload(directory=...) where its {rows} rows and their slots live while it trains, "
                f"{self.nbytes + log_rows * self.layout.nbytes} bytes in all): {exc.strerror or exc}"
                + (f" ({os.path.basename(exc.filename)})" if isinstance(exc.filename, str) else "")
                + ". Give the table a writable directory on a disk that allows files of that size (ulimit -f)."
            ) from exc
        except BaseException:
            self.close()
            raise

    def _lock(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"table {self.table!r}: offload directory {self.directory!r} is in use by another module or "
                    f"process ({os.path.basename(path)} is locked). Two trainers cannot share one table's files: give "
                    "each its own directory, or close the other first (DistributedEmbedding.close(); an Estimator's "
                    "est.embedding.close())."
                ) from None
            raise
        self._lock_fd = fd

    @staticmethod
    def _write_record(path: str, record: dict[str, Any]) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _open_rows(self, rows: int) -> None:
        path = os.path.join(self.directory, self.name)
        # A file of an earlier module (listed by this shard's record) is unlinked, never truncated: tensors that
        # still map it (a state_dict kept past its module) keep their pages; a truncated mapping would fault.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fd = fd
        os.ftruncate(fd, self.nbytes)  # sparse: no block is written until a row is
        mapped = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._map = mapped
        with contextlib.suppress(AttributeError, OSError):
            mapped.madvise(mmap.MADV_RANDOM)  # a fault reads its page, not a readahead window beyond the cache
        records = torch.frombuffer(mapped, dtype=torch.uint8, count=rows * self.layout.nbytes)
        self.tensors = self.layout.unpack(records.view(rows, self.layout.nbytes))

    def _open_log(self, capacity: int) -> None:
        path = os.path.join(self.directory, self.log_name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, capacity * self.layout.nbytes)  # sparse, written from its start
        except OSError:
            os.close(fd)
            raise
        self.log = WriteLog(fd, capacity, self.layout.nbytes, self.rows, self._rows)

    def write(self, offset: int, data: bytes | memoryview, wait: bool = True) -> None:
        """Write ``data`` at byte ``offset`` of the row file with ``pwrite`` (a full disk raises
        ``OSError`` here, never a fault inside a kernel later), then write it back and drop it from the page
        cache: a page left there would be mapped by a later fault on a neighbour (fault-around) without the row
        cache counting it. One page a call: a larger write would make one large page-cache folio.
        ``wait=False`` only starts the write-back: the caller ``settle``s the range before any kernel runs (many
        writes then go to the disk together)."""
        fd = self._fd
        view = memoryview(data)
        start, page = offset, mmap.PAGESIZE
        while view.nbytes:
            n = os.pwrite(fd, view[: page - offset % page], offset)
            view, offset = view[n:], offset + n
        if not wait:
            _sync_range(fd, start, offset - start, _SYNC_START)
            return
        _sync_range(fd, start, offset - start)
        os.posix_fadvise(fd, start, offset - start, os.POSIX_FADV_DONTNEED)

    def row_io(self, rows: Tensor, records: Tensor, *, write: bool) -> None:
        """Read the records of local rows ``rows`` [K] (ascending) into ``records`` [K, R] (uint8; ``write``:
        write them from there): written records are appended to the write log (merged into the row file first
        when they would overflow it; a batch larger than the log goes to the row file in place), read ones come
        from the log where a row is in it, else from the row file. An I/O error (a full disk, a file that ends
        early) raises ``OSError``; ``records`` must be a contiguous CPU uint8 [K, R] buffer
        (``layout.empty``/``pack``). Serialized: a read-ahead's reads never see a write or a merge half done."""
        rows = rows.to("cpu", torch.int64).contiguous()
        k = int(rows.numel())
        if k == 0:
            return
        row_bytes = self.layout.nbytes
        if (
            not records.is_contiguous()
            or records.dtype != torch.uint8
            or tuple(records.shape) != (k, row_bytes)
            or records.device.type != "cpu"
        ):
            raise RuntimeError(f"{self.name}: row I/O needs a contiguous CPU uint8 [{k}, {row_bytes}] buffer (a bug)")
        if int(rows.min()) < 0 or int(rows.max()) >= self.rows:
            raise RuntimeError(f"{self.name}: a row outside the file (a bug)")
        with self._io_lock:
            log = self.log
            if write:
                if log is not None and not log.fits(k):
                    self._merge()
                if log is not None and log.fits(k):
                    log.append(rows, records)
                else:
                    self._rows(self._fd, self.nbytes, records, row_bytes, rows, True)
                return
            found, slots = log.find(rows) if log is not None else (torch.zeros(k, dtype=torch.bool), rows[:0])
            if log is None or not bool(found.any()):  # every row in the row file
                self._rows(self._fd, self.nbytes, records, row_bytes, rows, False)
                return
            home = ~found
            if bool(home.any()):
                got = torch.empty((int(home.sum()), row_bytes), dtype=torch.uint8)
                self._rows(self._fd, self.nbytes, got, row_bytes, rows[home], False)
                records[home] = got
            order = torch.argsort(slots)
            logged = torch.empty((int(slots.numel()), row_bytes), dtype=torch.uint8)
            self._rows(log.fd, log.capacity * row_bytes, logged, row_bytes, slots[order], False)
            where = torch.nonzero(found).flatten()
            records[where[order]] = logged

    def compact(self) -> None:
        """Merge the write log into the row file (``WriteLog.merge``): the row file (and its maps) then holds
        every row written back."""
        with self._io_lock:
            self._merge()

    def forget_log(self) -> None:
        """Drop the write log's records: every row was just written into the row file anew (a restore)."""
        with self._io_lock:
            if self.log is not None:
                self.log.clear()

    def _merge(self) -> None:
        log = self.log
        if log is None or log.head == 0:
            return
        log.merge(self._fd, self.nbytes)
        os.fdatasync(self._fd)
        with contextlib.suppress(OSError):
            os.posix_fadvise(log.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the log's records are stale now

    def _rows(self, fd: int, size: int, buffer: Tensor, row_bytes: int, rows: Tensor, write: bool) -> None:
        """Rows ``rows`` [K] (ascending) of ``row_bytes`` of the file ``fd`` of ``size`` bytes read into (or
        written from) ``buffer`` [K, row_bytes]: one native call (every row checked there against the size, up to
        ``IO_DEPTH`` calls in flight), else a Python call a run of consecutive rows."""
        k = int(rows.numel())
        if k == 0:
            return
        if not buffer.is_contiguous() or buffer.numel() != k * row_bytes or buffer.dtype != torch.uint8:
            raise RuntimeError(f"{self.name}: row I/O needs a contiguous uint8 buffer of {k} rows (a bug)")
        rows = rows.to(torch.int64).contiguous()  # what C reads: int64 indices
        lib = native_library.library()
        if lib is not None:
            io_engine()
            err = (ctypes.c_int32 * 2)()
            rc = lib.et_offload_rows(
                fd, size, buffer.data_ptr(), row_bytes, rows.data_ptr(), k,
                1 if write else 2 if DROP_AFTER_READ else 0, IO_DEPTH, err,
            )  # fmt: skip
            status = native_abi.decode("et_offload_rows", rc)
            if status == "ok":
                return
            if status == "io_error":
                raise OSError(err[0], os.strerror(err[0]))
            raise RuntimeError(f"{self.name}: a row outside the file, or a bad row buffer (a bug)")
        if bool((rows < 0).any()) or bool((rows >= size // row_bytes).any()):
            raise RuntimeError(f"{self.name}: a row outside the file (a bug)")
        flat = buffer.reshape(-1).numpy().data
        ids = rows.tolist()
        i = 0
        while i < k:
            j = i + 1
            while j < k and ids[j] == ids[j - 1] + 1:
                j += 1
            view, offset = flat[i * row_bytes : j * row_bytes], ids[i] * row_bytes
            while view.nbytes:
                if write:
                    n = os.pwrite(fd, view, offset)
                else:
                    n = os.preadv(fd, [view], offset)
                    if n == 0:
                        raise OSError(errno.EIO, f"{self.name} ends at byte {offset}")
                view, offset = view[n:], offset + n
            i = j

    def read_into(self, offset: int, out: Tensor) -> None:
        """Fill ``out`` (a contiguous CPU tensor) with the row file's bytes from ``offset`` on, read with ``pread``
        (through the page cache, not the maps: nothing is mapped), then drop them from the page cache where clean.
        A file ending early raises ``OSError`` (EIO)."""
        view = out.view(torch.uint8).reshape(-1).numpy().data.cast("B")
        length, at = view.nbytes, offset
        while view.nbytes:
            n = os.preadv(self._fd, [view], at)
            if n == 0:
                raise OSError(errno.EIO, f"{self.name} ends at byte {at}, before {offset + length}")
            view, at = view[n:], at + n
        os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def drop(self, offset: int, length: int, *, dirty: bool, unmap_only: bool = False) -> None:
        """Drop bytes [offset, offset + length) of the row file (page-aligned) from the process and the page
        cache, writing them back first (``msync``) when ``dirty``. ``unmap_only``: out of the process only
        (written pages stay in the page cache, where the kernel writes them back; another part's writes to the
        same records find them there)."""
        mapped = self._map
        if mapped is None:
            return
        length = min(length, len(mapped) - offset)  # the kernel rounds the file's last page up itself
        if length <= 0:
            return
        if unmap_only:
            mapped.madvise(mmap.MADV_DONTNEED, offset, length)  # a shared map's written pages stay dirty
            return
        if dirty:
            mapped.flush(offset, length)  # msync: an I/O error raises OSError
        mapped.madvise(mmap.MADV_DONTNEED, offset, length)
        os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def settle(self, offset: int, length: int) -> None:
        """Wait for the write-back ``write(wait=False)`` started (an I/O error raises ``OSError``), then drop
        the pages from the page cache."""
        length = min(length, self.nbytes - offset)
        if length > 0:
            _sync_range(self._fd, offset, length)
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def short_files(self) -> list[str]:
        """The files shorter now than embtables made them (truncated by something else), each as
        ``"<name>: N bytes of M"``: touching their maps past the end would kill the process (SIGBUS)."""
        if self._fd < 0:
            return []
        size = os.fstat(self._fd).st_size
        out = [f"{self.name}: {size} bytes of {self.nbytes}"] if size < self.nbytes else []
        if self.log is not None:
            want = self.log.capacity * self.layout.nbytes
            if (got := os.fstat(self.log.fd).st_size) < want:
                out.append(f"{self.log_name}: {got} bytes of {want}")
        return out

    def allocate(self) -> None:
        """Give every file its disk blocks, whole (``posix_fallocate``; a file cut short is grown back to its size,
        the bytes past the cut reading as zeros): what a restore or a full load writes through the maps next. A
        store through a shared map into a hole of a sparse file needs a block, and a full disk would answer it
        with SIGBUS; reserved here, a full disk is an ``OSError`` before any byte changes. On failure each file is
        left at the size it had."""
        fd = self._fd
        size = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            raise

    def tear(self, why: str, cause: BaseException | None = None) -> NoReturn:
        """The files no longer hold the table (``why``): every lookup is refused until a restore; raises."""
        self.torn = why
        raise TornFilesError(
            f"table {self.table!r}: {why}, in its files under {self.directory!r}. The table's working files are "
            "now torn: every lookup is refused until restore() of a checkpoint or load_state_dict() of the whole "
            "state; the last checkpoint is untouched."
        ) from cause

    def check_open(self) -> None:
        """Raise when the files were released (``close``): nothing may read or write through them."""
        if self.closed:
            raise ClosedFilesError(
                f"table {self.table!r}: the module was closed (close()): its offloaded files under "
                f"{self.directory!r} were released, and it no longer reads or writes them. Build a new module "
                "(on that directory or another) and restore() a checkpoint; save before close() to keep a table."
            )

    def close(self) -> None:
        """Close the files and release the lock (``closed``). The maps are never closed here: a tensor over one
        (torch holds a reference, not a buffer export) would read unmapped memory; each is unmapped with its
        last tensor."""
        self.closed = True
        self.tensors = {}
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        if self.log is not None:
            with contextlib.suppress(OSError):
                os.close(self.log.fd)
            self.log = None
        self._map, self._fd = None, -1
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def __del__(self) -> None:
        self.close()
