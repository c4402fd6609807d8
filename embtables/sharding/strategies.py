"""The ``sharding=`` argument: validation, and each table's strategy and (for "table") its rank."""

from __future__ import annotations

from collections.abc import Mapping

from embtables.config import ResolvedConfig
from embtables.errors import ConfigError

STRATEGIES = ("div", "mod", "table", "auto")
ROW_STRATEGIES = ("div", "mod", "table")


def check_sharding(sharding: object, resolved: ResolvedConfig) -> None:
    """Raise ``ValueError``/``TypeError`` for a ``sharding=`` value that is not a strategy or a dict
    table name -> strategy over this config's tables."""
    if isinstance(sharding, str):
        if sharding not in STRATEGIES:
            raise ConfigError(
                f"DistributedEmbedding: `sharding` must be one of {', '.join(map(repr, STRATEGIES))} or a dict table "
                f"name -> strategy, got {sharding!r}."
            )
        return
    if not isinstance(sharding, Mapping):
        raise TypeError(
            f"DistributedEmbedding: `sharding` must be a str or a dict table name -> strategy, got "
            f"{type(sharding).__name__}."
        )
    names = set(resolved.table_names)
    unknown = [k for k in sharding if k not in names]
    if unknown:
        raise ConfigError(
            f"DistributedEmbedding: `sharding` names tables {unknown} that are not in the config (tables: "
            f"{sorted(names)})."
        )
    bad = {k: v for k, v in sharding.items() if v not in STRATEGIES}
    if bad:
        raise ConfigError(
            f"DistributedEmbedding: `sharding` has unknown strategies {bad}; use one of "
            f"{', '.join(map(repr, STRATEGIES))}."
        )


def _state_bytes(resolved: ResolvedConfig) -> dict[str, int]:
    """Bytes of each table's weights and slots (float32)."""
    return {t.name: 4 * t.vocabulary_size * t.dim * (1 + len(t.optimizer.slot_names)) for t in resolved.tables}


def place_tables(
    resolved: ResolvedConfig, sharding: str | Mapping[str, str], world_size: int
) -> tuple[dict[str, str], dict[str, int]]:
    """Each table's strategy ("div", "mod" or "table") and, for "table", the rank holding it.

    "table" tables go whole, largest first, to the rank with the fewest bytes so far (ties: lowest
    rank). "auto" makes a table whose state is under 1/(4W) of the total a "table" table, and
    row-shards ("div") the others. Deterministic: every rank computes the same placement."""
    requested = {
        t.name: sharding if isinstance(sharding, str) else sharding.get(t.name, "div") for t in resolved.tables
    }
    sizes = _state_bytes(resolved)
    total = sum(sizes.values())
    strategies = {}
    for name, strategy in requested.items():
        if strategy == "auto":
            strategy = "table" if sizes[name] * 4 * world_size < total else "div"
        strategies[name] = strategy
    loads = [0] * world_size
    table_ranks = {}
    for name in sorted((n for n, s in strategies.items() if s == "table"), key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        table_ranks[name] = rank
        loads[rank] += sizes[name]
    return strategies, table_ranks
