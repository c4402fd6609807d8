"""Restoring dynamic tables (spec §11) by key: into any number of ranks, any placement, any capacity.

A dynamic table's rows belong to keys, and which rank owns a key depends on the world size, so its
checkpoint is read key by key: every live row (key, lookup count, age, touch order, weights and slots)
and every pending key of every rank file, then each reading rank keeps the keys it owns. When the layout
is the writer's (same world size, placement and capacity) each key returns to its own row; otherwise the
keys take rows 0, 1, ... oldest first (by age, then touch order, then file), and a rank whose keys do not
fit its rows refuses the restore. Pending keys beyond a rank's capacity keep the youngest. Everything is
read and checked before anything is written (pass 1); ``write`` copies the values into place (pass 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.streaming_restore import refuse_float16_overflow
from embtables.config import ResolvedTable
from embtables.tables.dynamic_vocabularies import (
    PENDING_FIELDS,
    ROW_FIELDS,
    vocabulary_problem,
    vocabulary_values_problem,
)
from embtables.tables.state import LocalShard

ReadBlock = Callable[[np.ndarray[Any, Any], Any, Path, str], np.ndarray[Any, Any]]
RowIds = Callable[[np.ndarray[Any, Any], Any, Path, str, int], np.ndarray[Any, Any]]


@dataclasses.dataclass(eq=False)
class DynamicTableRestore:
    """What this rank restores of one dynamic table: its local rows [L], their values per slot ("" is the
    weights) [L, D], and the vocabulary arrays of its key map (row fields [capacity], pending [P])."""

    table: str
    local_rows: Tensor
    values: dict[str, Tensor]
    arrays: dict[str, Tensor]


def read(
    where: Path,
    manifest: dict[str, Any],
    maps: dict[str, np.ndarray[Any, Any]],
    table: ResolvedTable,
    shard: LocalShard,
    capacity: int,
    owns: Callable[[Tensor], Tensor],
    same_layout: bool,
    read_block: ReadBlock,
    row_ids: RowIds,
) -> DynamicTableRestore:
    """Pass 1 for one dynamic table: read and check every file's live rows and pending keys, keep this
    rank's keys (``owns(keys [N]) -> bool [N]``) and place them in its ``capacity`` rows."""
    name, saved_v = table.name, int(manifest["config"]["tables"][table.name]["vocabulary_size"])
    live: dict[str, list[np.ndarray[Any, Any]]] = {k: [] for k in (*ROW_FIELDS, "row", "file")}
    values: dict[str, list[np.ndarray[Any, Any]]] = {slot: [] for slot in shard.tensors}
    pending: dict[str, list[np.ndarray[Any, Any]]] = {f: [] for f in (*PENDING_FIELDS, "file")}
    for index, entry in enumerate(manifest["checked_files"]):
        blocks = entry["blocks"][name]
        file, mm = where / entry["file"], maps[entry["file"]]
        if blocks.vocabulary is None:
            raise CheckpointError(f"{file}: table {name!r} is dynamic but the file holds no vocabulary for it.")
        rows = row_ids(mm, blocks.rows, file, name, saved_v)
        fields = {f: read_block(mm, blocks.vocabulary[f], file, f"{name}#{f}") for f in (*ROW_FIELDS, *PENDING_FIELDS)}
        problem = vocabulary_values_problem(
            name, {f: torch.from_numpy(np.array(v, dtype=np.int64)) for f, v in fields.items()}
        )
        if problem is not None:
            raise CheckpointError(
                f"{file}: {problem} (the checkpoint is corrupt or was not written by embtables); nothing was restored."
            )
        keep = fields["counts"] > 0
        keys = torch.from_numpy(np.ascontiguousarray(fields["keys"][keep]))
        mine = owns(keys).numpy() if keys.numel() else np.zeros(0, dtype=bool)
        for f in ROW_FIELDS:
            live[f].append(fields[f][keep][mine])
        live["row"].append(rows[keep][mine])
        live["file"].append(np.full(int(mine.sum()), index, dtype=np.int64))
        for slot in shard.tensors:
            key = f"{name}/{slot}" if slot else name
            block = read_block(mm, blocks.state[key], file, key)
            values[slot].append(block[keep][mine])
        pkeys = torch.from_numpy(np.array(fields["pending_keys"], dtype=np.int64))  # a writable copy
        pmine = owns(pkeys).numpy() if pkeys.numel() else np.zeros(0, dtype=bool)
        for f in PENDING_FIELDS:
            pending[f].append(fields[f][pmine])
        pending["file"].append(np.full(int(pmine.sum()), index, dtype=np.int64))
    cat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in live.items()}
    n = cat["keys"].size
    if same_layout:
        mine_rows = shard.rows.detach().to("cpu", torch.int64).numpy()
        pos = np.searchsorted(mine_rows, cat["row"])
        hit = (pos < mine_rows.size) & (mine_rows[np.minimum(pos, max(mine_rows.size - 1, 0))] == cat["row"])
        if not bool(hit.all()):
            raise CheckpointError(
                f"{where}: table {name!r}: a key is stored on a row its owner does not hold (the checkpoint is corrupt "
                "or was not written by embtables)."
            )
        local, order = pos, cat["order"]
    else:
        oldest_first = np.lexsort((cat["file"], cat["order"], -cat["age"]))
        local = np.empty(n, dtype=np.int64)
        local[oldest_first] = np.arange(n)
        order = local.copy()
    owned = int(shard.rows.numel())
    if n > owned:
        raise CheckpointError(
            f"{where}: table {name!r}: this rank owns {n} live keys of the checkpoint but holds only {owned} rows "
            f"(the capacity, vocabulary_size={table.vocabulary_size}, is smaller than the checkpoint's "
            f"{saved_v}). Raise vocabulary_size to hold them, or restore into more processes."
        )
    arrays = {f: torch.zeros(capacity, dtype=torch.int64) for f in ROW_FIELDS}
    index_t = torch.from_numpy(local)
    for f in ROW_FIELDS:
        arrays[f][index_t] = torch.from_numpy(order if f == "order" else cat[f])
    pcat = {k: np.concatenate(v) for k, v in pending.items()}
    if pcat["pending_keys"].size > capacity:  # keep the youngest
        youngest = np.lexsort((pcat["file"], pcat["pending_age"]))[:capacity]
        pcat = {k: v[np.sort(youngest)] for k, v in pcat.items()}
    for f in PENDING_FIELDS:
        arrays[f] = torch.from_numpy(pcat[f].astype(np.int64))
    problem = vocabulary_problem(name, arrays, capacity)
    if problem is not None:
        raise CheckpointError(f"{where}: {problem} (the checkpoint is corrupt or was not written by embtables).")
    dim = table.dim
    tensors = {
        slot: torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0, dim), np.float32))
        for slot, parts in values.items()
    }
    for slot, x in tensors.items():  # a finite value beyond float16's range would be stored as Inf
        if shard.tensors[slot].dtype == torch.float16:
            refuse_float16_overflow(where, name, f"{name}/{slot}" if slot else name, x)
    return DynamicTableRestore(name, index_t, tensors, arrays)


def write(restores: dict[str, DynamicTableRestore], shards: dict[str, LocalShard]) -> None:
    """Pass 2: copy each restored key's weights and slots to its local row."""
    with torch.no_grad():
        for name, r in restores.items():
            for slot, target in shards[name].tensors.items():
                if r.local_rows.numel():
                    target.index_copy_(
                        0, r.local_rows.to(target.device), r.values[slot].to(target.device, target.dtype)
                    )
