"""Lookup statistics (``profile_data_directory``, spec §5): what the ids of sampled batches look like per
table, written as one JSON file per table and read back to plan table placement.

Sampling is per step and seeded: step ``s`` is sampled when a hash of ``(seed, s)`` falls under
``sample_rate``, so every rank samples the same steps without a message. Per table, over the sampled
batches, it records:

- ``ids_per_sample``: mean ids looked up per sample (bag), per feature;
- ``ids_per_batch`` / ``unique_ids_per_batch``: mean ids and distinct ids of this rank's batch;
- ``ids_per_shard`` / ``unique_ids_per_shard``: ids (and distinct ids per batch) landing on each
  rank's shard, summed over sampled batches; ``load_balance`` is their max / mean (1.0 is perfect);
- ``hottest_rows``: the most frequent ids with their counts (exact over the sampled batches up to
  ``HOT_CAPACITY`` distinct candidates per table, then the least counted are evicted: an
  approximation that keeps the heavy hitters of a Zipf stream);
- ``dropped_ids``: ids in the input that were not looked up (negative or zero-weight ids pruned by
  ``validate_weights_and_indices``, sequence positions past ``max_sequence_length``).

Files are named by a stable hash of the table's parameters (name, vocabulary size, dim, number of
features) and the global ones (strategy, world size), written atomically (a temporary file, fsync,
rename) and merged with an existing file of the same name, so a directory can be shared by runs.
Statistics never change numerics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.sharding.plan import TablePlan

logger = logging.getLogger("embtables")

FORMAT_VERSION = 1
HOT_CAPACITY = 4096
_MASK64 = (1 << 64) - 1


def sampled(step: int, seed: int, rate: float) -> bool:
    """Whether ``step`` is sampled: splitmix64 of (seed, step) mapped to [0, 1) compared with ``rate``."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53) < rate


def table_key(table: ResolvedTable) -> dict[str, Any]:
    """The table parameters a statistics file is keyed by."""
    return {
        "name": table.name,
        "vocabulary_size": table.vocabulary_size,
        "dim": table.dim,
        "num_features": len(table.feature_indices),
    }


def stats_filename(table: ResolvedTable, strategy: str, world_size: int) -> str:
    """``<table>-<16 hex digits>.json``: sha256 of the table parameters, the strategy and the world size."""
    key = {**table_key(table), "strategy": strategy, "world_size": world_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", table.name)[:64]
    return f"{safe}-{digest}.json"


@dataclasses.dataclass(frozen=True)
class TableLoad:
    """Measured lookup load of a table (from a statistics file)."""

    ids_per_batch: float
    unique_ids_per_batch: float
    batches: int
    samples_per_batch: float = 0.0  # bags of all the table's features per batch (0: unknown)


def _empty(table: ResolvedTable, world: int) -> dict[str, Any]:
    return {
        "batches": 0,
        "samples": [0] * len(table.feature_indices),
        "ids": [0] * len(table.feature_indices),
        "unique_ids": 0,
        "ids_per_shard": [0] * world,
        "unique_ids_per_shard": [0] * world,
        "dropped_ids": 0,
        "hot": {},
    }


class LookupStatsRecorder:
    """Accumulates one rank's statistics of sampled batches (see the module docstring)."""

    def __init__(
        self, resolved: ResolvedConfig, plans: dict[str, TablePlan], sample_rate: float = 0.03, seed: int = 0
    ) -> None:
        if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
            raise ValueError(f"lookup statistics: sample_rate must be in (0, 1], got {sample_rate!r}.")
        self.resolved = resolved
        self.plans = plans
        self.sample_rate = float(sample_rate)
        self.seed = int(seed)
        self.world = next(iter(plans.values())).world_size if plans else 1
        self.tables = {t.name: _empty(t, self.world) for t in resolved.tables}

    def should_sample(self, step: int) -> bool:
        return sampled(step, self.seed, self.sample_rate)

    def record(self, ids: Sequence[Tensor], bags: Sequence[int], dropped: Sequence[int]) -> None:
        """Add one batch: per feature, its looked-up ids [N_f], number of samples and dropped ids."""
        for t in self.resolved.tables:
            acc = self.tables[t.name]
            acc["batches"] += 1
            parts = [ids[f] for f in t.feature_indices]
            for k, f in enumerate(t.feature_indices):
                acc["samples"][k] += int(bags[f])
                acc["ids"][k] += int(parts[k].numel())
                acc["dropped_ids"] += int(dropped[f])
            every = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
            unique, counts = torch.unique(every, return_counts=True)
            acc["unique_ids"] += int(unique.numel())
            plan = self.plans[t.name]
            owner_all, _ = plan.owner(every)
            owner_unique, _ = plan.owner(unique)
            for r, n in enumerate(torch.bincount(owner_all, minlength=self.world).tolist()):
                acc["ids_per_shard"][r] += int(n)
            for r, n in enumerate(torch.bincount(owner_unique, minlength=self.world).tolist()):
                acc["unique_ids_per_shard"][r] += int(n)
            _add_hot(acc["hot"], zip(unique.tolist(), counts.tolist()))

    def state(self) -> dict[str, Any]:
        """This rank's raw counts (JSON-able), for ``merge`` across ranks."""
        return json.loads(json.dumps(self.tables))  # type: ignore[no-any-return]

    def reset(self) -> None:
        self.tables = {t.name: _empty(t, self.world) for t in self.resolved.tables}


def _add_hot(hot: dict[str, int], items: Any) -> None:
    for row, n in items:
        hot[str(row)] = hot.get(str(row), 0) + int(n)
    if len(hot) > HOT_CAPACITY:
        keep = sorted(hot.items(), key=lambda kv: (-kv[1], int(kv[0])))[: HOT_CAPACITY // 2]
        hot.clear()
        hot.update(keep)


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Add the raw counts of several ranks (or runs) table by table: sums, never averages of averages.
    Each rank's local batch counts as a batch, so ``ids_per_batch`` stays per local batch."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, acc in part.items():
            if name not in out:
                out[name] = json.loads(json.dumps(acc))
                continue
            dst = out[name]
            for key in ("samples", "ids", "ids_per_shard", "unique_ids_per_shard"):
                dst[key] = [a + b for a, b in zip(dst[key], acc[key])]
            dst["unique_ids"] += acc["unique_ids"]
            dst["dropped_ids"] += acc["dropped_ids"]
            dst["batches"] += acc["batches"]
            dst["hot"] = dict(dst["hot"])
            _add_hot(dst["hot"], acc["hot"].items())
    return out


def summary(acc: dict[str, Any], top_k: int = 16) -> dict[str, Any]:
    """Derived figures of one table's raw counts (what the files and the CLI show)."""
    batches = max(1, acc["batches"])
    shard = acc["ids_per_shard"]
    mean_shard = sum(shard) / len(shard) if shard else 0.0
    hot = sorted(acc["hot"].items(), key=lambda kv: (-kv[1], int(kv[0])))[:top_k]
    return {
        "ids_per_sample": [i / s if s else 0.0 for i, s in zip(acc["ids"], acc["samples"])],
        "ids_per_batch": sum(acc["ids"]) / batches,
        "unique_ids_per_batch": acc["unique_ids"] / batches,
        "load_balance": (max(shard) / mean_shard) if mean_shard else 1.0,
        "unique_load_balance": _balance(acc["unique_ids_per_shard"]),
        "hottest_rows": [[int(k), v] for k, v in hot],
    }


def _balance(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def write_stats(
    directory: str | os.PathLike[str],
    merged: dict[str, Any],
    resolved: ResolvedConfig,
    strategies: dict[str, str],
    world_size: int,
    vocabulary: dict[str, dict[str, int]] | None = None,
    offload: dict[str, dict[str, float]] | None = None,
) -> list[Path]:
    """Write (merging with what is there) one JSON file per table, atomically; returns the paths. A
    dynamic table's file also holds its ``vocabulary`` statistics now (admitted, evicted, rejected, live
    rows...: cumulative, so the latest replaces the file's); its ids are rows, not keys. An offloaded table's
    holds its row cache's counters (``offload``: ``OffloadedRows.statistics`` summed over the ranks; cumulative
    too)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for t in resolved.tables:
        acc = merged.get(t.name)
        if acc is None or acc["batches"] == 0:
            continue
        path = root / stats_filename(t, strategies[t.name], world_size)
        previous = _read(path)
        if previous is not None and len(previous["counts"]["ids_per_shard"]) == len(acc["ids_per_shard"]):
            acc = merge([{t.name: previous["counts"]}, {t.name: acc}])[t.name]
        doc = {
            "format_version": FORMAT_VERSION,
            "table": table_key(t),
            "strategy": strategies[t.name],
            "world_size": world_size,
            "summary": summary(acc),
            "counts": acc,
        }
        if vocabulary and t.name in vocabulary:
            doc["vocabulary"] = vocabulary[t.name]
        if offload and t.name in offload:
            doc["offload"] = offload[t.name]
        _atomic_write(path, json.dumps(doc, indent=1, sort_keys=True))
        paths.append(path)
    return paths


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) <= 1 << 20 and all(_nonneg_int(v) for v in x)


def _check_counts(counts: Any) -> None:
    """Raise ValueError naming the field when ``counts`` is not the raw counts this module writes."""
    if not isinstance(counts, dict):
        raise ValueError("`counts` is not an object")
    for key in ("batches", "unique_ids", "dropped_ids"):
        if not _nonneg_int(counts.get(key)):
            raise ValueError(f"counts.{key} is not a non-negative integer")
    for key in ("samples", "ids", "ids_per_shard", "unique_ids_per_shard"):
        if not _int_list(counts.get(key)):
            raise ValueError(f"counts.{key} is not a list of non-negative integers")
    if len(counts["samples"]) != len(counts["ids"]) or len(counts["ids_per_shard"]) != len(
        counts["unique_ids_per_shard"]
    ):
        raise ValueError("counts lists of one kind differ in length")
    hot = counts.get("hot")
    if not isinstance(hot, dict) or not all(
        isinstance(k, str) and k.lstrip("-").isdigit() and len(k) < 24 and _nonneg_int(v) for k, v in hot.items()
    ):
        raise ValueError("counts.hot is not an object of row id -> count")


def _check_doc(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
        raise ValueError("not an embtables lookup statistics file (format_version)")
    table = doc.get("table")
    if not isinstance(table, dict) or not isinstance(table.get("name"), str):
        raise ValueError("`table` is not an object with a name")
    for key in ("vocabulary_size", "dim", "num_features"):
        if not _nonneg_int(table.get(key)):
            raise ValueError(f"table.{key} is not a non-negative integer")
    if not isinstance(doc.get("strategy"), str) or not _nonneg_int(doc.get("world_size")):
        raise ValueError("`strategy` or `world_size` is missing or malformed")
    _check_counts(doc.get("counts"))
    offload = doc.get("offload")
    if offload is not None and not (
        isinstance(offload, dict)
        and all(
            isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) and v >= 0 for k, v in offload.items()
        )
    ):
        raise ValueError("`offload` is not an object of counter name -> non-negative number")
    doc["summary"] = summary(doc["counts"])  # derived again: never trusted from the file
    return doc


def _read(path: Path) -> dict[str, Any] | None:
    """A statistics file, or None (with a warning naming the file and the problem) when it is missing,
    unreadable, malformed or not ours. Every field is checked before use."""
    if not path.exists():
        return None
    try:
        if path.stat().st_size > 64 << 20:
            raise ValueError("larger than 64 MiB")
        return _check_doc(json.loads(path.read_text()))
    except (OSError, ValueError, RecursionError) as exc:
        logger.warning("lookup statistics: ignoring %s (%s).", path, exc)
        return None


def read_all(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every valid statistics file in ``directory`` (others are skipped with a warning)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    docs = []
    for path in sorted(root.glob("*.json")):
        doc = _read(path)
        if doc is not None:
            doc["path"] = str(path)
            docs.append(doc)
    return docs


def read_loads(directory: str | os.PathLike[str] | None, resolved: ResolvedConfig) -> dict[str, TableLoad]:
    """Measured loads of this config's tables from ``directory`` (any strategy or world size: ids per
    batch do not depend on them); the file with the most sampled batches wins."""
    if directory is None:
        return {}
    keys = {t.name: table_key(t) for t in resolved.tables}
    best: dict[str, TableLoad] = {}
    for doc in read_all(directory):
        name = doc["table"].get("name")
        if name not in keys or doc["table"] != keys[name]:
            continue
        s, batches = doc["summary"], int(doc["counts"]["batches"])
        if name not in best or batches > best[name].batches:
            samples = sum(doc["counts"]["samples"]) / max(1, batches)
            best[name] = TableLoad(float(s["ids_per_batch"]), float(s["unique_ids_per_batch"]), batches, samples)
    return best
