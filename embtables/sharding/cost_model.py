"""What a sharded training step sends: bytes and messages per rank per step, from the batch's shape.

The model follows the exchanges of ``routing.py`` (row-returning tables) and ``owner_pooling.py``
(tables pooled on their owners) message by message, so given the exact per-owner id counts of a step
it predicts ``comm.bytes_sent`` exactly (``tests/distributed/test_cost_model.py`` checks W = 2, 3, 4);
given expected counts (ids spread evenly over the owners) it predicts the traffic of any W. Phase
headers (32 bytes per peer and operation, point to point) are counted as messages only.

Dimension names: W ranks, S bags of one rank's batch for a feature, N its ids, U its unique ids
(row-returning tables deduplicate before sending), D the table's dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PooledFeature:
    """A feature of a table pooled on its owners, as one rank sees it in one step.

    ``ids_per_owner[r]``: this rank's ids of the feature that rank r owns [W]; ``bags``: S of this
    rank's batch; ``bags_of[r]``: S of rank r's batch [W] (what this rank answers, as an owner);
    ``coefficients``: whether this rank's batch has combiner coefficients other than 1 (weights, or
    a mean or sqrtn combiner; an unweighted sum has none)."""

    ids_per_owner: tuple[int, ...]
    bags: int
    bags_of: tuple[int, ...]
    dim: int
    coefficients: bool = False


@dataclasses.dataclass(frozen=True)
class RowTable:
    """A row-returning table in one step: ``unique_per_owner[r]``: this rank's unique ids that rank r
    owns [W]; ``asked_by[r]``: the unique ids rank r asks of this rank [W]."""

    unique_per_owner: tuple[int, ...]
    asked_by: tuple[int, ...]
    dim: int


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """Bytes (payload sent to other ranks, as ``comm.bytes_sent`` counts it) and messages of one step."""

    int_bytes: int
    float_bytes: int
    messages: int

    @property
    def bytes(self) -> int:
        return self.int_bytes + self.float_bytes


def step_traffic(rank: int, world: int, pooled: Sequence[PooledFeature], rows: Sequence[RowTable]) -> StepTraffic:
    """What ``rank`` sends in one training step (lookup + apply_gradients) of a W-rank module."""
    others = [r for r in range(world) if r != rank]
    ints = floats = messages = 0
    messages += 2  # the phase headers of the lookup and of apply_gradients
    if rows:
        ints += len(others) * 8 * (len(rows) + 1)  # counts [W, T + 1], refusal flag included
        ints += 8 * sum(t.unique_per_owner[r] for t in rows for r in others)  # the unique ids, to their owners
        floats += 4 * sum(t.asked_by[r] * t.dim for t in rows for r in others)  # the rows asked of this rank
        floats += 4 * sum(1 + sum(t.unique_per_owner[r] * t.dim for t in rows) for r in others)  # flag + sums
        messages += 4
    if pooled:
        f = len(pooled)
        ints += len(others) * 8 * (3 * f + 1)  # counts [W, 3F + 1]: coefficient and refusal flags included
        ints += 8 * sum(p.ids_per_owner[r] + p.bags + 1 for p in pooled for r in others)  # local rows + offsets
        floats += 4 * sum(p.ids_per_owner[r] for p in pooled if p.coefficients for r in others)  # coefficients
        floats += 4 * sum(p.bags_of[r] * p.dim for p in pooled for r in others)  # partial bags, back to r
        floats += 4 * sum(1 + sum(p.bags * p.dim for p in pooled if p.ids_per_owner[r]) for r in others)
        # counts, ints, coefficients (left out when no rank has any: as this rank sees it), partials,
        # gradients (an owner sum that overflows is refused by the update's agreement, counted below)
        messages += 5 if any(p.coefficients for p in pooled) else 4
    messages += 1  # the update's agreement
    return StepTraffic(ints, floats, messages)


def even_step_traffic(
    world: int,
    tables: int,
    bags: int,
    ids_per_bag: float,
    dim: int,
    unique_share: float,
    pooled: bool,
    coefficients: bool = False,
) -> StepTraffic:
    """Expected traffic per rank when every rank has ``bags`` bags of ``ids_per_bag`` ids per table
    (one feature per table) and ids spread evenly over the owners; ``unique_share`` = U / N of a rank's
    batch (row-returning tables only); ``coefficients``: see ``PooledFeature`` (pooled tables only)."""
    ids = bags * ids_per_bag
    if pooled:
        share = round(ids / world)
        feature = PooledFeature((share,) * world, bags, (bags,) * world, dim, coefficients)
        return step_traffic(0, world, [feature] * tables, [])
    unique = round(ids * unique_share / world)
    table = RowTable((unique,) * world, (unique,) * world, dim)
    return step_traffic(0, world, [], [table] * tables)


def torchrec_bytes(world: int, tables: int, bags: int, ids_per_bag: float, dim: int, row_wise: bool) -> int:
    """TorchRec's forward + backward payload per rank and step for the same batch, by its sharding's
    collectives: table-wise sends every id to its table's owner and gets pooled bags [S, D] back
    (their gradients go the other way); row-wise sends each id to its row's owner, reduce-scatters
    partial bags [S, D] per peer and all-gathers their gradients. Int64 ids, float32 values; lengths
    and other small metadata left out."""
    ids = bags * ids_per_bag * tables
    peers = world - 1
    if row_wise:
        return int(8 * ids * peers / world + 2 * 4 * peers * bags * dim * tables)
    owned_tables = tables / world  # tables per rank, on average
    return int(8 * ids * peers / world + 2 * 4 * peers * bags * dim * owned_tables)


def network_ms(traffic_bytes: int, messages: int, world: int, gbit_per_s: float, latency_us: float = 20.0) -> float:
    """Time on the wire for one rank: its bytes at ``gbit_per_s`` plus one latency per peer per message
    (an all-to-all talks to W - 1 peers)."""
    return traffic_bytes * 8 / (gbit_per_s * 1e9) * 1e3 + messages * (world - 1) * latency_us / 1e3


def pools_on_owner(
    world: int, ids: float, unique_ids: float, bags: float, dim: int, coefficients: bool = False
) -> bool:
    """Whether pooling a table's bags on the owners sends fewer bytes per rank than sending its unique
    rows, at ``world`` ranks, for a batch (per rank) of ``ids`` ids, ``unique_ids`` unique, in ``bags``
    bags (``coefficients``: see ``PooledFeature``). Pooling sends a partial bag to every peer (grows like
    W - 1); unique rows do not."""
    if world < 2 or ids <= 0 or bags <= 0:
        return True
    n = round(ids / world)
    pooled = PooledFeature((n,) * world, round(bags), (round(bags),) * world, dim, coefficients)
    unique = round(unique_ids / world)
    rows = RowTable((unique,) * world, (unique,) * world, dim)
    return step_traffic(0, world, [pooled], []).bytes <= step_traffic(0, world, [], [rows]).bytes
