"""Restore a rank's rows in two streaming passes, all or nothing, with bounded extra memory.

Pass 1 (``verify``) reads every block this rank needs in pieces of about 4 MiB, checks each block's
CRC-32, the row ids (inside [0, V), ascending) and that every row of the rank's shard is in some file,
and records a CRC-32 per piece; nothing is written. The ranks then agree. Pass 2 (``write``) reads the
same pieces again from the same open files, checks each piece's CRC-32 against pass 1 before using it,
and copies its rows into place. Extra memory is a few pieces and one flag per local row, not a copy of
the state.

A file replaced or deleted between the passes does not matter: both passes read the file descriptors
opened by pass 1. A file modified in place between the passes is refused before anything is written
(its size or modification time changed). One modified while pass 2 runs is caught by the piece CRCs:
the error then says that the tables were partly written (``TornRestore``), and the module refuses to
train or save until a restore succeeds.
"""

from __future__ import annotations

import os
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


class TornRestore(CheckpointError):
    """A checkpoint file changed while its rows were being copied in: the tables are partly restored."""


class _RankFile:
    """One rank file, open for both passes: its identity (size, mtime) and its pieces' CRC-32s."""

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
        self.crcs: dict[int, int] = {}  # piece offset -> CRC-32 (pass 1)

    def _identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)  # not ctime: a rename over the file changes it, not the bytes read
        return st.st_size, st.st_mtime_ns

    def unchanged(self) -> bool:
        return self._identity() == self.identity

    def read(self, offset: int, out: np.ndarray[Any, Any], record: bool) -> None:
        """Fill ``out`` with the bytes at ``offset``; pass 1 (``record``) keeps their CRC-32, pass 2 checks it."""
        view = out.data.cast("B")
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{self.path}: ends inside a block (truncated while being read).")
            got += n
        crc = zlib.crc32(view)
        if record:
            self.crcs[offset] = crc
        elif self.crcs.get(offset) != crc:
            raise TornRestore(
                f"{self.path}: changed while its rows were being copied in (a piece read twice differs). The tables "
                "and slots of this module are now partly restored: restore again from an intact checkpoint before "
                "training or saving (the module refuses both until then)."
            )

    def close(self) -> None:
        os.close(self.fd)


def _pieces(block: Block, piece_rows: int) -> Iterator[tuple[int, int]]:
    """Row ranges [r0, r1) of ``block`` of ``piece_rows`` rows (the same for a table's every block)."""
    for r0 in range(0, block.shape[0], piece_rows):
        yield r0, min(block.shape[0], r0 + piece_rows)


class _Plan:
    """What pass 1 found for one (file, table): the file and the table's blocks, and whether any of
    this rank's rows are in it."""

    def __init__(self, file: _RankFile, table: ResolvedTable, blocks: TableBlocks) -> None:
        self.file, self.table, self.blocks, self.hits = file, table, blocks, 0


def _rows_piece(plan: _Plan, r0: int, r1: int, record: bool, crc: int, last: int) -> tuple[np.ndarray[Any, Any], int]:
    """Row ids [r0, r1) of the plan's rows block, checked; returns them and the running block CRC."""
    rows = np.empty(r1 - r0, dtype=np.int64)
    plan.file.read(plan.blocks.rows.offset + 8 * r0, rows, record)
    v = plan.table.vocabulary_size
    if rows.size and (int(rows[0]) <= last or int(rows[-1]) >= v or (rows.size > 1 and not (np.diff(rows) > 0).all())):
        raise CheckpointError(
            f"{plan.file.path}: the row ids of table {plan.table.name!r} are not ascending ids in [0, {v}) (the file "
            "is corrupt or was not written by embtables)."
        )
    return rows, zlib.crc32(rows.data.cast("B"), crc)


def _hits(mine: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Positions in ``mine`` (ascending) of the ``rows`` it holds, and those rows' positions in ``rows``."""
    if mine.size == 0 or rows.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    pos = np.searchsorted(mine, rows)
    ok = (pos < mine.size) & (mine[np.minimum(pos, mine.size - 1)] == rows)
    return pos[ok], np.flatnonzero(ok)


def _piece_rows(dim: int) -> int:
    return max(1, _PIECE // (4 * dim))


def verify(
    where: Path,
    manifest: dict[str, Any],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    files: dict[str, _RankFile],
    progress: Callable[[int], None],
) -> list[_Plan]:
    """Pass 1: check every block this rank needs and that its shards are covered; write nothing."""
    plans = []
    for t in resolved.tables:
        mine = _ascending_rows(shards[t.name])
        filled = np.zeros(mine.size, dtype=bool)
        for entry in manifest["checked_files"]:
            plan = _Plan(files[entry["file"]], t, entry["blocks"][t.name])
            crc, last = 0, -1
            for r0, r1 in _pieces(plan.blocks.rows, _piece_rows(t.dim)):
                rows, crc = _rows_piece(plan, r0, r1, True, crc, last)
                last = int(rows[-1])
                dst, _ = _hits(mine, rows)
                filled[dst] = True
                plan.hits += dst.size
            if crc != plan.blocks.rows.crc32:
                raise CheckpointError(f"{plan.file.path}: the block of '{t.name}#rows' fails its CRC-32 check.")
            if plan.hits == 0:
                continue
            for key, block in plan.blocks.state.items():
                crc = 0
                for r0, r1 in _pieces(block, _piece_rows(t.dim)):
                    piece = np.empty((r1 - r0, t.dim), dtype=np.float32)
                    plan.file.read(block.offset + 4 * t.dim * r0, piece, True)
                    crc = zlib.crc32(piece.data.cast("B"), crc)
                    progress(piece.nbytes)
                if crc != block.crc32:
                    raise CheckpointError(f"{plan.file.path}: the block of {key!r} fails its CRC-32 check (corrupt).")
            plans.append(plan)
        if not filled.all():
            missing = mine[~filled][:5].tolist()
            raise CheckpointError(f"{where}: table {t.name!r}: rows {missing} are in no file of the checkpoint.")
    return plans


def unchanged(files: dict[str, _RankFile]) -> None:
    """Between the passes: refuse (before writing) a file modified in place since pass 1."""
    for f in files.values():
        if not f.unchanged():
            raise CheckpointError(f"{f.path}: modified while the checkpoint was being restored; nothing was restored.")


def write(plans: list[_Plan], shards: dict[str, LocalShard], progress: Callable[[int], None]) -> None:
    """Pass 2: read the pieces again (each checked against pass 1) and copy this rank's rows into place."""
    with torch.no_grad():
        for plan in plans:
            t = plan.table
            shard = shards[t.name]
            mine = _ascending_rows(shard)
            slots = {f"{t.name}/{slot}" if slot else t.name: target for slot, target in shard.tensors.items()}
            crc, last = 0, -1
            for r0, r1 in _pieces(plan.blocks.rows, _piece_rows(t.dim)):
                rows, crc = _rows_piece(plan, r0, r1, False, crc, last)
                last = int(rows[-1])
                dst, src = _hits(mine, rows)
                if dst.size == 0:
                    continue
                contiguous = dst.size == r1 - r0 and int(dst[-1]) - int(dst[0]) == dst.size - 1
                for key, block in plan.blocks.state.items():
                    piece = np.empty((r1 - r0, t.dim), dtype=np.float32)
                    plan.file.read(block.offset + 4 * t.dim * r0, piece, False)
                    target = slots[key]
                    values = torch.from_numpy(piece)
                    if contiguous:
                        d0 = int(dst[0])
                        target[d0 : d0 + dst.size].copy_(values)
                    else:
                        index = torch.from_numpy(dst).to(target.device)
                        target.index_copy_(0, index, values[torch.from_numpy(src)].to(target.device))
                    progress(piece.nbytes)


def _ascending_rows(shard: LocalShard) -> np.ndarray[Any, Any]:
    mine = shard.rows.detach().to("cpu", torch.int64).numpy()
    if mine.size > 1 and not bool((np.diff(mine) > 0).all()):
        raise RuntimeError(f"table {shard.table!r}: this rank's rows are not ascending (a bug in the sharding plan).")
    return mine


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
