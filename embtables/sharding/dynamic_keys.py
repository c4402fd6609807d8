"""Dynamic tables over several ranks (spec §11.4): which rank owns a key, and a batch's keys turned into
the global rows of their owners' key maps.

A key's owner is ``splitmix64(key) mod W`` for row-sharded tables ("div", "mod") and the table's rank for
"table" placement; each rank's key map gives keys its own rows (the plan's rows of that rank), so once
translated a dynamic table is an ordinary sharded table and every later stage (routing, pooling,
gradients, the update, checkpoints by row) is shared. One translation is two messages per step for all
dynamic tables together: the unique keys to their owners (which also carries every rank's refusal
flag), and their global rows back.

Each owner sees the keys of rank 0, then rank 1, ... in first-occurrence order: the global batch's
sample-major order restricted to its keys, so admission is decided in the same order as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.sharding import comm, routing
from embtables.sharding.plan import TablePlan
from embtables.tables.dynamic_vocabularies import (
    PENDING_FIELDS,
    ROW_FIELDS,
    Vocabularies,
    occurrence_order,
    vocabulary_arrays,
    with_rows,
)
from embtables.tables.inputs import FeatureBatch


def splitmix64(keys: Tensor) -> np.ndarray:
    """The splitmix64 finaliser of every key [N] (as uint64), the hash that spreads keys over ranks."""
    z = keys.detach().to("cpu", torch.int64).numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def key_owners(keys: Tensor, plan: TablePlan) -> Tensor:
    """The rank owning each key [N] of a dynamic table placed by ``plan``."""
    if plan.strategy == "table":
        return torch.full((keys.numel(),), plan.rank, dtype=torch.int64)
    return torch.from_numpy((splitmix64(keys) % np.uint64(plan.world_size)).astype(np.int64))


def unique_in_order(keys: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct keys [U] in order of first occurrence and the index [N] of every key among them."""
    if keys.numel() == 0:
        return keys, torch.zeros(0, dtype=torch.int64)
    uniq, inv = torch.unique(keys, return_inverse=True)
    n = keys.numel()
    first = torch.full((uniq.numel(),), n, dtype=torch.int64).scatter_reduce_(
        0, inv, torch.arange(n), reduce="amin", include_self=True
    )
    order = torch.argsort(first)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel())
    return uniq[order], rank_of[inv]


def translate_sharded(
    resolved: ResolvedConfig,
    plans: dict[str, TablePlan],
    vocabularies: Vocabularies,
    reset_rows: Callable[[str, Tensor], None],
    batches: Sequence[FeatureBatch],
    training: bool,
    step: int,
    pin_from: int,
    refused: bool,
    group: comm.ProcessGroup | None,
    agree_room: Callable[[list[tuple[str, Tensor]]], None] | None = None,
) -> tuple[list[FeatureBatch], list[int]]:
    """This rank's batches with every dynamic feature's keys replaced by global rows (keys without a row
    dropped; see ``with_rows``), and the ranks that refused their batch (then no map changed anywhere).
    Collective: every rank calls it for every lookup, in the same order. ``reset_rows(table, local rows)``
    gives the rows a training lookup handed to new keys their initial values. ``agree_room`` (collective,
    training only): given each table's keys [K] asked of this rank, raises on every rank when any rank's row
    cache could not hold them, before any key map changes."""
    tables = [t for t in resolved.tables if t.config.dynamic is not None]
    if not tables:
        return list(batches), []
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    sends: list[tuple[Tensor, list[int]]] = []
    routes: list[tuple[Tensor | None, Tensor, Tensor]] = []
    for t in tables:
        parts = [batches[f] for f in t.feature_indices] if not refused else []
        keys = torch.cat([b.ids for b in parts]).to("cpu", torch.int64) if parts else torch.zeros(0, dtype=torch.int64)
        order = occurrence_order(parts) if parts else None
        uniq, inverse = unique_in_order(keys if order is None else keys[order])
        owners = key_owners(uniq, plans[t.name])
        by_owner = torch.argsort(owners, stable=True)
        counts = torch.bincount(owners, minlength=world).tolist()
        sends.append((uniq[by_owner].contiguous(), counts))
        routes.append((order, inverse, by_owner))
    asked, refusing = routing.exchange_ids(sends, refused, world, group)
    if refusing:
        return list(batches), refusing
    if training and agree_room is not None:
        agree_room([(t.name, keys) for t, (keys, _) in zip(tables, asked)])
    answers: list[tuple[Tensor, list[int]]] = []
    for t, (recv_keys, recv_counts) in zip(tables, asked):
        key_map = vocabularies.maps[t.name]
        recv_keys = recv_keys.to("cpu", torch.int64).contiguous()
        if training:
            local, reset = key_map.train(recv_keys, step, pin_from)
            vocabularies.note(t.name, recv_keys, local)
            if reset.numel():
                reset_rows(t.name, reset)
        else:
            local = key_map.find(recv_keys)
        mine = plans[t.name].global_rows(rank)
        global_rows = torch.where(local >= 0, mine[local.clamp(min=0)] if mine.numel() else local, local)
        answers.append((global_rows.contiguous(), recv_counts))
    replies, _ = routing.exchange_ids(answers, False, world, group)
    out = list(batches)
    for t, (rows_by_owner, _), (order, inverse, by_owner) in zip(tables, replies, routes):
        _place(out, t, batches, rows_by_owner.to("cpu"), order, inverse, by_owner)
    return out, []


def _place(
    out: list[FeatureBatch],
    table: ResolvedTable,
    batches: Sequence[FeatureBatch],
    rows_by_owner: Tensor,
    order: Tensor | None,
    inverse: Tensor,
    by_owner: Tensor,
) -> None:
    """Every occurrence's row back in its feature's batch (``with_rows``)."""
    per_unique = torch.empty_like(rows_by_owner)
    per_unique[by_owner] = rows_by_owner
    ordered = per_unique[inverse]
    rows = ordered if order is None else torch.empty_like(ordered).index_copy_(0, order, ordered)
    start = 0
    for f in table.feature_indices:
        b = batches[f]
        n = b.ids.numel()
        out[f] = with_rows(b, rows[start : start + n].to(b.ids.device), table)
        start += n


def gather_vocabularies(
    resolved: ResolvedConfig,
    plans: dict[str, TablePlan],
    vocabularies: Vocabularies,
    owned_rows: dict[str, int],
    group: comm.ProcessGroup | None,
) -> dict[str, dict[str, Tensor]]:
    """Every dynamic table's logical vocabulary (row fields [V] by global row, pending keys [P] of all
    ranks), gathered on every rank (collective). Touch orders are renumbered over all ranks (age first),
    which keeps each rank's own order."""
    out = {}
    for t in resolved.tables:
        if t.config.dynamic is None:
            continue
        plan, n = plans[t.name], owned_rows[t.name]
        local = vocabulary_arrays(vocabularies.maps[t.name].export())
        rows = torch.zeros((t.vocabulary_size, len(ROW_FIELDS)), dtype=torch.int64)
        rank_of_row = torch.zeros(t.vocabulary_size, dtype=torch.int64)
        mine = torch.stack([local[f][:n] for f in ROW_FIELDS], dim=1)  # [n, 4]: one message for the 4 fields
        for r, part in enumerate(comm.all_gather_v(mine.contiguous(), group)):
            where = plan.global_rows(r)
            rows[where] = part.to("cpu")
            rank_of_row[where] = r
        full = {f: rows[:, i].contiguous() for i, f in enumerate(ROW_FIELDS)}
        live = torch.nonzero(full["counts"] > 0).flatten()
        keys = (full["order"][live], -full["age"][live], rank_of_row[live])
        oldest_first = live[torch.from_numpy(np.lexsort(tuple(k.numpy() for k in keys)))]
        full["order"] = torch.zeros_like(full["order"])
        full["order"][oldest_first] = torch.arange(oldest_first.numel(), dtype=torch.int64)
        for f in PENDING_FIELDS:
            full[f] = torch.cat([p.to("cpu") for p in comm.all_gather_v(local[f].contiguous(), group)])
        out[t.name] = full
    return out


def local_vocabularies(
    values: dict[str, dict[str, Tensor]], plans: dict[str, TablePlan], vocabularies: Vocabularies, rank: int
) -> dict[str, dict[str, Tensor]]:
    """This rank's part of logical vocabularies (``gather_vocabularies``' form): its rows' fields, padded
    to its key map's capacity, and the pending keys it owns."""
    out = {}
    for name, full in values.items():
        plan, capacity = plans[name], vocabularies.maps[name].capacity
        rows = plan.global_rows(rank)
        mine = {f: torch.zeros(capacity, dtype=torch.int64) for f in ROW_FIELDS}
        for f in ROW_FIELDS:
            mine[f][: rows.numel()] = full[f].cpu()[rows]
        owned = key_owners(full["pending_keys"].cpu(), plan) == rank
        for f in PENDING_FIELDS:
            mine[f] = full[f].cpu()[owned].contiguous()
        out[name] = mine
    return out


def keys_to_owners(
    name: str, arrays: dict[str, Tensor], values: dict[str, Tensor], plan: TablePlan
) -> tuple[dict[str, Tensor], dict[str, Tensor]] | str:
    """A dynamic table's logical vocabulary ``arrays`` (row fields [V] by global row, pending [P]) and its
    values ``{state key: [V, D]}`` (weights and slots) with every live key on a row of the rank that owns
    it (``key_owners``), as a sharded module needs them: a state dict from another world size or
    placement holds keys on rows of other ranks. Returned as given when every key already is on a row of
    its owner (the module's own state dict); else each owner's keys take its rows 0, 1, ... oldest first
    (by age, then touch order), their values with them. A string naming the problem when an owner holds
    fewer rows than it owns keys. Pending keys follow their owner at load (``local_vocabularies``)."""
    counts = arrays["counts"].cpu()
    live = torch.nonzero(counts > 0).flatten()
    owners = key_owners(arrays["keys"].cpu()[live], plan)
    rank_of_row = torch.zeros(counts.numel(), dtype=torch.int64)
    for r in range(plan.world_size):
        rank_of_row[plan.global_rows(r)] = r
    if torch.equal(owners, rank_of_row[live]):
        return arrays, values
    age, order = arrays["age"].cpu()[live].numpy(), arrays["order"].cpu()[live].numpy()
    new_rows = torch.empty(live.numel(), dtype=torch.int64)
    for r in range(plan.world_size):
        mine = torch.nonzero(owners == r).flatten()
        rows = plan.global_rows(r)
        if mine.numel() > rows.numel():
            return (
                f"table {name!r}: rank {r} owns {mine.numel()} of the state dict's live keys but holds only "
                f"{rows.numel()} rows (vocabulary_size={counts.numel()} over {plan.world_size} ranks). Raise "
                "vocabulary_size to hold them, or load into fewer processes"
            )
        oldest_first = mine[torch.from_numpy(np.lexsort((order[mine.numpy()], -age[mine.numpy()])))]
        new_rows[oldest_first] = rows[: mine.numel()].to(torch.int64)
    moved = {f: torch.zeros_like(arrays[f].cpu()) for f in ROW_FIELDS}
    for f in ROW_FIELDS:
        moved[f][new_rows] = arrays[f].cpu()[live]
    moved.update({f: arrays[f] for f in PENDING_FIELDS})
    placed = {}
    for key, value in values.items():
        out = value.detach().clone()
        out[new_rows.to(out.device)] = value.detach()[live.to(value.device)]
        placed[key] = out
    return moved, placed
