"""Which engine a module gets: the sharded one over a process group of W > 1 ranks, else the
one-process engine (the world-of-one case of the same interface)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.sharding import comm, exchange_thread
from embtables.sharding.cost_model import pools_on_owner
from embtables.sharding.lookup_stats import TableLoad, read_loads
from embtables.sharding.owner_pooling import owner_pooled
from embtables.sharding.plan import TablePlan
from embtables.sharding.sharded_collection import ShardedEmbeddingCollection
from embtables.sharding.strategies import check_sharding, place_tables
from embtables.tables.engine import Engine, OneProcessEngine


def choose_engine(
    resolved: ResolvedConfig,
    device: torch.device,
    sharding: str | Mapping[str, str],
    process_group: Any,
    timeout: float | None,
    profile_data_directory: str | os.PathLike[str] | None,
    settings: dict[str, Any],
) -> tuple[Engine, dict[str, TablePlan]]:
    """The engine of a module and each table's plan (where its rows live; one whole ``div`` shard in
    one process). Tables are placed from the lookup statistics in ``profile_data_directory`` when
    ``sharding`` asks for them (spec §5); ``timeout`` or pipelining gives the ranks a dedicated group. A table whose
    features are all combined is pooled on its owners unless its statistics show that sending its
    unique rows costs fewer bytes at this W (``cost_model.pools_on_owner``)."""
    check_sharding(sharding, resolved)
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"DistributedEmbedding: `timeout` must be a positive number of seconds, got {timeout!r}.")
    loads = read_loads(profile_data_directory, resolved)
    # EMBTABLES_SHARD_ONE_RANK=1: a process group of one rank still takes the sharded engine (its
    # collectives, e.g. NCCL's on a machine with one GPU); otherwise one rank needs no sharding.
    one_rank_sharded = os.environ.get("EMBTABLES_SHARD_ONE_RANK") == "1"
    distributed = comm.is_distributed(process_group)
    if not (distributed and (comm.get_world_size(process_group) > 1 or one_rank_sharded)):
        plans = {t.name: TablePlan("div", t.vocabulary_size, 1, 0) for t in resolved.tables}
        return OneProcessEngine(resolved, device, process_group), plans
    comm.clean_exit()  # the program may never call destroy_process_group(): leave cleanly at exit
    group = process_group
    if timeout is not None:
        group = comm.new_group(float(timeout), process_group)
    elif comm.any_rank(bool(settings.get("pipeline_execution_with_tensor_core")), process_group, channel=False):
        # The exchanges run on a background thread: on a group of their own, so they never interleave
        # with the program's collectives (a DDP all_reduce) on the default group. Every rank creates it
        # when any rank pipelines (ranks built with different settings then refuse at the config check).
        group = comm.new_group(comm.timeout_of(process_group), process_group)
    world = comm.get_world_size(group)
    placements = place_tables(resolved, sharding, world, loads)
    pooled = {t.name for t in resolved.tables if owner_pooled(t, resolved) and _pools(loads.get(t.name), world, t)}
    engine = ShardedEmbeddingCollection(resolved, device, placements, group, settings=settings, owner_pooled=pooled)
    if settings.get("pipeline_execution_with_tensor_core"):
        engine.background_exchange = exchange_thread.choose(device, group)
    return engine, engine.plans


def _pools(load: TableLoad | None, world: int, table: ResolvedTable) -> bool:
    """Pool a combined table on its owners unless its measured load says unique rows send less (a mean or
    sqrtn combiner sends a coefficient per id; a sum is counted without, as when it has no weights)."""
    if load is None:
        return True
    coefficients = table.config.combiner != "sum"
    ids, unique, bags = load.ids_per_batch, load.unique_ids_per_batch, load.samples_per_batch
    return pools_on_owner(world, ids, unique, bags, table.dim, coefficients)


def describe(engine: Engine) -> str:
    """The module's ``repr`` body: every table (rows x dim, optimizer), and when sharded, the rank and
    each table's placement."""
    resolved = engine.resolved
    tables = ", ".join(f"{t.name}: {t.vocabulary_size}x{t.dim} {type(t.optimizer).__name__}" for t in resolved.tables)
    where = ""
    if engine.world > 1:
        plans = ", ".join(f"{n}: {p.placement}" for n, p in engine.plans.items())
        where = f", rank={engine.rank}/{engine.world}, sharding=[{plans}]"
    return f"tables=[{tables}], features={len(resolved.features)}{where}"
