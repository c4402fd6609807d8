"""The initial values of an offloaded table's rows (docs/offload.md): row r's are the initializer's draw for
its block of ``INIT_BLOCK`` global rows, from the table's seed, so they do not depend on the cache's size, the
shard layout or the order rows are first read. Also ``OffloadShard``: which part of a table a process holds.

Shapes: U rows asked for, D the width.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.tables.initializers import default_initializer

INIT_BLOCK = 1024  # global rows drawn together by the initializer (a property of the table, not of the cache)


def table_seed(table: ResolvedTable) -> int:
    """An offloaded table's initializer seed: its initializer's own ``seed`` when set, else one draw from
    torch's global generator (as an in-memory table's initial values are), made when the tables are created."""
    init = table.config.initializer or default_initializer(table.dim)
    own = getattr(init, "seed", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own % 2**63
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadShard:
    """Which part of an offloaded table a process holds: the whole table's config (``logical``), the files'
    shard tag (``w<W>r<rank>``), the initializer seed, and its rows: local row i is global row
    ``first + stride * i`` (a div block or a whole table: stride 1; a mod stride: W)."""

    logical: ResolvedTable
    shard: str
    seed: int
    first: int = 0
    stride: int = 1


def block_seed(seed: int, block: int) -> int:
    """The seed of the initializer's draw for global block ``block`` (splitmix64 of the pair, 63 bits)."""
    z = (seed * 0x9E3779B97F4A7C15 + block + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1


def initial_weights(table: ResolvedTable, global_rows: Tensor, seed: int) -> Tensor:
    """The initial float32 weights [U, D] of ``global_rows`` [U] of an offloaded table: row r is row
    ``r % INIT_BLOCK`` of the initializer's ``block`` for global block ``r // INIT_BLOCK``."""
    init = table.config.initializer or default_initializer(table.dim)
    out = torch.empty((global_rows.numel(), table.dim), dtype=torch.float32)
    blocks = torch.div(global_rows, INIT_BLOCK, rounding_mode="floor")
    for block in torch.unique(blocks).tolist():
        start = block * INIT_BLOCK
        n = min(INIT_BLOCK, table.vocabulary_size - start)
        values = init.block(start, (n, table.dim), block_seed(seed, block))  # type: ignore[union-attr]
        if not isinstance(values, Tensor) or tuple(values.shape) != (n, table.dim):
            got = f"{tuple(values.shape)}" if isinstance(values, Tensor) else type(values).__name__
            raise InputError(
                f"table {table.name!r}: the initializer's block() must return a [{n}, {table.dim}] tensor, got {got}."
            )
        where = blocks == block
        out[where] = values.to(torch.float32)[global_rows[where] - start]
    return out


__all__ = ["INIT_BLOCK", "OffloadShard", "block_seed", "initial_weights", "table_seed"]
