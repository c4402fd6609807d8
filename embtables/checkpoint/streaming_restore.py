"""Restore a rank's rows in two streaming passes, all or nothing, with bounded extra memory.

Pass 1 (``verify``) reads every block this rank needs in pieces of about 4 MiB, checks each block's
CRC-32, the row ids (inside [0, V), ascending) and that every row of the rank's shard is in some file;
nothing is written. The ranks then agree, and every file must still have the size and modification
time pass 1 saw. Pass 2 (``write``) reads the same blocks again from the same open files, copies this
rank's rows into place and checks each block's CRC-32 once more over the bytes it copied. Extra memory
is a few pieces per thread and one flag per local row, not a copy of the state. Blocks are independent
tasks, run on two threads (reads and CRC-32 release the GIL), or in the calling thread when a pass reads less
than one piece in all (a small model: the threads' start and join cost more than its reads).

A file replaced or deleted between the passes does not matter: both passes read the file descriptors
opened by pass 1. A file modified in place between the passes is refused before anything is written.
One modified while pass 2 runs fails pass 2's CRC-32: the error then says that the tables were partly
written (``TornRestore``), and the module refuses to train or save until a restore succeeds.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.manifest import Block, TableBlocks
from embtables.config import ResolvedConfig, ResolvedTable
from embtables.tables.state import LocalShard

_PIECE = 4 << 20  # bytes of one slot block read per piece
_THREADS = 2


class TornRestore(CheckpointError):
    """A checkpoint file changed while its rows were being copied in: the tables are partly restored."""


def _torn(path: Path, what: str) -> TornRestore:
    return TornRestore(
        f"{path}: the block of {what!r} changed while its rows were being copied in (its CRC-32 differs from the "
        "first pass). The tables and slots of this module are now partly restored: restore again from an intact "
        "checkpoint before training or saving (the module refuses both until then)."
    )


class _RankFile:
    """One rank file, open for both passes, with the identity (size, mtime) pass 1 saw."""

    def __init__(self, path: Path, expected_bytes: int) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be opened ({exc}).") from exc
        self.identity = self._identity()
        if self.identity[0] != expected_bytes:
            os.close(self.fd)
            raise CheckpointError(f"{path}: {self.identity[0]} bytes, the manifest says {expected_bytes} (truncated?).")

    def _identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)  # not ctime: a rename over the file changes it, not the bytes read
        return st.st_size, st.st_mtime_ns

    def unchanged(self) -> bool:
        return self._identity() == self.identity

    def read(self, offset: int, out: np.ndarray[Any, Any], crc: int) -> int:
        """Fill ``out`` with the bytes at ``offset``; returns the running CRC-32 ``crc`` over them."""
        view = out.data.cast("B")
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{self.path}: ends inside a block (truncated while being read).")
            got += n
        return zlib.crc32(view, crc)

    def close(self) -> None:
        os.close(self.fd)


class _Plan:
    """One (file, table) with rows of this rank: the file, the table, its blocks."""

    def __init__(self, file: _RankFile, table: ResolvedTable, blocks: TableBlocks) -> None:
        self.file, self.table, self.blocks = file, table, blocks


def _pieces(block: Block, dim: int) -> Iterator[tuple[int, int]]:
    """Row ranges [r0, r1) of about 4 MiB of float32 rows of width ``dim`` (the same for every block of a table)."""
    step = max(1, _PIECE // (4 * dim))
    for r0 in range(0, block.shape[0], step):
        yield r0, min(block.shape[0], r0 + step)


def _rows(plan: _Plan, r0: int, r1: int, crc: int, last: int) -> tuple[np.ndarray[Any, Any], int]:
    """Row ids [r0, r1) of the plan's rows block, checked (ascending, in [0, V)), and the running CRC."""
    rows = np.empty(r1 - r0, dtype=np.int64)
    crc = plan.file.read(plan.blocks.rows.offset + 8 * r0, rows, crc)
    v = plan.table.vocabulary_size
    if rows.size and (int(rows[0]) <= last or int(rows[-1]) >= v or (rows.size > 1 and not (np.diff(rows) > 0).all())):
        raise CheckpointError(
            f"{plan.file.path}: the row ids of table {plan.table.name!r} are not ascending ids in [0, {v}) (the file "
            "is corrupt or was not written by embtables)."
        )
    return rows, crc


def _hits(mine: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Positions in ``mine`` (ascending) of the ``rows`` it holds, and those rows' positions in ``rows``."""
    if mine.size == 0 or rows.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    pos = np.searchsorted(mine, rows)
    ok = (pos < mine.size) & (mine[np.minimum(pos, mine.size - 1)] == rows)
    return pos[ok], np.flatnonzero(ok)


def _ascending_rows(shard: LocalShard) -> np.ndarray[Any, Any]:
    mine = shard.rows.detach().to("cpu", torch.int64).numpy()
    if mine.size > 1 and not bool((np.diff(mine) > 0).all()):
        raise RuntimeError(f"table {shard.table!r}: this rank's rows are not ascending (a bug in the sharding plan).")
    return mine


def _locked(progress: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            progress(n)

    return tick


def _run_all(tasks: list[Callable[[], None]], nbytes: int) -> None:
    """Run the tasks, which read ``nbytes`` bytes in all: on two threads, or in this one when that is under
    one piece (starting and joining the threads would cost more than the reads). The first error (in task
    order) is raised after all have ended."""
    if nbytes < _PIECE or len(tasks) < 2:
        errors: list[BaseException] = []
        for task in tasks:
            try:
                task()
            except Exception as exc:  # raised below, after every task ran, as the pool does
                errors.append(exc)
        if errors:
            raise errors[0]
        return
    with concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="embtables-restore") as pool:
        futures = [pool.submit(task) for task in tasks]
    for f in futures:
        f.result()


def verify(
    where: Path,
    manifest: dict[str, Any],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    files: dict[str, _RankFile],
    progress: Callable[[int], None],
    *,
    partial: bool = False,
) -> list[_Plan]:
    """Pass 1: check every block this rank needs and that its shards are covered (``partial``: an increment,
    whose files hold some rows only); write nothing."""
    plans, tasks, tick, nbytes = [], [], _locked(progress), 0
    for t in resolved.tables:
        mine = _ascending_rows(shards[t.name])
        filled = np.zeros(mine.size, dtype=bool)
        for entry in manifest["checked_files"]:
            plan = _Plan(files[entry["file"]], t, entry["blocks"][t.name])
            crc, last, hits = 0, -1, 0
            for r0, r1 in _pieces(plan.blocks.rows, t.dim):
                rows, crc = _rows(plan, r0, r1, crc, last)
                last = int(rows[-1])
                dst, _ = _hits(mine, rows)
                filled[dst] = True
                hits += dst.size
            if crc != plan.blocks.rows.crc32:
                raise CheckpointError(f"{plan.file.path}: the block of '{t.name}#rows' fails its CRC-32 check.")
            if hits:
                plans.append(plan)
                tensors = shards[t.name].tensors
                targets = {f"{t.name}/{slot}" if slot else t.name: x.dtype for slot, x in tensors.items()}
                tasks += [
                    _check_block(plan, key, block, tick, targets.get(key)) for key, block in plan.blocks.state.items()
                ]
                nbytes += sum(block.nbytes for block in plan.blocks.state.values())
        if not partial and not filled.all():
            missing = mine[~filled][:5].tolist()
            raise CheckpointError(f"{where}: table {t.name!r}: rows {missing} are in no file of the checkpoint.")
    _run_all(tasks, nbytes)
    return plans


def _piece(block: Block, dim: int) -> np.ndarray[Any, Any]:
    """A buffer for one piece (``_pieces``) of a state block's elements as stored: float32, or 16-bit patterns."""
    return np.empty((max(1, _PIECE // (4 * dim)), dim), dtype=np.float32 if block.itemsize == 4 else np.int16)


def _values(piece: np.ndarray[Any, Any], block: Block) -> torch.Tensor:
    """A piece of a state block's elements as a tensor of their stored type (float32, bfloat16 or float16)."""
    values = torch.from_numpy(piece)
    return values if block.itemsize == 4 else values.view(_HALF[block.stored])


_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_block(
    plan: _Plan, key: str, block: Block, tick: Callable[[int], None], target: torch.dtype | None = None
) -> Callable[[], None]:
    """Pass 1 of one state block: its CRC-32, and (``target``: the storage type it restores into) that no
    value finite in the block overflows that type as it is converted (a float32 or bfloat16 value beyond
    float16's 65504 would be stored as Inf)."""

    def run() -> None:
        dim, crc, size = plan.table.dim, 0, block.itemsize
        piece = _piece(block, dim)
        narrower = target == torch.float16 and block.stored != "float16"
        for r0, r1 in _pieces(block, dim):
            crc = plan.file.read(block.offset + size * dim * r0, piece[: r1 - r0], crc)
            if narrower:
                refuse_float16_overflow(plan.file.path, plan.table.name, key, _values(piece[: r1 - r0], block), r0)
            tick((r1 - r0) * dim * size)
        if crc != block.crc32:
            raise CheckpointError(f"{plan.file.path}: the block of {key!r} fails its CRC-32 check (corrupt file).")

    return run


def refuse_float16_overflow(
    where: object, table: str, key: str, values: torch.Tensor, first_row: int | None = None
) -> None:
    """Raise ``CheckpointError`` when a finite value of ``values`` [R, D] (checkpoint values bound for a float16
    table; ``first_row``: the block row of ``values[0]``, when they are a piece of a block) becomes Inf in
    float16."""
    over = torch.isfinite(values) & ~torch.isfinite(values.to(torch.float16))
    if bool(over.any()):
        at = int(torch.nonzero(over)[0][0])
        value = float(values.reshape(-1, values.shape[-1])[at][over[at]][0])
        row = "" if first_row is None else f" (the block's row {first_row + at})"
        raise CheckpointError(
            f"{where}: table {table!r}: {key!r} holds {value:g}{row}, beyond float16's largest value (65504): "
            "restored into this float16 table it would be stored as Inf; nothing was restored. Restore into a "
            "float32 or bfloat16 table, or scale the values first."
        )


def unchanged(files: dict[str, _RankFile]) -> None:
    """Between the passes: refuse (before writing) a file modified in place since pass 1."""
    for f in files.values():
        if not f.unchanged():
            raise CheckpointError(f"{f.path}: modified while the checkpoint was being restored; nothing was restored.")


def write(plans: list[_Plan], shards: dict[str, LocalShard], progress: Callable[[int], None]) -> None:
    """Pass 2: read the blocks again and copy this rank's rows into place; ``TornRestore`` when a block's
    bytes are not the ones pass 1 checked."""
    tick, tasks, nbytes = _locked(progress), [], 0
    mine_of: dict[str, np.ndarray[Any, Any]] = {}  # each table's rows, once (a table has a plan per file)
    for plan in plans:
        shard = shards[plan.table.name]
        mine = mine_of.get(plan.table.name)
        if mine is None:
            mine = mine_of[plan.table.name] = _ascending_rows(shard)
        for slot, target in shard.tensors.items():
            key = f"{plan.table.name}/{slot}" if slot else plan.table.name
            # an offloaded table's rows are written back and dropped piece by piece (memory: a piece)
            written = None if shard.offloaded is None else functools.partial(shard.offloaded.written, slot)
            tasks.append(_copy_block(plan, key, mine, target, tick, written))
            nbytes += plan.blocks.state[key].nbytes + plan.blocks.rows.nbytes
    with torch.no_grad():
        _run_all(tasks, nbytes)


def _copy_block(
    plan: _Plan,
    key: str,
    mine: np.ndarray[Any, Any],
    target: torch.Tensor,
    tick: Callable[[int], None],
    written: Callable[[int, int], None] | None = None,
) -> Callable[[], None]:
    def run() -> None:
        block, dim = plan.blocks.state[key], plan.table.dim
        crc, rows_crc, last, size = 0, 0, -1, block.itemsize
        piece = _piece(block, dim)
        for r0, r1 in _pieces(block, dim):
            rows, rows_crc = _rows(plan, r0, r1, rows_crc, last)
            last = int(rows[-1])
            dst, src = _hits(mine, rows)
            if dst.size == 0:  # still read: the block's CRC-32 covers every piece
                crc = plan.file.read(block.offset + size * dim * r0, piece[: r1 - r0], crc)
                continue
            raw = piece[: r1 - r0]
            crc = plan.file.read(block.offset + size * dim * r0, raw, crc)
            values = _values(raw, block)  # converted into the table's storage type as it is copied
            if dst.size == r1 - r0 and int(dst[-1]) - int(dst[0]) == dst.size - 1:  # the writer's own layout
                target[int(dst[0]) : int(dst[0]) + dst.size].copy_(values)
            else:
                index = torch.from_numpy(dst).to(target.device)
                target.index_copy_(0, index, values[torch.from_numpy(src)].to(target.device, target.dtype))
            if written is not None:
                written(int(dst.min()), int(dst.max()) + 1)
            tick(dst.size * dim * size)
        if crc != block.crc32 or rows_crc != plan.blocks.rows.crc32:
            raise _torn(plan.file.path, key)

    return run


def open_files(where: Path, manifest: dict[str, Any]) -> dict[str, _RankFile]:
    """Every rank file of a checked manifest, opened for both passes (sizes checked)."""
    files: dict[str, _RankFile] = {}
    try:
        for entry in manifest["checked_files"]:
            files[entry["file"]] = _RankFile(where / entry["file"], entry["bytes"])
    except BaseException:
        close(files)
        raise
    return files


def close(files: dict[str, _RankFile]) -> None:
    for f in files.values():
        f.close()
