"""Row placement of one table over W ranks (spec §3): pure integer arithmetic, no process group.

- ``div`` (TF's ``DIV_DEFAULT``, the default): contiguous blocks. With ``q = V // W`` and
  ``e = V % W``, the first ``e`` ranks hold ``q + 1`` rows, the others ``q``. Id ``i`` lives on
  ``max(i // (q + 1), (i - e) // q)``.
- ``mod``: id ``i`` lives on rank ``i % W`` at local row ``i // W``.
- ``table``: the whole table on one rank.

With V < W some ranks hold no rows of a table. Partitioning is layout only (spec §10.8): it never
changes what a lookup or an update computes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from embtables.kernels.affine_rows import AffineRows

STRATEGIES: tuple[str, ...] = ("div", "mod", "table")


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one table is placed: ``strategy`` ("div", "mod" or "table") and, for "table", the ``rank``
    that holds it whole (0 otherwise). The one value that planning, the sharded engine, checkpoints,
    lookup statistics and ``repr`` share; ``str()`` gives ``"div"``, ``"mod"`` or ``"table@<rank>"``."""

    strategy: str
    rank: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Placement: `strategy` must be one of {STRATEGIES}, got {self.strategy!r}.")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"Placement: `rank` must be an int >= 0, got {self.rank!r}.")
        if self.strategy != "table" and self.rank != 0:
            raise ValueError(f"Placement: only a 'table' placement names a rank, got {self.strategy!r} at {self.rank}.")

    def __str__(self) -> str:
        return f"table@{self.rank}" if self.strategy == "table" else self.strategy


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Where the V rows of one table live over ``world_size`` (W) ranks.

    Row counts have three names: ``vocabulary_size`` (V, the table's global rows), ``owned_rows(r)``
    (the rows rank r holds; they add up to V) and, in the sharded engine, a rank's local rows (its
    owned rows, or one placeholder row when it owns none).

    Attributes:
      strategy: "div", "mod" or "table".
      vocabulary_size: V, the table's rows.
      world_size: W, the number of ranks.
      rank: for "table", the rank that holds the whole table (ignored otherwise).
    """

    strategy: str
    vocabulary_size: int
    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"TablePlan: `strategy` must be one of {STRATEGIES}, got {self.strategy!r}.")
        if not isinstance(self.vocabulary_size, int) or self.vocabulary_size < 1:
            raise ValueError(f"TablePlan: `vocabulary_size` must be an int >= 1, got {self.vocabulary_size!r}.")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"TablePlan: `world_size` must be an int >= 1, got {self.world_size!r}.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TablePlan: `rank` must be in [0, {self.world_size}), got {self.rank!r}.")

    @classmethod
    def of(cls, placement: Placement, vocabulary_size: int, world_size: int) -> TablePlan:
        return cls(placement.strategy, vocabulary_size, world_size, placement.rank)

    @property
    def placement(self) -> Placement:
        return Placement(self.strategy, self.rank if self.strategy == "table" else 0)

    def owned_rows(self, rank: int) -> int:
        """How many rows of the table ``rank`` holds."""
        return self.shard_sizes()[rank]

    def shard_sizes(self) -> list[int]:
        """Rows held by each rank [W]; they add up to V."""
        v, w = self.vocabulary_size, self.world_size
        if self.strategy == "table":
            return [v if r == self.rank else 0 for r in range(w)]
        q, e = divmod(v, w)
        return [q + 1 if r < e else q for r in range(w)]

    def owner(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(rank, local row)`` of every global id in ``ids`` [N] (int64, each in [0, V))."""
        ids = ids.to(torch.int64)
        v, w = self.vocabulary_size, self.world_size
        if self.strategy == "table":
            return torch.full_like(ids, self.rank), ids
        if self.strategy == "mod":
            return torch.remainder(ids, w), torch.div(ids, w, rounding_mode="floor")
        q, e = divmod(v, w)
        if q == 0:  # V < W: rank i holds only row i
            return ids.clone(), torch.zeros_like(ids)
        big = e * (q + 1)  # rows held by the first e ranks (q + 1 rows each)
        in_big = ids < big
        rank = torch.where(
            in_big, torch.div(ids, q + 1, rounding_mode="floor"), torch.div(ids - e, q, rounding_mode="floor")
        )
        local = torch.where(in_big, torch.remainder(ids, q + 1), torch.remainder(ids - e, q))
        return rank, local

    def affine_rows(self, rank: int) -> AffineRows:
        """``global_rows(rank)`` as (first, stride, count): local row j holds id first + stride * j. A rank that
        owns no row gets one placeholder row, never written, whose id is V."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"TablePlan: rank must be in [0, {self.world_size}), got {rank}.")
        v, w, n = self.vocabulary_size, self.world_size, self.shard_sizes()[rank]
        if n == 0:
            return AffineRows(v, 1, 1)
        if self.strategy == "table":
            return AffineRows(0, 1, n)
        if self.strategy == "mod":
            return AffineRows(rank, w, n)
        q, e = divmod(v, w)
        return AffineRows(rank * (q + 1) if rank < e else e * (q + 1) + (rank - e) * q, 1, n)

    def global_rows(self, rank: int) -> Tensor:
        """The global ids held by ``rank``, ascending, [shard_sizes()[rank]]; local row j holds id [j]."""
        rows = self.affine_rows(rank)
        return rows.tensor() if self.owned_rows(rank) else torch.zeros(0, dtype=torch.int64)
