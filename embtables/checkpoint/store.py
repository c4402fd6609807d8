"""Checkpoints of sharded tables: every rank writes its own rows, any number of ranks reads them back.

Layout of a checkpoint directory ``<root>/ckpt-<step:08d>/``:

- ``manifest.json``: ``format_version``, ``step``, ``world_size`` and ``strategies`` of the writer,
  the config as data (tables: name, V, D, combiner, optimizer class and arguments; features), the
  module's ``settings`` (pipelining), the caller's ``extra`` JSON, and one entry per data file with
  its size and, per table, where its ``rows`` block and each ``state`` block lie and their CRC-32
  (``checkpoint.manifest`` checks every value on reading).
- ``rank-<r:05d>.safetensors``, one per writing rank, in the safetensors format (an 8-byte header
  length, a JSON header naming every tensor with its dtype, shape and byte range, then the raw
  little-endian data). Per table it holds ``<table>#rows``, the int64 global row ids the rank owns
  (ascending), then one ``[N, D]`` tensor per state key: ``<table>`` for the weights and
  ``<table>/<slot>`` for each TF slot name, in the table's storage type (float32; bfloat16 or float16 for a
  half-precision table's, its manifest then of format 3 and each such block's spec naming its ``dtype``).

The safetensors library, numpy or any safetensors reader opens the files; the manifest repeats
where every block is, with its CRC-32. A save writes into
``<root>/.embtables-tmp-ckpt-<host>-<pid>-<id>/`` and publishes it with one atomic rename (an atomic
exchange when the step is saved again) after every rank has finished and the manifest is fsynced.
A killed save never leaves a published partial checkpoint; its leftovers are removed by the next
save on that host once their writer is dead. Checkpoints are ordered by the step in their manifest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embtables.checkpoint import dynamic_restore, increments, streaming_restore
from embtables.checkpoint import manifest as manifest_io
from embtables.checkpoint.blocks import (
    ArrayBlock,
    Block,
    OffloadedGroup,
    RowSelection,
    open_rank_files,
    read_block,
    row_ids,
    write_block,
)
from embtables.checkpoint.config_record import check_config, config_as_data
from embtables.checkpoint.file_names import CheckpointError as CheckpointError
from embtables.checkpoint.owned_dirs import WriterLock, clean_dead_leftovers, fsync_dir, publish, temp_name
from embtables.checkpoint.serving_codec import MARKER as EXPORT_MARKER
from embtables.config import ResolvedConfig
from embtables.kernels import storage_types
from embtables.sharding import comm
from embtables.tables.state import LocalShard

logger = logging.getLogger("embtables")

FORMAT_VERSION = manifest_io.FORMAT_VERSION
_PREFIX = "ckpt-"
_NAME = re.compile(r"ckpt-(\d{1,19})")


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


_warned: set[str] = set()


def _warn_once(message: str, *args: object) -> None:
    """Log ``message % args`` once per process (latest-lookups run at every save)."""
    key = f"{message}|{args}"
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _step_of(path: Path) -> int | None:
    """The step in ``path``'s manifest, or None (with a warning) when it cannot be read."""
    try:
        doc = json.loads((path / manifest_io.MANIFEST).read_bytes())
        step = doc["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not a non-negative integer")
        return step
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        _warn_once("embtables: ignoring %s: its manifest cannot be read (%s).", path, exc)
        return None


def published(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root`` (``ckpt-<digits>`` with a readable manifest), ordered by the
    step in their manifests, oldest first. Other directories with a manifest (a copy named
    ``ckpt-best``) and unreadable manifests are ignored with a warning."""
    base = Path(root)
    if not base.is_dir():
        return []
    found: list[tuple[int, int, Path]] = []
    for p in base.iterdir():
        if not (p / manifest_io.MANIFEST).is_file():
            continue
        m = _NAME.fullmatch(p.name)
        if m is None:
            _warn_once(
                "embtables: ignoring %s when looking for the latest checkpoint: its name is not ckpt-<step>. "
                "Pass its path to restore() to load it.", p,
            )  # fmt: skip
            continue
        step = _step_of(p)
        if step is not None:
            found.append((step, int(m[1]), p))
    return [p for _, _, p in sorted(found)]


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is a checkpoint, else the latest checkpoint under it."""
    p = Path(path)
    if (p / manifest_io.MANIFEST).is_file():
        return p
    done = published(p)
    if not done:
        export = next((d for d in (p, p / "tables") if (d / EXPORT_MARKER).is_file()), None)
        hint = (
            f" It holds a serving export ({export}: embtables export wrote it, ServingEmbedding.load reads it; a model "
            "artifact keeps one in tables/); inspect, restore and export read the checkpoint it was made from."
            if export is not None else ""
        )  # fmt: skip
        raise CheckpointError(
            f"no checkpoint at {p}: neither a manifest.json there nor a ckpt-<step> directory with one.{hint}"
        )
    return done[-1]


def agree(error: str | None, group: comm.ProcessGroup | None, what: str) -> None:
    """One agreement round: when any rank reports an error, every rank raises the same
    ``CheckpointError`` naming each failing rank and its cause."""
    _raise_if_any(comm.all_gather_object(error, group), what)


def _raise_if_any(errors: list[str | None], what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        if len(errors) == 1:
            raise CheckpointError(bad[0][1])
        raise CheckpointError(f"{what} failed, on every rank: " + "; ".join(f"rank {r}: {e}" for r, e in bad))


def _caught(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, the error as text)`` for an error of this rank's own making."""
    try:
        return fn(), None
    except comm.CollectiveError:
        raise
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)


@dataclasses.dataclass(frozen=True)
class PlannedBlock:
    """One block of a rank file: its table, its kind (``rows``, ``state``, ``vocabulary``, ``stale_rows``,
    ``stale``), its tensor name in the file, and its source."""

    table: str
    kind: str
    name: str
    block: Block


def _plan(
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    stale: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
    vocabularies: dict[str, dict[str, torch.Tensor]] | None = None,
    changed: dict[str, torch.Tensor] | None = None,
) -> list[PlannedBlock]:
    """Every block of this rank's file in order. A dynamic table's vocabulary (``vocabularies[table][field]``, [N]
    by the shard's rows) is one block per field. ``changed`` (an increment): per table, the local rows [R]
    (ascending) to write; the others are left out."""
    plan: list[PlannedBlock] = []
    for t in resolved.tables:
        shard = shards[t.name]
        pick = None if changed is None or t.name not in changed else changed[t.name].to(shard.rows.device, torch.int64)
        rows = shard.rows if pick is None else shard.rows[pick]
        plan.append(PlannedBlock(t.name, "rows", f"{t.name}#rows", _ids(rows)))
        group = None if pick is not None or shard.offloaded is None else OffloadedGroup(shard.offloaded, len(rows))
        for slot, tensor in shard.tensors.items():
            key = f"{t.name}/{slot}" if slot else t.name
            block: Block
            if group is not None:  # from its files, a piece of records at a time for all of its blocks
                block = group.block(slot)
            elif pick is None and tensor.dtype == torch.float32:
                block = ArrayBlock(tensor.detach().to("cpu").numpy().reshape(-1, t.dim))
            else:  # an increment's rows, or a half-precision table's (in its type), a piece at a time
                if shard.offloaded is not None:
                    shard.offloaded.mark_untracked()  # the changed rows are gathered through its maps
                block = RowSelection(tensor, pick, t.dim)
            plan.append(PlannedBlock(t.name, "state", key, block))
        for field, values in (vocabularies or {}).get(t.name, {}).items():
            plan.append(PlannedBlock(t.name, "vocabulary", f"{t.name}#{field}", _ids(values)))
        if stale and t.name in stale:
            # a half table's pre-update rows widen to float32 exactly (the stale block is float32 in every format)
            old = stale[t.name][1].detach().to("cpu", torch.float32).contiguous().numpy()
            plan.append(PlannedBlock(t.name, "stale_rows", f"{t.name}#stale_rows", _ids(stale[t.name][0])))
            plan.append(PlannedBlock(t.name, "stale", f"{t.name}#stale", ArrayBlock(old.reshape(-1, t.dim))))
    return plan


def _ids(rows: torch.Tensor) -> ArrayBlock:
    return ArrayBlock(rows.detach().to("cpu", torch.int64).contiguous().numpy())


_SAFETENSORS_DTYPES = {t.name: t.safetensors for t in storage_types.STORAGE_TYPES}


def _write_rank_file(
    data: Path, resolved: ResolvedConfig, plan: list[PlannedBlock], rank: int, step: int, tick: Callable[[int], None]
) -> dict[str, Any]:
    """Write one safetensors file (its JSON header lists every tensor's dtype, shape and byte range)
    streaming each block from the live storage; returns the file's manifest entry (fsynced)."""
    header: dict[str, Any] = {"__metadata__": {"format": "embtables", "rank": str(rank), "step": str(step)}}
    at = 0
    for p in plan:
        nbytes = p.block.size * p.block.itemsize
        dtype = "I64" if p.block.dtype == np.int64 else _SAFETENSORS_DTYPES[p.block.stored]
        header[p.name] = {"dtype": dtype, "shape": [int(x) for x in p.block.shape], "data_offsets": [at, at + nbytes]}
        at += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads its header to 8 bytes
    start = 8 + len(encoded)
    blocks: dict[str, Any] = {t.name: {"state": {}} for t in resolved.tables}
    with open(data, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for p in plan:
            spec: dict[str, Any] = {"offset": start + header[p.name]["data_offsets"][0]}
            if p.block.ndim == 1:
                spec["count"] = int(p.block.size)
            else:
                spec["shape"] = [int(x) for x in p.block.shape]
                if p.block.stored != "float32":  # half values (format 3); float32 blocks say nothing (format 2)
                    spec["dtype"] = p.block.stored
            spec["crc32"] = write_block(f, p.block, tick)
            if p.kind == "state":
                blocks[p.table]["state"][p.name] = spec
            elif p.kind == "vocabulary":
                blocks[p.table].setdefault("vocabulary", {})[p.name.rpartition("#")[2]] = spec
            else:
                blocks[p.table][p.kind] = spec
        f.flush()
        os.fsync(f.fileno())
    return {"file": data.name, "bytes": data.stat().st_size, "tables": blocks}


@dataclasses.dataclass(frozen=True)
class _Proposal:
    """What one rank proposes in a save's first agreement round: the root (absolute), the temporary directory's
    name, the checkpoint id, the checkpoint an increment would build on (its chain entry; None: a full
    checkpoint), and the rows this rank would write of all it holds (an increment's count against the whole)."""

    root: str
    tmp: str
    checkpoint_id: str
    chain: dict[str, Any] | None
    changed: int
    total: int


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """A save's arguments besides the state (see ``save``)."""

    strategies: dict[str, str] | None
    extra: dict[str, Any] | None
    keep_last: int | None
    settings: dict[str, Any] | None


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
    settings: dict[str, Any] | None = None,
    vocabularies: dict[str, dict[str, torch.Tensor]] | None = None,
    checkpoint_id: str | None = None,
    incremental: increments.IncrementalSave | None = None,
) -> Path:
    """Write a checkpoint of ``shards`` (this rank's rows of every table) and return its directory.

    Collective when ``group`` (or the default group) spans several ranks: each rank writes its own
    file in parallel, rank 0 writes the manifest and publishes. Three agreement rounds (arguments and
    directory: ``_agree_on_the_save``; rank files: ``_write_files``; publication: ``_publish_agreed``) make every
    rank raise the same ``CheckpointError`` or none.
    ``keep_last=N`` then deletes all but the N newest checkpoints under ``root`` (by manifest step).
    ``stale`` holds, per table, global rows [U] and their values before a pipelined update [U, D] that
    the next training lookup must still read. ``settings`` (JSON) records module settings.
    ``vocabularies`` holds each dynamic table's key map by the shard's rows (spec §11). ``checkpoint_id``:
    the manifest's id (the same on every rank; a new one when None). ``incremental``: an increment on the newest
    checkpoint under ``root`` when it is the one the changed rows count from (``checkpoint.increments``), else a
    full checkpoint, logged."""
    base = Path(root)
    options = SaveOptions(strategies, extra, keep_last, settings)
    agreed, picks, error = _agree_on_the_save(base, resolved, shards, step, options, group, checkpoint_id, incremental)
    rank, tmp = comm.get_rank(group), base / agreed.tmp
    what = f"save of step {step} to {base}"
    lock = WriterLock(base, ".embtables-save.lock", f"save of step {step}")
    if error is None and rank == 0:
        _, error = _caught(lambda: _make_dirs(base, tmp, lock))
    try:
        agree(error, group, what)
        plan = _plan(resolved, shards, stale, vocabularies, None if agreed.chain is None else picks)
        files = _write_files(tmp, resolved, plan, step, progress or (lambda n: None), group, what)
        error = None
        if rank == 0:
            _, error = _caught(lambda: _publish(base, tmp, step, comm.get_world_size(group), resolved, options, files,
                                                agreed.checkpoint_id, agreed.chain))  # fmt: skip
        agree(error, group, what)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
    return checkpoint_dir(base, step)


def _agree_on_the_save(
    base: Path, resolved: ResolvedConfig, shards: dict[str, LocalShard], step: int, options: SaveOptions,
    group: comm.ProcessGroup | None, checkpoint_id: str | None, incremental: increments.IncrementalSave | None,
) -> tuple[_Proposal, dict[str, torch.Tensor] | None, str | None]:  # fmt: skip
    """The first agreement round: every rank checks the arguments and proposes where to write and whether an
    increment can be written (``_Proposal``); returns rank 0's proposal as agreed (a full checkpoint when more
    than ``increments.FULL_ABOVE`` of all rows changed), this rank's changed rows per fixed table (an
    increment's picks), and this rank's error or a disagreement (raised by the next round on every rank)."""
    world = comm.get_world_size(group)
    own_id: str = checkpoint_id or increments.new_id()

    def check_arguments() -> dict[str, Any] | None:
        keep = options.keep_last
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"save: keep_last must be an int >= 1 or None, got {keep!r}.")
        try:
            json.dumps(options.extra or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"save: `extra` must be JSON data (dicts, lists, str, finite numbers): {exc}.") from exc
        if base.exists() and not base.is_dir():
            raise CheckpointError(f"save: {base} is a file, not a directory; pass a directory for the checkpoints.")
        if incremental is None:
            return None
        newest = published(base)
        return increments.previous_for_increment(
            newest[-1] if newest else None, incremental.base_id, incremental.full_every, read_manifest, step
        )

    # this rank's changed local rows, per fixed table; a dynamic table goes whole into an increment (its key
    # map with it: the rows of keys admitted and evicted since, and every key's row, as a full checkpoint has)
    dynamic = {t.name for t in resolved.tables if t.config.dynamic is not None}
    changed_rows, error = _caught(lambda: None if incremental is None else incremental.changed_rows())
    picks = None if changed_rows is None else {n: p for n, p in changed_rows.items() if n not in dynamic}
    changed = total = 0
    if picks is not None:
        changed = sum(shards[n].rows.numel() for n in dynamic) + sum(int(p.numel()) for p in picks.values())
        total = sum(s.rows.numel() for s in shards.values())
    chain, arguments_error = _caught(check_arguments)
    error = error or arguments_error
    mine = _Proposal(os.path.abspath(base), temp_name("ckpt"), own_id, chain, changed, total)
    everyone: list[_Proposal] = comm.all_gather_object(mine, group)
    if error is None and world > 1 and len({p.root for p in everyone}) > 1:
        paths = ", ".join(f"rank {r}: {p.root}" for r, p in enumerate(everyone))
        error = f"the ranks passed different paths ({paths})"
    if error is None and world > 1 and len({json.dumps(p.chain, sort_keys=True) for p in everyone}) > 1:
        error = (
            "the ranks see different checkpoints to build an increment on (a root on storage the ranks do not share?)"
        )
    agreed = everyone[0]
    changed, total = sum(p.changed for p in everyone), sum(p.total for p in everyone)
    if agreed.chain is not None and changed > increments.FULL_ABOVE * total:
        increments.full_writes.info(
            "embtables: save(incremental=True) writes a full checkpoint: %d of %d rows changed.", changed, total
        )
        agreed = dataclasses.replace(agreed, chain=None)
    return agreed, picks, error


def _write_files(
    tmp: Path, resolved: ResolvedConfig, plan: list[PlannedBlock], step: int, tick: Callable[[int], None],
    group: comm.ProcessGroup | None, what: str,
) -> list[dict[str, Any]]:  # fmt: skip
    """The second agreement round: every rank writes its file; returns every file's manifest entry (rank order),
    or raises the same ``CheckpointError`` on every rank when any failed."""
    rank = comm.get_rank(group)
    data = tmp / f"rank-{rank:05d}.safetensors"
    mine, error = _caught(lambda: _write_rank_file(data, resolved, plan, rank, step, tick))
    gathered = comm.all_gather_object((error, mine), group)
    _raise_if_any([e for e, _ in gathered], what)
    return [m for _, m in gathered]


def _make_dirs(base: Path, tmp: Path, lock: WriterLock) -> None:
    base.mkdir(parents=True, exist_ok=True)
    lock.acquire()  # one save into a root at a time: two writers would replace each other's steps
    tmp.mkdir()


def _publish(
    base: Path, tmp: Path, step: int, world: int, resolved: ResolvedConfig, options: SaveOptions,
    files: list[dict[str, Any]], checkpoint_id: str, chain: dict[str, Any] | None,
) -> Path:  # fmt: skip
    """Rank 0: write the manifest, publish the directory atomically, apply ``keep_last`` (never to a
    checkpoint that a kept one builds on)."""
    half = any(
        "dtype" in spec for entry in files for table in entry["tables"].values() for spec in table["state"].values()
    )
    manifest: dict[str, Any] = {
        "format_version": manifest_io.HALF_FORMAT_VERSION if half else FORMAT_VERSION,
        "id": checkpoint_id,
        "step": int(step),
        "world_size": world,
        "strategies": options.strategies or {t.name: "div" for t in resolved.tables},
        "config": config_as_data(resolved),
        "settings": options.settings or {},
        "extra": options.extra or {},
        "files": files,
    }
    if chain is not None:
        manifest["chain"] = chain
    with open(tmp / manifest_io.MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final = checkpoint_dir(base, step)
    aside = _aside_if_different(final, manifest)
    old = publish(tmp, final)  # the same step saved again: the new one replaces it atomically
    if old is not None and aside is not None:
        os.replace(old, aside)
        logger.warning(
            "embtables: save of step %d replaced %s, which held other values (the tables changed without a training "
            "step: a load_state_dict, a refused step, edits); the earlier checkpoint was kept as %s (restore() takes "
            "its path; remove it when it is not needed).", step, final, aside,
        )  # fmt: skip
    fsync_dir(base)
    if old is not None and aside is None:
        shutil.rmtree(old, ignore_errors=True)
    if options.keep_last is not None:
        every = published(base)
        kept = increments.needed(every[-options.keep_last :], read_manifest)
        for stale_ckpt in every[: -options.keep_last]:
            if stale_ckpt not in kept:
                shutil.rmtree(stale_ckpt, ignore_errors=True)
    for kind in ("ckpt", "trash"):  # left by saves killed midway, on this host, by dead processes
        clean_dead_leftovers(base, kind)
    return final


def _aside_if_different(final: Path, manifest: dict[str, Any]) -> Path | None:
    """Where the checkpoint at ``final`` is kept when a save of the same step replaces it with other contents
    (``ckpt-<step>-replaced-<its id>``); None when there is none, or it holds the same blocks (every block's
    CRC-32 and place, the same config and extra data), when it is replaced."""
    if not final.exists():
        return None
    try:
        old = json.loads((final / manifest_io.MANIFEST).read_bytes())
        same = all(old.get(key) == json.loads(json.dumps(manifest[key])) for key in ("files", "config", "extra"))
        same = same and "chain" not in old and "chain" not in manifest
        old_id = str(old.get("id", "unknown"))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        same, old_id = False, "unreadable"
    if same:
        return None
    safe = re.sub(r"[^A-Za-z0-9_-]", "", old_id)[:16] or "unknown"
    aside, n = final.parent / f"{final.name}-replaced-{safe}", 1
    while aside.exists():
        n += 1
        aside = final.parent / f"{final.name}-replaced-{safe}-{n}"
    return aside


def read_manifest(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory at (or latest under) ``path`` and its manifest, every value checked
    (see ``checkpoint.manifest``); ``CheckpointError`` otherwise."""
    where = resolve_path(path)
    return where, manifest_io.load(where)


def restore(
    path: str | os.PathLike[str],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
    *,
    progress: Callable[[int], None] | None = None,
    group: comm.ProcessGroup | None = None,
    dynamic: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor], str]] | None = None,
) -> dict[str, Any]:
    """Fill ``shards`` (this rank's rows, live storage) from a checkpoint written by any number of
    ranks with any strategy; returns the manifest, with ``"dynamic"``: per dynamic table, the
    vocabulary arrays of its key map (``dynamic_restore``). ``dynamic`` gives, per dynamic table, its
    key map's capacity, which keys this rank owns (``owns(keys) -> bool mask``) and its strategy. Every
    manifest value and every block read is checked (size, range of row ids, CRC-32) before anything
    is written, and every rank agrees: on any error every rank raises ``CheckpointError`` naming the
    rank, file and table, and no shard changes anywhere."""
    tick = progress or (lambda n: None)
    files: dict[str, Any] = {}

    def verify() -> tuple[dict[str, Any], list[Any]]:
        where, manifest = read_manifest(path)
        check_config(manifest, resolved, where)
        chain = increments.resolve_chain(where, manifest, read_manifest)
        # a dynamic table is whole in every link: it is read from ``where`` alone (below); fixed tables by link
        maps = open_rank_files(where, manifest)
        by_row = tuple(t for t in resolved.tables if t.config.dynamic is None)
        fixed = dataclasses.replace(resolved, tables=by_row)
        plans = []
        for i, (link, link_manifest) in enumerate(chain):  # the full checkpoint, then its increments in order
            check_config(link_manifest, resolved, link)
            link_files = streaming_restore.open_files(link, link_manifest)
            files.update({f"{link.name}/{name}": f for name, f in link_files.items()})
            plans.append(streaming_restore.verify(link, link_manifest, fixed, shards, link_files, tick, partial=i > 0))
        restores = {}
        for t in resolved.tables:
            if t.config.dynamic is None:
                continue
            capacity, owns, strategy = (dynamic or {})[t.name]
            saved = manifest["config"]["tables"][t.name]
            same = (
                manifest["world_size"] == comm.get_world_size(group)
                and saved["vocabulary_size"] == t.vocabulary_size
                and manifest["strategies"].get(t.name) == strategy
            )
            restores[t.name] = dynamic_restore.read(
                where, manifest, maps, t, shards[t.name], capacity, owns, same, read_block, row_ids
            )
            if same:
                by_row += (t,)  # its rows are the writer's: a pending pipelined update's old values still apply
        manifest["stale"] = _read_stale(where, manifest, maps, dataclasses.replace(resolved, tables=by_row), shards)
        manifest["dynamic"] = restores
        return manifest, plans

    try:
        verified, error = _caught(verify)  # pass 1: every block this rank needs, checked; nothing written
        agree(error, group, f"restore from {path}")
        _, error = _caught(lambda: streaming_restore.unchanged(files))
        agree(error, group, f"restore from {path}")
        manifest, plans = verified

        def write() -> None:  # pass 2: into place, the full checkpoint first, then each increment
            for link_plans in plans:
                streaming_restore.write(link_plans, shards, tick)
            dynamic_restore.write(manifest["dynamic"], shards)

        _, error = _caught(write)
        errors = comm.all_gather_object(error, group)
        if any(e is not None for e in errors):  # a file changed under pass 2: every rank's tables are suspect
            message = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
            raise streaming_restore.TornRestore(f"restore from {path} was interrupted, on every rank: {message}")
    finally:
        streaming_restore.close(files)
    out = dict(manifest)
    out["dynamic"] = {name: r.arrays for name, r in manifest["dynamic"].items()}
    return out


def _read_stale(
    where: Path,
    manifest: dict[str, Any],
    maps: dict[str, np.ndarray[Any, Any]],
    resolved: ResolvedConfig,
    shards: dict[str, LocalShard],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pre-update values saved for a pending pipelined update: per table, this rank's rows among them
    as (positions in its shard [U], values [U, D])."""
    out = {}
    for t in resolved.tables:
        mine = shards[t.name].rows.detach().to("cpu", torch.int64).numpy()
        rows_parts, value_parts = [], []
        for entry in manifest["checked_files"]:
            blocks = entry["blocks"][t.name]
            if blocks.stale_rows is None or blocks.stale is None:
                continue
            file, mm = where / entry["file"], maps[entry["file"]]
            rows = row_ids(mm, blocks.stale_rows, file, t.name, t.vocabulary_size, ascending=False)
            values = read_block(mm, blocks.stale, file, f"{t.name}#stale")
            pos = np.searchsorted(mine, rows)
            ok = (pos < mine.size) & (mine[np.minimum(pos, max(mine.size - 1, 0))] == rows) if mine.size else rows < 0
            rows_parts.append(pos[ok])
            value_parts.append(values[ok])
        if rows_parts:
            out[t.name] = (torch.from_numpy(np.concatenate(rows_parts)), torch.from_numpy(np.concatenate(value_parts)))
    return out
