"""Serving deltas: the rows an incremental checkpoint chain changed since a serving export, written beside
it (``export(checkpoint, out, incremental=True)``) and applied by a live ``ServingEmbedding``
(``update``), atomically for lookups (``ReadWriteLock``).

An export records the checkpoint it holds (``checkpoint_id``) and its own ``export_id``. A delta is a
directory ``delta-<step>`` in the export: ``delta.json`` (the export it belongs to, the checkpoint it starts
from and the one it brings, with their steps, and per table its files) and, per table by index, the changed
rows (``t<i>.rows.npy``, int64 [R, 1], ascending) and their values in the export's type (``t<i>.data.npy``
[R, D]; int8: ``t<i>.scale.npy`` [R, 2]). Deltas apply in order, each from the version the last one
brought; everything in them is read as a stranger's data and checked before anything is applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from embtables.checkpoint import increments
from embtables.checkpoint.blocks import read_block, row_ids
from embtables.checkpoint.file_names import CheckpointError, contained
from embtables.checkpoint.owned_dirs import fsync_dir, temp_name
from embtables.checkpoint.serving_codec import MARKER, encode_rows, int8_scales_problem, load_array, store_dtype

Link = tuple[Path, dict[str, Any], dict[str, np.ndarray[Any, Any]]]  # (directory, checked manifest, file maps)
_FORMAT = "embtables serving delta"


class ReadWriteLock:
    """Many readers at once, or one writer; a waiting writer goes before new readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class DeltaRows:
    """One table's rows in a checked delta: the row ids [R] (ascending), their stored values [R, D] (the
    export's type) and, for int8, their scales [R, 2] (else None)."""

    rows: np.ndarray[Any, Any]
    data: np.ndarray[Any, Any]
    scales: np.ndarray[Any, Any] | None


@dataclasses.dataclass(frozen=True)
class Delta:
    """One checked delta: where it is, the versions it goes from and to, and its rows per table."""

    path: Path
    from_id: str
    to_id: str
    to_step: int
    tables: dict[str, DeltaRows]


def version(doc: dict[str, Any], root: Path) -> tuple[str | None, int]:
    """The checkpoint id and step the export at ``root`` (its ``serving.json``, ``doc``) serves with its
    deltas applied: the last delta's (a chain of them from the export's own), else the export's."""
    current, step = doc.get("checkpoint_id"), doc.get("step")
    step = step if type(step) is int else 0
    for delta in _listed(root, doc):
        if delta["from"]["id"] == current and delta["to"]["step"] > step:
            current, step = delta["to"]["id"], delta["to"]["step"]
    return (current if isinstance(current, str) else None), step


def write(
    target: Path, doc: dict[str, Any], links: list[Link], start: int, tables: dict[str, Any], dtype: str
) -> Path | None:
    """Write the delta that brings the export at ``target`` from ``links[start]`` to ``links[-1]`` (the rows
    of ``links[start + 1:]``, each from the newest link that holds it), published atomically; None when
    there is nothing after ``links[start]``."""
    if start == len(links) - 1:
        return None
    head, head_manifest, _ = links[-1]
    from_manifest = links[start][1]
    name = f"delta-{int(head_manifest['step']):010d}"
    tmp = target.parent / temp_name("delta")  # beside the export: a writer killed leaves nothing in it
    tmp.mkdir()
    try:
        files: dict[str, dict[str, Any]] = {}
        for index, (table, t) in enumerate(tables.items()):
            v, d = int(t["vocabulary_size"]), int(t["dim"])
            rows, values = _newest_rows(links[start + 1 :], table, v, d)
            stored, _, scale_bias, finite = encode_rows(values, dtype, table, rows)
            if not finite.all():
                r = int(rows[np.flatnonzero(~finite.all(axis=1))[0]])
                raise ValueError(
                    f"export(incremental=True): table {table!r}, row {r} is not finite in {head}; a delta never "
                    "serves NaN or Inf. Nothing was written."
                )
            entry: dict[str, Any] = {
                "rows": f"t{index}.rows.npy",
                "data": f"t{index}.data.npy",
                "count": int(rows.size),
            }
            np.save(tmp / entry["rows"], rows.reshape(-1, 1).astype(np.int64))
            np.save(tmp / entry["data"], np.ascontiguousarray(stored).astype(store_dtype(dtype), copy=False))
            if scale_bias is not None:
                entry["scales"] = f"t{index}.scale.npy"
                np.save(tmp / entry["scales"], scale_bias.astype(np.float32))
            files[table] = entry
        meta = {
            "format": _FORMAT,
            "export_id": doc["export_id"],
            "dtype": dtype,
            "from": {"id": increments.manifest_id(from_manifest), "step": int(from_manifest["step"])},
            "to": {"id": increments.manifest_id(head_manifest), "step": int(head_manifest["step"])},
            "tables": files,
        }
        with open(tmp / "delta.json", "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        for p in tmp.iterdir():
            with open(p, "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        _list_in_marker(target, name, tmp)  # first: a delta published is always one the export owns
        final = target / name
        if final.exists():
            shutil.rmtree(final)  # the same step exported again (listed in the marker: written by export)
        os.replace(tmp, final)
        fsync_dir(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def newest_blocks(
    links: list[Link], table: str, v: int, filled: np.ndarray[Any, Any]
) -> Iterator[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """Per rank file of ``links`` (oldest first), newest link first: its rows [N] of ``table`` (checked), their
    weights [N, D] (mapped, not read) and which of them no newer link holds [N] bool. ``filled`` [V] bool marks
    every row seen, as the files are gone through."""
    for where, manifest, maps in reversed(links):
        for entry in manifest["checked_files"]:
            file, mm = where / entry["file"], maps[entry["file"]]
            blocks = entry["blocks"][table]
            rows = row_ids(mm, blocks.rows, file, table, v)
            if rows.size == 0:
                continue
            yield rows, read_block(mm, blocks.state[table], file, table), ~filled[rows]
            filled[rows] = True


def _newest_rows(links: list[Link], table: str, v: int, d: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Rows [R] (ascending) of ``table`` in ``links`` and their float32 values [R, D], each row's from the
    newest link that holds it."""
    rows_parts, value_parts = [], []
    for rows, weights, newest in newest_blocks(links, table, v, np.zeros(v, dtype=bool)):
        rows_parts.append(rows[newest])
        value_parts.append(np.asarray(weights)[newest])
    if not rows_parts:
        return np.zeros(0, dtype=np.int64), np.zeros((0, d), dtype=np.float32)
    rows = np.concatenate(rows_parts)
    order = np.argsort(rows, kind="stable")
    return rows[order], np.concatenate(value_parts)[order].astype(np.float32, copy=False)


def _list_in_marker(target: Path, name: str, scratch: Path) -> None:
    """Add the delta directory ``name`` to the export's marker (replaced atomically; the new one is written
    in ``scratch``, the delta's own temporary directory, first)."""
    marker = json.loads((target / MARKER).read_text())
    files = [f for f in marker["files"] if f != name] + [name]
    tmp = scratch / MARKER
    with open(tmp, "w") as f:
        json.dump({**marker, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target / MARKER)


def _listed(root: Path, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The checked ``delta.json`` of every delta directory in the export, by the step it brings."""
    out = []
    for path in sorted(root.glob("delta-*")):
        if not path.is_dir():
            continue
        where = contained(root, path.name, "a delta directory")
        try:
            meta = json.loads((where / "delta.json").read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where}: its delta.json is missing or unreadable ({exc}).") from exc
        problem = _problem(meta, doc)
        if problem:
            raise CheckpointError(f"{where}: {problem}; nothing was applied.")
        out.append({**meta, "path": where})
    return sorted(out, key=lambda m: m["to"]["step"])


def _problem(meta: Any, doc: dict[str, Any]) -> str | None:
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        return "not an embtables serving delta"
    if meta.get("export_id") != doc.get("export_id"):
        return "a delta of another export (its export_id differs): the export was replaced since"
    if meta.get("dtype") != doc.get("dtype"):
        return f"a delta in {meta.get('dtype')!r:.20}, the export is {doc.get('dtype')!r:.20}"
    for side in ("from", "to"):
        part = meta.get(side)
        if not isinstance(part, dict) or not isinstance(part.get("id"), str) or type(part.get("step")) is not int:
            return f"its {side!r} version is malformed"
    tables, expected = meta.get("tables"), doc.get("tables")
    if not isinstance(tables, dict) or not isinstance(expected, dict) or set(tables) != set(expected):
        return "its tables are not the export's"
    return None


def pending(
    root: Path, doc: dict[str, Any], current: str | None, step: int, shapes: dict[str, tuple[int, int]]
) -> list[Delta]:
    """The deltas of the export at ``root`` after version ``current`` (at ``step``), in order, each checked
    and read (rows ascending in [0, V), arrays of the export's type and shape, values finite);
    ``CheckpointError`` naming the delta for one that is missing, out of order or malformed."""
    out = []
    dtype = doc["dtype"]
    for meta in _listed(root, doc):
        if meta["to"]["step"] <= step:
            continue
        if meta["from"]["id"] != current:
            raise CheckpointError(
                f"{meta['path']}: a delta from step {meta['from']['step']} to {meta['to']['step']}, but this "
                f"ServingEmbedding serves step {step} (another version): a delta before it is missing or out of "
                "order. Nothing was applied; load the export again."
            )
        tables = {}
        for name, (v, d) in shapes.items():
            entry = meta["tables"][name]
            try:
                paths = {k: contained(meta["path"], entry[k], f"delta.json's tables[{name!r}][{k!r}]") for k in
                         ("rows", "data", *(("scales",) if dtype == "int8" else ()))}  # fmt: skip
                rows = load_array(paths["rows"], np.int64, (-1, 1), mmap=False, max_rows=v).reshape(-1)
                if rows.size and (int(rows[0]) < 0 or int(rows[-1]) >= v or not bool((np.diff(rows) > 0).all())):
                    raise ValueError(f"{paths['rows'].name}: rows are not ascending ids in [0, {v})")
                data = load_array(paths["data"], store_dtype(dtype), (rows.size, d), mmap=False)
                scales = None
                if dtype == "int8":
                    scales = load_array(paths["scales"], np.float32, (rows.size, 2), mmap=False)
                if dtype == "bfloat16":
                    finite = bool(((data & 0x7F80) != 0x7F80).all())  # exponent all ones: Inf or NaN
                else:
                    finite = bool(np.isfinite(scales if scales is not None else data).all())
                if not finite:
                    raise ValueError("a value is not finite")
                problem = int8_scales_problem(scales) if scales is not None else None
                if problem is not None:
                    raise ValueError(problem)
            except (OSError, ValueError, EOFError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{meta['path']}: table {name!r}: {exc}. Nothing was applied.") from exc
            tables[name] = DeltaRows(rows, data, scales)
        out.append(Delta(meta["path"], meta["from"]["id"], meta["to"]["id"], meta["to"]["step"], tables))
        current, step = meta["to"]["id"], meta["to"]["step"]
    return out
