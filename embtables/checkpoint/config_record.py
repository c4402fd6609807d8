"""The model's configuration as data in a checkpoint's manifest (``config_as_data``: tables, slots, storage types,
features and their nest, never pickles of code), and the check of a manifest's configuration against the model a
restore goes into (``check_config``: every mismatch named; another storage type is converted, logged)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embtables.checkpoint.file_names import CheckpointError
from embtables.config import ResolvedConfig
from embtables.sharding.fingerprint import describe_config

logger = logging.getLogger("embtables")


def config_as_data(resolved: ResolvedConfig) -> dict[str, Any]:
    """Tables and features as JSON data (never pickles of code; callables are recorded by kind)."""
    described = describe_config(resolved, {})
    for t in resolved.tables:
        d = described["tables"][t.name]
        d["slots"] = list(t.optimizer.slot_names)
        d["combiner_value"] = str(t.config.combiner)
        q = t.config.quantization_config
        d["quantization"] = None if q is None else [q.num_buckets, float(q.lower), float(q.upper)]
        d["dtype"], d["slot_dtype"] = t.config.storage, t.config.slot_storage  # each block also says its own
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


def check_config(manifest: dict[str, Any], resolved: ResolvedConfig, where: Path) -> None:
    """``CheckpointError`` naming every table whose size, kind or optimizer differs between the checkpoint at
    ``where`` and ``resolved``; a table stored in another type is logged (its blocks convert as they load)."""
    saved = manifest["config"]["tables"]
    problems = []
    for t in resolved.tables:
        s = saved.get(t.name)
        if s is None:
            problems.append(f"table {t.name!r} is not in the checkpoint (it has {sorted(saved)})")
            continue
        for field, mine in (("vocabulary_size", t.vocabulary_size), ("dim", t.dim)):
            if field == "vocabulary_size" and t.config.dynamic is not None:
                continue  # a dynamic table's keys move to any capacity that holds them (dynamic_restore)
            if s[field] != mine:
                problems.append(f"table {t.name!r}: {field} {s[field]} in the checkpoint, {mine} here")
        if (s.get("dynamic") is None) != (t.config.dynamic is None):
            kinds = ("dynamic (keyed by any id)", "fixed (ids in [0, V))")
            problems.append(
                f"table {t.name!r} is {kinds[s.get('dynamic') is None]} in the checkpoint and "
                f"{kinds[t.config.dynamic is None]} here"
            )
        if s["optimizer"]["type"] != type(t.optimizer).__name__ or s["slots"] != list(t.optimizer.slot_names):
            problems.append(
                f"table {t.name!r}: optimizer {s['optimizer']['type']} (slots {s['slots']}) in the checkpoint, "
                f"{type(t.optimizer).__name__} (slots {list(t.optimizer.slot_names)}) here"
            )
    if problems:
        raise CheckpointError(f"{where}: the checkpoint does not match this model: " + "; ".join(problems) + ".")
    for t in resolved.tables:  # another storage type: the blocks are converted as they load
        stored: dict[str, Any] = saved[t.name]
        for kind, here in (("dtype", t.config.storage), ("slot_dtype", t.config.slot_storage)):
            theirs = str(stored.get(kind, "float32"))
            if theirs != here:
                how = "exactly" if here == "float32" else "rounded to nearest"
                logger.info(
                    "%s: table %r: %s %s in the checkpoint, %s here: converted %s as it loads.",
                    where, t.name, kind, theirs, here, how,
                )  # fmt: skip


__all__ = ["check_config", "config_as_data"]
