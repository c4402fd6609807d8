"""``Residency``: which rows of an offloaded table are in its cache, in which slot, and which leave first
(docs/offload.md).

Pure bookkeeping, no I/O: ``OffloadedRows`` asks it which rows a lookup must read and which to evict, does
the reads and write-backs, then tells it what changed. For each resident unit (a local row) it keeps its slot
in the cache's block (``slots``), the step of its last lookup (``last_use``) and how often it was looked up
(``uses``, as of that step; each lookup's ids weigh ``USE_DECAY`` ** (steps since), so the cache keeps the
rows used most, recently).

Invariants (``check``; a test drives random admissions through them):
  * ``units`` [R] strictly ascending, int32 where every unit of the shard fits one (``index_dtype``) else int64;
    ``slots`` [R] int32, ``last_use`` [R] int32, ``uses`` [R] float32 (finite, >= 0) are aligned with it (16
    bytes a resident unit where units are int32);
  * R <= ``budget``; the slots are distinct, in [0, budget), and exactly those not in ``free``;
  * ``victims`` never chooses a unit used at or after ``pin_from``, nor one the lookup asks for.

Shapes: R resident units, K units a lookup asks for (ascending, distinct).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

USE_DECAY = 0.98  # a unit's lookups count for less by this factor a step
_NEVER = -(2**31)  # the last use of a unit just read in
_I32_MAX = 2**31 - 1


def index_dtype(bound: int) -> torch.dtype:
    """The narrower of int32 and int64 that holds every index in [0, ``bound``): the cache's bookkeeping keeps
    indices in it, so its memory is 4 bytes an index for any shard of up to 2**31 rows."""
    return torch.int32 if bound <= 2**31 else torch.int64


def _step32(step: int) -> int:
    return min(step, _I32_MAX)


def merge_sorted(keys: Tensor, new: Tensor, columns: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, list[Tensor]]:
    """The merge of ascending ``keys`` [R] and ascending ``new`` [K] (none of them in ``keys``) in O(R + K log R),
    each new key at its place among the R, and each column (values aligned with ``keys`` [R], values aligned with
    ``new`` [K]) merged in the same order."""
    k, n = new.numel(), keys.numel()
    at = torch.searchsorted(keys, new) + torch.arange(k)  # the new keys' places in the merge
    old = torch.ones(n + k, dtype=torch.bool)
    old[at] = False

    def merged(a: Tensor, b: Tensor) -> Tensor:
        out = torch.empty(n + k, dtype=a.dtype)
        out[old], out[at] = a, b
        return out

    return merged(keys, new), [merged(a, b) for a, b in columns]


class NoRoom(Exception):
    """The units asked for and those pinned exceed the budget: ``needed`` units would have to be resident."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class Residency:
    """The resident units of one table shard, at most ``budget`` of them, each in [0, ``unit_bound``) (see the
    module docstring). Units and slots come in and go out as int64; they are kept narrower."""

    def __init__(self, budget: int, unit_bound: int = 2**63 - 1) -> None:
        if not 1 <= budget <= 2**31:
            raise ValueError(f"Residency: the budget must be 1 to 2**31 units, got {budget}")
        self.budget = budget
        self.units = torch.zeros(0, dtype=index_dtype(unit_bound))
        self.slots = torch.zeros(0, dtype=torch.int32)
        self.free = torch.arange(budget, dtype=torch.int32)  # the slots no unit holds, taken from the front
        self.last_use = torch.zeros(0, dtype=torch.int32)
        self.uses = torch.zeros(0, dtype=torch.float32)

    def __len__(self) -> int:
        return int(self.units.numel())

    def where(self, units: Tensor) -> tuple[Tensor, Tensor]:
        """(positions [K] in the resident arrays of ``units`` [K] (ascending), whether each is resident)."""
        at = torch.searchsorted(self.units, units.to(self.units.dtype))
        n = len(self)
        if n == 0:
            return at, torch.zeros(units.shape, dtype=torch.bool)
        return at, (at < n) & (self.units[at.clamp(max=n - 1)] == units)

    def victims(self, units: Tensor, step: int, pin_from: int, found: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Positions [E] (ascending) of the resident units to evict so that ``units`` [K] (ascending) all fit:
        the least used of those not asked for and last used before ``pin_from`` (empty when they fit). Raises
        ``NoRoom`` when even evicting all of those leaves too little. ``found``: ``where(units)``, when known."""
        at, present = self.where(units) if found is None else found
        missing = int((~present).sum())
        over = len(self) + missing - self.budget
        if over <= 0:
            return torch.zeros(0, dtype=torch.int64)
        evictable = self.last_use < _step32(pin_from)
        evictable[at[present]] = False  # this lookup's own
        candidates = torch.nonzero(evictable).flatten()
        if candidates.numel() < over:
            raise NoRoom(len(self) - candidates.numel() + missing)
        coldest = torch.topk(self.frequency(candidates, step), over, largest=False).indices
        return torch.sort(candidates[coldest]).values

    def slots_of(self, units: Tensor) -> Tensor:
        """The slots [K] (int64) of resident ``units`` [K] (any order)."""
        at, present = self.where(units)
        if not bool(present.all()):
            raise ValueError("Residency.slots_of: a unit is not resident")
        return self.slots[at].to(torch.int64)

    def units_at(self, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(the units [E], their slots [E]), int64, at ``positions`` [E] of the resident arrays (all when None)."""
        if positions is None:
            return self.units.to(torch.int64), self.slots.to(torch.int64)
        return self.units[positions].to(torch.int64), self.slots[positions].to(torch.int64)

    def remove(self, positions: Tensor) -> None:
        """The units at ``positions`` [E] leave the resident arrays; their slots are free again."""
        keep = torch.ones(len(self), dtype=torch.bool)
        keep[positions] = False
        self.free = torch.cat((self.free, self.slots[positions]))
        self.units, self.slots = self.units[keep], self.slots[keep]
        self.last_use, self.uses = self.last_use[keep], self.uses[keep]

    def clear(self) -> None:
        """Every unit leaves."""
        self.remove(torch.arange(len(self)))

    def insert(self, units: Tensor) -> Tensor:
        """Units [K] (ascending, not resident) join, never used, each in a free slot: merged in O(R + K log R),
        each at its place among the R resident ones. Returns their slots [K] (int64)."""
        k, n = units.numel(), len(self)
        if n + k > self.budget:
            raise ValueError(f"Residency: {k} more units exceed the budget of {self.budget} ({n} resident)")
        given, self.free = self.free[:k], self.free[k:]
        never = torch.full((k,), _NEVER, dtype=torch.int32)
        columns = [(self.slots, given), (self.last_use, never), (self.uses, torch.zeros(k))]
        self.units, (self.slots, self.last_use, self.uses) = merge_sorted(
            self.units, units.to(self.units.dtype), columns
        )
        return given.to(torch.int64)

    def used(self, units: Tensor, counts: Tensor, step: int) -> None:
        """A lookup at ``step`` read ``counts`` [K] ids of each of ``units`` [K] (ascending, all resident)."""
        at, present = self.where(units)
        if not bool(present.all()):
            raise ValueError("Residency.used: a unit looked up is not resident")
        self.uses[at] = self.frequency(at, step) + counts.to(torch.float32)
        self.last_use[at] = _step32(step)

    def frequency(self, at: Tensor, step: int) -> Tensor:
        """How often the resident units at positions ``at`` [K] were looked up since they were read in, each
        lookup's ids weighted by ``USE_DECAY`` ** (steps since)."""
        age = (_step32(step) - self.last_use[at].to(torch.int64)).clamp(min=0)
        return self.uses[at] * torch.pow(USE_DECAY, age.to(torch.float32))

    def check(self) -> None:
        """Raise ``AssertionError`` naming the invariant (module docstring) the arrays break."""
        n = len(self)
        assert self.units.dtype in (torch.int32, torch.int64) and self.slots.dtype == torch.int32, "dtypes"
        assert self.last_use.dtype == torch.int32 and self.uses.dtype == torch.float32, "dtypes"
        assert self.slots.numel() == n and self.last_use.numel() == n and self.uses.numel() == n, "aligned"
        assert n <= self.budget, f"{n} resident units over the budget of {self.budget}"
        every = torch.sort(torch.cat((self.slots, self.free))).values
        every_slot = torch.arange(self.budget, dtype=torch.int32)
        assert torch.equal(every, every_slot), "slots distinct, in range, and free the others"
        assert n < 2 or bool((self.units[1:] > self.units[:-1]).all()), "units strictly ascending"
        assert bool(torch.isfinite(self.uses).all()) and bool((self.uses >= 0).all()), "uses finite and >= 0"


__all__ = ["USE_DECAY", "NoRoom", "Residency", "index_dtype", "merge_sorted"]
