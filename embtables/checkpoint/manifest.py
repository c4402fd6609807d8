"""A checkpoint's ``manifest.json``, read as a stranger's data: every value is checked before any
is used, so a malformed or hostile manifest raises ``CheckpointError`` naming the entry, and no
reader ever meets a KeyError, a path outside the checkpoint, or a size that does not fit its file.

The checked manifest holds, per file entry, per table, per block, a ``Block``: its byte offset,
its element count and shape, its dtype and its CRC-32, with the block lying inside the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from embtables.checkpoint.file_names import CheckpointError, contained
from embtables.kernels import storage_types
from embtables.tables.dynamic_vocabularies import PENDING_FIELDS, ROW_FIELDS, VOCABULARY_FIELDS

FORMAT_VERSION = 2  # 2 nests state blocks under "state"; 1 is still read
HALF_FORMAT_VERSION = 3  # 3: a state block may hold bfloat16 or float16 values (its spec says "dtype")
READABLE_VERSIONS = (1, 2, 3)
# the element types of a state block (a spec without "dtype" holds float32) and their bytes
STATE_DTYPES = {t.name: t.itemsize for t in storage_types.STORAGE_TYPES}  # bytes a value of each storage type
MANIFEST = "manifest.json"
_MAX_MANIFEST_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Block:
    """One tensor of a rank file: ``count`` elements at byte ``offset``, shaped ``shape``: int64 row ids
    (``dtype`` np.int64) or values (``dtype`` np.float32, as read; ``stored``: the element type in the file,
    float32, bfloat16 or float16)."""

    offset: int
    shape: tuple[int, ...]
    dtype: Any  # np.int64 or np.float32
    crc32: int
    stored: str = "float32"

    @property
    def count(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 0

    @property
    def itemsize(self) -> int:
        """Bytes of one element in the file."""
        return 8 if self.dtype is np.int64 else STATE_DTYPES[self.stored]

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


def _int(value: Any, what: str, where: Path, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointError(f"{where / MANIFEST}: {what} must be an integer in [{lo}, {hi}], got {value!r}.")
    return int(value)


def _dict(value: Any, what: str, where: Path) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where / MANIFEST}: {what} must be a JSON object, got {type(value).__name__}.")
    return value


def _str(value: Any, what: str, where: Path) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"{where / MANIFEST}: {what} must be a string, got {value!r}.")
    return value


def _block(spec: Any, what: str, where: Path, file_bytes: int, dim: int | None) -> Block:
    spec = _dict(spec, what, where)
    offset = _int(spec.get("offset"), f"{what}.offset", where)
    crc = _int(spec.get("crc32"), f"{what}.crc32", where, 0, (1 << 32) - 1)
    stored = "float32"
    if dim is None:  # a vector of int64 row ids
        shape: tuple[int, ...] = (_int(spec.get("count"), f"{what}.count", where),)
        dtype: Any = np.int64
    else:
        raw = spec.get("shape")
        if not isinstance(raw, list) or len(raw) != 2:
            raise CheckpointError(f"{where / MANIFEST}: {what}.shape must be [rows, {dim}], got {raw!r}.")
        shape = (_int(raw[0], f"{what}.shape[0]", where), _int(raw[1], f"{what}.shape[1]", where, dim, dim))
        dtype = np.float32
        stored = spec.get("dtype", "float32")
        if not isinstance(stored, str) or stored not in STATE_DTYPES:
            raise CheckpointError(
                f"{where / MANIFEST}: {what}.dtype must be one of {sorted(STATE_DTYPES)}, got {stored!r:.40}."
            )
    block = Block(offset, shape, dtype, crc, stored)
    if offset + block.nbytes > file_bytes:
        raise CheckpointError(
            f"{where / MANIFEST}: {what} ({block.nbytes} bytes at offset {offset}) lies outside its file of "
            f"{file_bytes} bytes."
        )
    return block


def _check_tables(config: dict[str, Any], where: Path) -> dict[str, dict[str, Any]]:
    tables = _dict(config.get("tables"), "config.tables", where)
    for name, t in tables.items():
        what = f"config.tables[{name!r}]"
        t = _dict(t, what, where)
        _int(t.get("vocabulary_size"), f"{what}.vocabulary_size", where, 1)
        _int(t.get("dim"), f"{what}.dim", where, 1, 1 << 20)
        opt = _dict(t.get("optimizer"), f"{what}.optimizer", where)
        _str(opt.get("type"), f"{what}.optimizer.type", where)
        slots = t.get("slots")
        if not isinstance(slots, list) or not all(isinstance(s, str) and s for s in slots):
            raise CheckpointError(f"{where / MANIFEST}: {what}.slots must be a list of slot names, got {slots!r}.")
    return tables


@dataclasses.dataclass(frozen=True)
class TableBlocks:
    """Where one table's data lies in one rank file: its row ids [N], one [N, D] block per state key
    (``<table>`` and ``<table>/<slot>``), and the pre-update rows of a pending pipelined update."""

    rows: Block
    state: dict[str, Block]
    stale_rows: Block | None
    stale: Block | None
    vocabulary: dict[str, Block] | None = None  # a dynamic table's key map, [N] int64 per field (spec §11)


def _table_blocks(tb: dict[str, Any], tname: str, t: dict[str, Any], what: str, where: Path, size: int) -> TableBlocks:
    """Format 2 nests the state blocks under "state"; format 1 put them beside "rows" (keyed by name)."""
    dim = int(t["dim"])
    state_specs = _dict(tb.get("state"), f"{what}.state", where) if "state" in tb else tb
    rows = _block(tb.get("rows"), f"{what}.rows", where, size, None)
    state = {}
    for key in [tname, *(f"{tname}/{s}" for s in t["slots"])]:
        if key not in state_specs:
            raise CheckpointError(f"{where / MANIFEST}: {what} has no block for {key!r}.")
        state[key] = _block(state_specs[key], f"{what}[{key!r}]", where, size, dim)
        if state[key].shape[0] != rows.shape[0]:
            raise CheckpointError(
                f"{where / MANIFEST}: {what}[{key!r}] has {state[key].shape[0]} rows, its `rows` block {rows.shape[0]}."
            )
    stale_rows = stale = None
    if "stale_rows" in tb or "stale" in tb:
        stale_rows = _block(tb.get("stale_rows"), f"{what}.stale_rows", where, size, None)
        stale = _block(tb.get("stale"), f"{what}.stale", where, size, dim)
        if stale.shape[0] != stale_rows.shape[0]:
            raise CheckpointError(f"{where / MANIFEST}: {what}: stale rows and stale values differ in length.")
    vocabulary = None
    if "vocabulary" in tb:
        specs = _dict(tb["vocabulary"], f"{what}.vocabulary", where)
        vocabulary = {}
        for field in VOCABULARY_FIELDS:
            vocabulary[field] = _block(specs.get(field), f"{what}.vocabulary.{field}", where, size, None)
            # row fields hold one value per row, pending fields one per pending key
            like = rows if field in ROW_FIELDS else vocabulary[PENDING_FIELDS[0]]
            if vocabulary[field].shape[0] != like.shape[0]:
                raise CheckpointError(
                    f"{where / MANIFEST}: {what}.vocabulary.{field} has {vocabulary[field].shape[0]} values, "
                    f"{'its `rows` block' if field in ROW_FIELDS else PENDING_FIELDS[0]} {like.shape[0]}."
                )
    return TableBlocks(rows, state, stale_rows, stale, vocabulary)


def _check_files(files: Any, tables: dict[str, dict[str, Any]], where: Path) -> list[dict[str, Any]]:
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"{where / MANIFEST}: `files` must be a non-empty list, got {files!r}.")
    seen: set[str] = set()
    out = []
    for i, entry in enumerate(files):
        what = f"files[{i}]"
        entry = _dict(entry, what, where)
        name = entry.get("file")
        contained(where, name, f"{MANIFEST} {what}.file")
        if name in seen:
            raise CheckpointError(f"{where / MANIFEST}: {what}.file {name!r} is listed twice.")
        seen.add(str(name))
        size = _int(entry.get("bytes"), f"{what}.bytes", where)
        blocks = _dict(entry.get("tables"), f"{what}.tables", where)
        checked = {}
        for tname, t in tables.items():
            tb = _dict(blocks.get(tname), f"{what}.tables[{tname!r}]", where)
            checked[tname] = _table_blocks(tb, tname, t, f"{what}.tables[{tname!r}]", where, size)
        out.append({"file": name, "bytes": size, "blocks": checked})
    return out


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """The manifest ``doc`` read from ``where``, every value checked; adds ``checked_files``, a list
    of ``{"file", "bytes", "blocks": {table: TableBlocks}}``. Raises ``CheckpointError``."""
    doc = _dict(doc, "the manifest", where)
    if doc.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format_version {doc.get('format_version')!r}, this embtables reads {READABLE_VERSIONS}."
        )
    _int(doc.get("step"), "step", where)
    _int(doc.get("world_size"), "world_size", where, 1, 1 << 20)
    strategies = _dict(doc.get("strategies", {}), "strategies", where)
    config = _dict(doc.get("config"), "config", where)
    tables = _check_tables(config, where)
    for name, s in strategies.items():
        _str(s, f"strategies[{name!r}]", where)
    _dict(doc.get("extra", {}), "extra", where)
    _dict(doc.get("settings", {}), "settings", where)
    checked: dict[str, Any] = dict(doc)
    checked["checked_files"] = _check_files(doc.get("files"), tables, where)
    return checked


def load(where: Path) -> dict[str, Any]:
    """Read and validate ``where/manifest.json`` (refusing one larger than 256 MiB)."""
    path = where / MANIFEST
    try:
        if os.path.getsize(path) > _MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"{path}: larger than {_MAX_MANIFEST_BYTES >> 20} MiB; not a manifest embtables wrote."
            )
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc}).") from exc
    return validate(doc, where)


__all__ = [
    "FORMAT_VERSION",
    "HALF_FORMAT_VERSION",
    "MANIFEST",
    "STATE_DTYPES",
    "Block",
    "TableBlocks",
    "load",
    "validate",
]
