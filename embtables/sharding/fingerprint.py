"""A canonical description and hash of a resolved config, exchanged once at construction so that
ranks built from different configs fail at once with a readable difference instead of exchanging
rows of tables that do not match."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from embtables.config import ResolvedConfig
from embtables.sharding.plan import Placement


def _describe(value: Any) -> Any:
    """A JSON-able description of a config value (callables by kind only: they cannot be compared)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if callable(value):
        return f"callable {type(value).__name__}"
    return f"{type(value).__name__}"


def _whole(placement: Placement | None) -> bool:
    return placement is not None and placement.strategy == "table"


def describe_config(resolved: ResolvedConfig, placements: Mapping[str, Placement]) -> dict[str, Any]:
    """Tables (name, V, D, combiner, optimizer and its arguments), features and the placement."""
    tables = {}
    for t in resolved.tables:
        tables[t.name] = {
            "vocabulary_size": t.vocabulary_size,
            "dim": t.dim,
            "combiner": str(t.config.combiner),
            "optimizer": _describe(t.optimizer),
            "quantization_config": _describe(t.config.quantization_config),
            "initializer": _describe(t.config.initializer),
            "dynamic": _describe(t.config.dynamic),
            "strategy": placements[t.name].strategy if t.name in placements else None,
            "table_rank": placements[t.name].rank if _whole(placements.get(t.name)) else None,
        }
    features = {
        f.name: {
            "table": resolved.tables[f.table_index].name,
            "max_sequence_length": f.config.max_sequence_length,
            "output_shape": _describe(f.config.output_shape),
        }
        for f in resolved.features
    }
    return {"tables": tables, "features": features}


def fingerprint(description: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``description``."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def differences(mine: dict[str, Any], theirs: dict[str, Any], limit: int = 5) -> list[str]:
    """Up to ``limit`` readable paths where two descriptions differ, e.g. ``tables.user.dim: 16 vs 32``."""
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    out.append(
                        f"{path}{key}: {'missing' if key not in a else 'present'} here, "
                        f"{'missing' if key not in b else 'present'} there"
                    )
                else:
                    walk(a[key], b[key], f"{path}{key}.")
        elif a != b:
            out.append(f"{path.rstrip('.')}: {a!r} here vs {b!r} there")

    walk(mine, theirs, "")
    return out
