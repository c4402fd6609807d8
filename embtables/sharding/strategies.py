"""The ``sharding=`` argument: validation, and each table's strategy and (for "table") its rank."""

from __future__ import annotations

from collections.abc import Mapping

from embtables.config import ResolvedConfig
from embtables.errors import ConfigError
from embtables.sharding.lookup_stats import TableLoad
from embtables.sharding.plan import Placement

STRATEGIES = ("div", "mod", "table", "auto")


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
    resolved: ResolvedConfig,
    sharding: str | Mapping[str, str],
    world_size: int,
    loads: Mapping[str, TableLoad] | None = None,
) -> dict[str, Placement]:
    """Each table's ``Placement``: its strategy ("div", "mod" or "table") and, for "table", the rank.

    A table's cost is its share of the state bytes (weights and slots) plus, when lookup statistics
    measured every table, its share of the lookup traffic (ids per batch x dim). "table" tables go
    whole, most costly first, to the rank with the lowest cost so far (ties: lowest rank). "auto"
    keeps a table whole when its state is under 1/(4W) of the total and its measured traffic (if
    any) under 1/(2W), and row-shards ("div") the others, which spreads big or hot tables over every
    rank. Deterministic: every rank computes the same placement from the same config and files."""
    requested = {
        t.name: sharding if isinstance(sharding, str) else sharding.get(t.name, "div") for t in resolved.tables
    }
    sizes = _state_bytes(resolved)
    total = sum(sizes.values()) or 1
    loads = loads or {}
    measured = all(t.name in loads for t in resolved.tables) and bool(resolved.tables)
    traffic = {t.name: loads[t.name].ids_per_batch * t.dim if measured else 0.0 for t in resolved.tables}
    total_traffic = sum(traffic.values()) or 1.0
    cost = {n: sizes[n] / total + (traffic[n] / total_traffic if measured else 0.0) for n in sizes}
    strategies = {}
    for name, strategy in requested.items():
        if strategy == "auto":
            small = sizes[name] * 4 * world_size < total
            cool = not measured or traffic[name] * 2 * world_size < total_traffic
            strategy = "table" if small and cool else "div"
        strategies[name] = strategy
    placed = [0.0] * world_size
    table_ranks = {}
    for name in sorted((n for n, s in strategies.items() if s == "table"), key=lambda n: (-cost[n], n)):
        rank = min(range(world_size), key=lambda r: (placed[r], r))
        table_ranks[name] = rank
        placed[rank] += cost[name]
    return {name: Placement(s, table_ranks.get(name, 0)) for name, s in strategies.items()}
