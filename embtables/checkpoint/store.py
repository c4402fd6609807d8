"""Checkpoints of sharded tables: every rank writes its own rows, any number of ranks reads them back.

Layout of a checkpoint directory ``<root>/ckpt-<step:08d>/``:

- ``manifest.json``: ``format_version``, ``step``, ``world_size`` and ``strategies`` of the writer,
  the config as data (tables: name, V, D, combiner, optimizer class and arguments; features), the
  caller's ``extra`` JSON, and one entry per data file with its size and, per block, where the block
  lies and its CRC-32.
- ``rank-<r:05d>.safetensors``, one per writing rank, in the safetensors format (an 8-byte header
  length, a JSON header naming every tensor with its dtype, shape and byte range, then the raw
  little-endian data). Per table it holds ``<table>#rows``, the int64 global row ids the rank owns
  (ascending), then one float32 ``[N, D]`` tensor per state key: ``<table>`` for the weights and
  ``<table>/<slot>`` for each TF slot name.

The safetensors library, numpy or any safetensors reader opens the files; the manifest repeats
where every block is, with its CRC-32. A save writes into
``<root>/.tmp-ckpt-<step>-<id>/`` and publishes it with one atomic rename after every rank has
finished and the manifest is fsynced. A killed save never leaves a published partial checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embtables.config import ResolvedConfig
from embtables.sharding import comm
from embtables.sharding.fingerprint import describe_config
from embtables.tables.state import LocalShard

FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_CHUNK = 64 << 20  # bytes written (and checksummed) per call: bounded extra memory


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the module it is restored into."""


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def published(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root`` (a manifest present), oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if p.name.startswith(_PREFIX) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is a checkpoint, else the latest checkpoint under it."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    done = published(p)
    if not done:
        raise CheckpointError(f"no checkpoint at {p}: neither a manifest.json there nor a ckpt-* directory with one.")
    return done[-1]


def _write_block(f: Any, array: np.ndarray[Any, Any], progress: Callable[[int], None]) -> int:
    """Write ``array``'s bytes in chunks straight from its memory; returns their CRC-32."""
    view = np.ascontiguousarray(array).data.cast("B")
    crc = 0
    for start in range(0, len(view), _CHUNK):
        piece = view[start : start + _CHUNK]
        f.write(piece)
        crc = zlib.crc32(piece, crc)
        progress(len(piece))
    return crc


def save(
    root: str | os.PathLike[str],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    step: int,
    *,
    strategies: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    progress: Callable[[int], None] | None = None,
    group: comm.ProcessGroup | None = None,
    stale: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Path:
    """Write a checkpoint of ``shards`` (this rank's rows of every table) and return its directory.

    Collective when ``group`` (or the default group) spans several ranks: each rank writes its own
    file in parallel, rank 0 writes the manifest and publishes. ``keep_last=N`` then deletes all but
    the N newest checkpoints under ``root``. ``stale`` holds, per table, global rows [U] and their values
    before a pipelined update [U, D] that the next training lookup must still read (SPEC 6)."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save: keep_last must be an int >= 1 or None, got {keep_last!r}.")
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    base = Path(root)
    tmp_name = comm.broadcast_object(f".tmp-{_PREFIX}{step:08d}-{uuid.uuid4().hex[:12]}", 0, group)
    tmp = base / tmp_name
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    comm.barrier(group)
    tick = progress or (lambda n: None)
    # Plan the file first (a safetensors file: its JSON header lists every tensor's dtype, shape and
    # byte range), then stream each block from the live storage into its place.
    plan: list[tuple[str, str, str, np.ndarray[Any, Any]]] = []  # (table, block, tensor name, array)
    for t in resolved.tables:
        shard = shards[t.name]
        plan.append((t.name, "rows", f"{t.name}#rows", shard.rows.detach().to("cpu", torch.int64).numpy()))
        for slot, tensor in shard.tensors.items():
            key = f"{t.name}/{slot}" if slot else t.name
            plan.append((t.name, key, key, tensor.detach().to("cpu").numpy()))
        if stale and t.name in stale:
            srows, svalues = (x.detach().to("cpu").contiguous().numpy() for x in stale[t.name])
            plan.append((t.name, "stale_rows", f"{t.name}#stale_rows", srows.astype(np.int64)))
            plan.append((t.name, "stale", f"{t.name}#stale", svalues.astype(np.float32)))
    header: dict[str, Any] = {"__metadata__": {"format": "embtables", "rank": str(rank), "step": str(step)}}
    at = 0
    for _, _, name, array in plan:
        nbytes = array.size * array.itemsize
        dtype = "I64" if array.dtype == np.int64 else "F32"
        header[name] = {"dtype": dtype, "shape": [int(x) for x in array.shape], "data_offsets": [at, at + nbytes]}
        at += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads its header to 8 bytes
    start = 8 + len(encoded)
    blocks: dict[str, Any] = {t.name: {} for t in resolved.tables}
    data = tmp / f"rank-{rank:05d}.safetensors"
    with open(data, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for table, block, name, array in plan:
            offset = start + header[name]["data_offsets"][0]
            spec: dict[str, Any] = {"offset": offset}
            if array.ndim == 1:
                spec["count"] = int(array.size)
            else:
                spec["shape"] = [int(x) for x in array.shape]
            spec["crc32"] = _write_block(f, array, tick)
            blocks[table][block] = spec
        f.flush()
        os.fsync(f.fileno())
    mine = {"file": data.name, "bytes": data.stat().st_size, "tables": blocks}
    files = comm.all_gather_object(mine, group)
    if rank == 0:
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "world_size": world,
            "strategies": strategies or {t.name: "div" for t in resolved.tables},
            "config": config_as_data(resolved),
            "extra": extra or {},
            "files": files,
        }
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = checkpoint_dir(base, step)
        if final.exists():  # the same step saved again: the new one replaces it
            trash = base / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(base)
        if keep_last is not None:
            for old in published(base)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in base.glob(f".tmp-{_PREFIX}*"):  # left by saves killed midway
            if leftover.name != tmp_name:
                shutil.rmtree(leftover, ignore_errors=True)
    comm.barrier(group)
    return checkpoint_dir(base, step)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def config_as_data(resolved: ResolvedConfig) -> dict[str, Any]:
    """Tables and features as JSON data (never pickles of code; callables are recorded by kind)."""
    described = describe_config(resolved, {}, {})
    for t in resolved.tables:
        d = described["tables"][t.name]
        d["slots"] = list(t.optimizer.slot_names)
        d["combiner_value"] = str(t.config.combiner)
        q = t.config.quantization_config
        d["quantization"] = None if q is None else [q.num_buckets, float(q.lower), float(q.upper)]
        d.pop("strategy", None)
        d.pop("table_rank", None)
    described["feature_list"] = [
        {
            "name": f.name,
            "table": resolved.tables[f.table_index].name,
            "max_sequence_length": f.config.max_sequence_length,
            "output_shape": None if f.config.output_shape is None else list(f.config.output_shape),
            "validate": f.config.validate_weights_and_indices,
        }
        for f in resolved.features
    ]
    described["structure"] = _structure(resolved.structure, iter(range(len(resolved.features))))
    return described


def _structure(node: Any, counter: Any) -> dict[str, Any]:
    """The feature nest as JSON: {"dict": {...}}, {"list": [...]}, {"tuple": [...]} or {"feature": i}."""
    if isinstance(node, Mapping):
        return {"dict": {str(k): _structure(node[k], counter) for k in sorted(node)}}
    if isinstance(node, (list, tuple)):
        return {"list" if isinstance(node, list) else "tuple": [_structure(v, counter) for v in node]}
    return {"feature": next(counter)}


def read_manifest(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    where = resolve_path(path)
    try:
        manifest = json.loads((where / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where / 'manifest.json'}: unreadable ({exc}).") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {manifest.get('format_version')!r}, this embtables reads {FORMAT_VERSION}."
        )
    return where, manifest


def _check_config(manifest: dict[str, Any], resolved: ResolvedConfig, where: Path) -> None:
    saved = manifest["config"]["tables"]
    problems = []
    for t in resolved.tables:
        s = saved.get(t.name)
        if s is None:
            problems.append(f"table {t.name!r} is not in the checkpoint (it has {sorted(saved)})")
            continue
        for field, mine in (("vocabulary_size", t.vocabulary_size), ("dim", t.dim)):
            if s[field] != mine:
                problems.append(f"table {t.name!r}: {field} {s[field]} in the checkpoint, {mine} here")
        if s["optimizer"]["type"] != type(t.optimizer).__name__ or s["slots"] != list(t.optimizer.slot_names):
            problems.append(
                f"table {t.name!r}: optimizer {s['optimizer']['type']} (slots {s['slots']}) in the checkpoint, "
                f"{type(t.optimizer).__name__} (slots {list(t.optimizer.slot_names)}) here"
            )
    if problems:
        raise CheckpointError(f"{where}: the checkpoint does not match this model: " + "; ".join(problems) + ".")


def restore(
    path: str | os.PathLike[str],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    *,
    progress: Callable[[int], None] | None = None,
    group: comm.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Fill ``shards`` (this rank's rows, live storage) from a checkpoint written by any number of
    ranks with any strategy; returns the manifest. Every block read is checked (size and CRC-32)
    before anything is written, and every rank agrees: on any error every rank raises
    ``CheckpointError`` naming the file and table, and no shard changes anywhere."""
    error: str | None = None
    staged: dict[tuple[str, str], torch.Tensor] = {}
    manifest: dict[str, Any] = {}
    try:
        where, manifest = read_manifest(path)
        _check_config(manifest, resolved, where)
        staged = _read_rows(where, manifest, resolved, shards, progress or (lambda n: None))
        manifest["stale"] = _read_stale(where, manifest, resolved, shards)
    except CheckpointError as exc:
        error = str(exc)
    errors = comm.all_gather_object(error, group)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError("; ".join(f"rank {r}: {e}" if len(errors) > 1 else e for r, e in bad))
    with torch.no_grad():
        for (table, slot), values in staged.items():
            target = shards[table].tensors[slot]
            target.copy_(values.to(target.device, target.dtype))
    return manifest


def _read_rows(
    where: Path,
    manifest: dict[str, Any],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    progress: Callable[[int], None],
) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's rows of every state key, gathered from every file that holds some of them."""
    staged: dict[tuple[str, str], torch.Tensor] = {}
    maps: dict[str, np.memmap[Any, Any]] = {}
    for entry in manifest["files"]:
        file = where / entry["file"]
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{file}: missing ({exc}).") from exc
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['bytes']} (truncated or corrupt).")
        maps[entry["file"]] = np.memmap(file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)  # type: ignore[assignment]
    for t in resolved.tables:
        mine = shards[t.name].rows.detach().to("cpu", torch.int64).numpy()
        slots = list(shards[t.name].tensors)
        out = {slot: np.empty((mine.size, t.dim), dtype=np.float32) for slot in slots}
        filled = np.zeros(mine.size, dtype=bool)
        for entry in manifest["files"]:
            block = entry["tables"][t.name]
            mm = maps[entry["file"]]
            rows = _block(mm, block["rows"], np.int64, (block["rows"]["count"],), where / entry["file"], t.name)
            if rows.size == 0 or mine.size == 0:
                continue
            same = rows.size == mine.size and bool(np.array_equal(rows, mine))
            if same:  # the writer held exactly these rows: one contiguous copy per slot
                hit = np.ones(mine.size, dtype=bool)
            else:
                pos = np.searchsorted(rows, mine)
                hit = (pos < rows.size) & (rows[np.minimum(pos, rows.size - 1)] == mine)
                if not hit.any():
                    continue
            for slot in slots:
                key = f"{t.name}/{slot}" if slot else t.name
                spec = block[key]
                if same:  # copy and checksum in cache-sized pieces: one pass over the file's bytes
                    _copy_checked(mm, spec, out[slot], where / entry["file"], key, progress)
                    continue
                values = _block(mm, spec, np.float32, tuple(spec["shape"]), where / entry["file"], key)
                out[slot][hit] = values[pos[hit]]
                progress(int(hit.sum()) * t.dim * 4)
            filled |= hit
        if not filled.all():
            missing = mine[~filled][:5].tolist()
            raise CheckpointError(f"{where}: table {t.name!r}: rows {missing} are in no file of the checkpoint.")
        for slot in slots:
            staged[(t.name, slot)] = torch.from_numpy(out[slot])
    return staged


def _read_stale(
    where: Path, manifest: dict[str, Any], resolved: ResolvedConfig, shards: dict[str, LocalShard]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pre-update values saved for a pending pipelined update: per table, this rank's rows among them
    as (positions in its shard [U], values [U, D])."""
    out = {}
    for t in resolved.tables:
        mine = shards[t.name].rows.detach().to("cpu", torch.int64).numpy()
        rows_parts, value_parts = [], []
        for entry in manifest["files"]:
            block = entry["tables"][t.name]
            if "stale_rows" not in block:
                continue
            file = where / entry["file"]
            mm = np.memmap(file, dtype=np.uint8, mode="r")
            rows = _block(mm, block["stale_rows"], np.int64, (block["stale_rows"]["count"],), file, t.name)
            values = _block(mm, block["stale"], np.float32, tuple(block["stale"]["shape"]), file, t.name)
            pos = np.searchsorted(mine, rows)
            ok = (pos < mine.size) & (mine[np.minimum(pos, max(mine.size - 1, 0))] == rows) if mine.size else rows < 0
            rows_parts.append(pos[ok])
            value_parts.append(values[ok])
        if rows_parts:
            out[t.name] = (torch.from_numpy(np.concatenate(rows_parts)), torch.from_numpy(np.concatenate(value_parts)))
    return out


def _copy_checked(
    mm: np.ndarray[Any, Any],
    spec: dict[str, Any],
    out: np.ndarray[Any, Any],
    file: Path,
    what: str,
    progress: Callable[[int], None],
) -> None:
    """Copy a float32 block of the shape of ``out`` into it, checking its CRC-32 on the way."""
    if [int(x) for x in spec["shape"]] != list(out.shape):
        raise CheckpointError(f"{file}: the block of {what!r} has shape {spec['shape']}, expected {list(out.shape)}.")
    start, nbytes = int(spec["offset"]), out.size * 4
    if start < 0 or start + nbytes > mm.size:
        raise CheckpointError(f"{file}: the block of {what!r} lies outside the file (truncated or corrupt).")
    flat = out.reshape(-1).view(np.uint8)
    crc, piece = 0, 4 << 20
    with open(file, "rb", buffering=0) as f:  # read() copies from the page cache once, no page faults
        f.seek(start)
        for at in range(0, nbytes, piece):
            chunk = flat[at : at + piece]
            if f.readinto(chunk.data) != chunk.size:
                raise CheckpointError(f"{file}: the block of {what!r} is truncated.")
            crc = zlib.crc32(chunk.data, crc)
            progress(chunk.size)
    if crc != spec["crc32"]:
        raise CheckpointError(f"{file}: the block of {what!r} fails its CRC-32 check (the file is corrupt).")


def _block(
    mm: np.ndarray[Any, Any], spec: dict[str, Any], dtype: Any, shape: tuple[int, ...], file: Path, what: str
) -> np.ndarray[Any, Any]:
    """A block of ``mm`` as an array, after checking that it lies inside the file and its CRC-32."""
    count = int(np.prod(shape)) if shape else 0
    start, nbytes = int(spec["offset"]), count * np.dtype(dtype).itemsize
    if start < 0 or start + nbytes > mm.size:
        raise CheckpointError(f"{file}: the block of {what!r} lies outside the file (truncated or corrupt).")
    raw = mm[start : start + nbytes]
    if zlib.crc32(np.ascontiguousarray(raw).data) != spec["crc32"]:
        raise CheckpointError(f"{file}: the block of {what!r} fails its CRC-32 check (the file is corrupt).")
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
