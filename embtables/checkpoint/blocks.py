"""The blocks of a checkpoint's rank files: what a save writes, and the checked readers a restore, an export and a
serving delta read them with.

A save writes every block through one interface, ``Block``: its shape and element type (for the safetensors
header and the manifest) and ``pieces(chunk_bytes)``, the block's bytes in order a piece of about ``chunk_bytes``
at a time, so that no block, however large, is ever copied whole into memory. ``write_block`` is the one
chunk-and-checksum loop. The sources:

- ``ArrayBlock``: an array in memory (row ids, a float32 table's rows, a dynamic table's keys, stale rows);
- ``RowSelection``: chosen rows of a tensor (an increment's changed rows, a half-precision table's rows), gathered
  a piece at a time, in the tensor's storage type;
- ``OffloadedBlock``: an offloaded table's rows, read from its files with ``pread`` a piece at a time (rows never
  read: their initial values, computed, not written). The state blocks of one table shard are an
  ``OffloadedGroup``, consecutive in the rank file and written together: each piece of records (a row's weights
  and slots side by side) is read once for all of them.

Readers: ``open_rank_files`` (every file of a checked manifest, its size checked, memory-mapped),
``read_block`` (a block inside its file with its CRC-32 checked, half values widened to float32) and ``row_ids``
(a block of row ids in range, ascending).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.manifest import Block as BlockSpec
from embtables.tables.offload_cache import OffloadedRows

CHUNK = 64 << 20  # bytes written (and checksummed) per call: bounded extra memory
# bytes of an offloaded table's records read at once (all of its blocks' pieces): as large as a chunk, so that the
# C library maps each piece afresh and returns it at once (a smaller one stays in its heap)
_RECORD_PIECE = CHUNK


class Block(Protocol):
    """One block of a rank file as a save writes it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def size(self) -> int:  # elements
        ...

    @property
    def itemsize(self) -> int:  # bytes an element, as stored
        ...

    @property
    def dtype(self) -> np.dtype[Any]:  # int64 (row ids, keys) or float32 (values: what a reader gets back)
        ...

    @property
    def ndim(self) -> int: ...

    @property
    def stored(self) -> str:  # float32, bfloat16 or float16 for values; int64 for ids
        ...

    def pieces(self, chunk_bytes: int) -> Iterator[np.ndarray[Any, Any]]:
        """The block's bytes in order, as arrays of about ``chunk_bytes`` each."""
        ...


def write_block(f: Any, block: Block, progress: Callable[[int], None]) -> int:
    """Write ``block`` to ``f`` a piece at a time; returns the CRC-32 of its bytes. The blocks of an
    ``OffloadedGroup`` are all written at the first one's turn; the others return their CRC-32."""
    if isinstance(block, OffloadedBlock):
        if block.group.crcs is None:
            block.group.write(f, progress)
        assert block.group.crcs is not None
        return block.group.crcs[block.part]
    crc = zlib.crc32(b"")
    for piece in block.pieces(CHUNK):
        data = np.ascontiguousarray(piece).data.cast("B")
        f.write(data)
        crc = zlib.crc32(data, crc)
        progress(len(data))
    return crc


class ArrayBlock:
    """An array in memory as a block (its own type: int64 ids, float32 values)."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array
        self.shape, self.size, self.itemsize = tuple(array.shape), int(array.size), array.itemsize
        self.dtype, self.ndim = array.dtype, array.ndim
        self.stored = "int64" if array.dtype == np.int64 else "float32"

    def pieces(self, chunk_bytes: int) -> Iterator[np.ndarray[Any, Any]]:
        flat = np.ascontiguousarray(self.array).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, chunk_bytes):
            yield flat[start : start + chunk_bytes]


class RowSelection:
    """The rows ``pick`` [R] (local, ascending; None: every row) of ``tensor`` [N, D] in the tensor's storage type
    (float32, or bfloat16 / float16 for a half-precision table), gathered a piece at a time as it is written (no
    copy of the selection in memory: an increment's changed rows, a half-precision table's rows)."""

    def __init__(self, tensor: torch.Tensor, pick: torch.Tensor | None, dim: int) -> None:
        self.tensor, self.dim = tensor.detach().reshape(-1, dim), dim
        self.pick = None if pick is None else pick.to(tensor.device)
        self.shape = (int(self.tensor.shape[0] if self.pick is None else self.pick.numel()), dim)
        self.size = self.shape[0] * dim
        half = tensor.dtype in (torch.bfloat16, torch.float16)
        self.stored = str(tensor.dtype).removeprefix("torch.") if half else "float32"
        self.itemsize = 2 if half else 4
        self.dtype = np.dtype(np.float32)  # a state block (its values are float32 when read)
        self.ndim = 2

    def pieces(self, chunk_bytes: int) -> Iterator[np.ndarray[Any, Any]]:
        rows = max(1, chunk_bytes // (self.itemsize * max(1, self.dim)))
        for start in range(0, self.shape[0], rows):
            part = (
                self.tensor[start : start + rows] if self.pick is None else self.tensor[self.pick[start : start + rows]]
            )
            yield (part.to("cpu").view(torch.int16) if self.itemsize == 2 else part.to("cpu", torch.float32)).numpy()


class OffloadedBlock:
    """Rows [0, ``rows``) of ``part`` ("" or a slot name) of an offloaded table shard, in their storage type, read
    from the table's files a piece at a time: a save streams file to file in the memory of one piece. ``group``:
    the table's ``OffloadedGroup`` (``OffloadedGroup.block`` makes it), which writes it with its siblings;
    ``pieces`` reads it alone."""

    def __init__(self, source: OffloadedRows, part: str, rows: int, group: OffloadedGroup) -> None:
        self.source, self.part, self.group = source, part, group
        self.shape = (rows, source.dim)
        self.size = rows * source.dim
        stored = source.dtypes[part]
        self.stored = str(stored).removeprefix("torch.")  # float32, bfloat16 or float16
        self.itemsize = stored.itemsize
        self.dtype = np.dtype(np.float32)  # a state block (its values are float32 when read)
        self.ndim = 2

    def pieces(self, chunk_bytes: int) -> Iterator[np.ndarray[Any, Any]]:
        layout = self.source.files.layout
        step = max(1, chunk_bytes // layout.nbytes)
        for lo in range(0, self.shape[0], step):
            rows = layout.view(self.source.read_records(lo, min(self.shape[0], lo + step)), self.part)
            yield (rows.view(torch.int16) if self.itemsize == 2 else rows).numpy()


class OffloadedGroup:
    """The state blocks of one offloaded table shard in a save (``block`` adds them, in file order: they must be
    consecutive in the rank file), written together at the first one's turn: each piece of records is read once
    (``OffloadedRows.read_records``) and each block's part of it written at its place with ``pwrite``, every
    block's CRC-32 carried piece by piece. Its memory is a piece of records (64 MB) and one block's part of it."""

    def __init__(self, source: OffloadedRows, rows: int) -> None:
        self.source, self.rows = source, rows
        self.blocks: list[OffloadedBlock] = []
        self.crcs: dict[str, int] | None = None  # by part, once written

    def block(self, part: str) -> OffloadedBlock:
        out = OffloadedBlock(self.source, part, self.rows, self)
        self.blocks.append(out)
        return out

    def write(self, f: Any, progress: Callable[[int], None]) -> None:
        """Write every block from ``f``'s position on (they follow one another), then leave ``f`` after them."""
        f.flush()
        fd, start = f.fileno(), f.tell()
        starts = [start + sum(b.size * b.itemsize for b in self.blocks[:i]) for i in range(len(self.blocks))]
        crcs = [zlib.crc32(b"")] * len(self.blocks)
        layout = self.source.files.layout
        step = max(1, _RECORD_PIECE // layout.nbytes)
        for lo in range(0, self.rows, step):
            records = self.source.read_records(lo, min(self.rows, lo + step))
            for i, b in enumerate(self.blocks):
                values = layout.view(records, b.part)
                data = np.ascontiguousarray(values.view(torch.uint8).numpy()).data.cast("B")
                at = starts[i] + lo * b.itemsize * b.source.dim
                while data.nbytes:
                    n = os.pwrite(fd, data, at)
                    crcs[i] = zlib.crc32(data[:n], crcs[i])
                    data, at = data[n:], at + n
                progress(values.numel() * b.itemsize)
        f.seek(starts[-1] + self.blocks[-1].size * self.blocks[-1].itemsize)
        self.crcs = {b.part: crc for b, crc in zip(self.blocks, crcs)}


def open_rank_files(where: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Every rank file of a checked manifest, memory-mapped read-only, after checking its size against
    the manifest (``{file name: uint8 map}``); ``CheckpointError`` for a missing or resized file."""
    maps: dict[str, np.ndarray[Any, Any]] = {}
    for entry in manifest["checked_files"]:
        file = where / entry["file"]
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{file}: missing ({exc}).") from exc
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['bytes']} (truncated or corrupt).")
        maps[entry["file"]] = np.memmap(file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return maps


def read_block(mm: np.ndarray[Any, Any], spec: BlockSpec, file: Path, what: str) -> np.ndarray[Any, Any]:
    """A block of ``mm`` as an array, after checking that it lies inside the file and its CRC-32."""
    start, nbytes = spec.offset, spec.nbytes
    if start + nbytes > mm.size:
        raise CheckpointError(f"{file}: the block of {what!r} lies outside the file (truncated or corrupt).")
    raw = mm[start : start + nbytes]
    if zlib.crc32(np.ascontiguousarray(raw).data) != spec.crc32:
        raise CheckpointError(f"{file}: the block of {what!r} fails its CRC-32 check (the file is corrupt).")
    if spec.dtype is np.float32 and spec.stored == "float16":  # half values, widened to float32 (exact)
        return np.frombuffer(raw, dtype="<f2", count=spec.count).astype(np.float32).reshape(spec.shape)
    if spec.dtype is np.float32 and spec.stored == "bfloat16":  # float32's upper 16 bits
        bits: np.ndarray[Any, Any] = np.frombuffer(raw, dtype="<u2", count=spec.count).astype(np.uint32)
        widened: np.ndarray[Any, Any] = np.left_shift(bits, np.uint32(16)).view(np.float32)
        return widened.reshape(spec.shape)
    return np.frombuffer(raw, dtype=spec.dtype, count=spec.count).reshape(spec.shape)


def row_ids(
    mm: np.ndarray[Any, Any], block: BlockSpec, file: Path, table: str, vocabulary_size: int, ascending: bool = True
) -> np.ndarray[Any, Any]:
    """A block of global row ids, checked: CRC-32, inside [0, V), and (``ascending``) strictly increasing."""
    rows = read_block(mm, block, file, f"{table}#rows")
    bad_order = ascending and rows.size > 1 and not bool((np.diff(rows) > 0).all())
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= vocabulary_size or bad_order):
        raise CheckpointError(
            f"{file}: the row ids of table {table!r} are not {'ascending ' if ascending else ''}ids in "
            f"[0, {vocabulary_size}) (the file is corrupt or was not written by embtables)."
        )
    return rows


__all__ = [
    "CHUNK", "ArrayBlock", "Block", "OffloadedBlock", "RowSelection", "open_rank_files", "read_block", "row_ids",
    "write_block",
]  # fmt: skip
