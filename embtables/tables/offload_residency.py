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
from typing import Any

import torch
from torch import Tensor

from embtables.kernels import native_library

USE_DECAY = 0.98  # a unit's lookups count for less by this factor a step
_NEVER = -(2**31)  # the last use of a unit just read in
_I32_MAX = 2**31 - 1


def index_dtype(bound: int) -> torch.dtype:
    """The narrower of int32 and int64 that holds every index in [0, ``bound``): the cache's bookkeeping keeps
    indices in it, so its memory is 4 bytes an index for any shard of up to 2**31 rows."""
    return torch.int32 if bound <= 2**31 else torch.int64


def _step32(step: int) -> int:
    """``step`` as the int32 the arrays keep (clamped to its range)."""
    return max(-(2**31), min(step, _I32_MAX))


def find_sorted(keys: Tensor, queries: Tensor) -> tuple[Tensor, Tensor]:
    """(the position [K] in ascending ``keys`` [R] of each of ``queries`` [K], where it is or would go; whether it
    is there [K] bool). ``queries`` are compared in ``keys``' dtype."""
    at = torch.searchsorted(keys, queries.to(keys.dtype))
    n = int(keys.numel())
    if n == 0:
        return at, torch.zeros(queries.shape, dtype=torch.bool)
    return at, (at < n) & (keys[at.clamp(max=n - 1)] == queries)


def _library() -> Any:
    """The native library (``Residency.native`` is chosen only where it loads)."""
    lib = native_library.library(required=True)
    assert lib is not None
    return lib


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
    module docstring). Units and slots come in and go out as int64; they are kept narrower, in arrays of the
    budget's length (``units`` and the others are views of their first R entries).

    ``native``: keep the arrays sorted and choose the victims in C (``csrc/residency.c``: a pass over the R
    entries in place, no copy of them), chosen once: by default where the library loads and units are int32;
    False: the torch path, which gives the same arrays (a test compares them).
    """

    def __init__(self, budget: int, unit_bound: int = 2**63 - 1, *, native: bool | None = None) -> None:
        if not 1 <= budget <= 2**31:
            raise ValueError(f"Residency: the budget must be 1 to 2**31 units, got {budget}")
        self.budget = budget
        dtype = index_dtype(unit_bound)
        available = dtype == torch.int32 and native_library.library(required=True) is not None
        if native and not available:
            raise RuntimeError("Residency: the native residency needs the native library and int32 units")
        self.native = available if native is None else bool(native)
        self._n = 0  # R
        self._units = torch.empty(budget, dtype=dtype)
        self._slots = torch.empty(budget, dtype=torch.int32)
        self._last = torch.empty(budget, dtype=torch.int32)
        self._uses = torch.empty(budget, dtype=torch.float32)
        # the slots no unit holds: a stack, the next taken from its top (slot 0 first at the start)
        self._free = torch.arange(budget - 1, -1, -1, dtype=torch.int32)
        self._nfree = budget

    def __len__(self) -> int:
        return self._n

    def _set(self, buffer: Tensor, value: Tensor) -> None:
        if value.numel() != self._n:
            raise ValueError(f"Residency: {value.numel()} values for {self._n} resident units")
        buffer[: self._n] = value

    @property
    def units(self) -> Tensor:
        """[R] the resident units, strictly ascending."""
        return self._units[: self._n]

    @units.setter
    def units(self, value: Tensor) -> None:
        self._set(self._units, value)

    @property
    def slots(self) -> Tensor:
        """[R] int32: each resident unit's slot."""
        return self._slots[: self._n]

    @slots.setter
    def slots(self, value: Tensor) -> None:
        self._set(self._slots, value)

    @property
    def last_use(self) -> Tensor:
        """[R] int32: the step of each resident unit's last lookup."""
        return self._last[: self._n]

    @last_use.setter
    def last_use(self, value: Tensor) -> None:
        self._set(self._last, value)

    @property
    def uses(self) -> Tensor:
        """[R] float32: each resident unit's lookups as of its last one."""
        return self._uses[: self._n]

    @uses.setter
    def uses(self, value: Tensor) -> None:
        self._set(self._uses, value)

    @property
    def free(self) -> Tensor:
        """[budget - R] int32: the slots no unit holds."""
        return self._free[: self._nfree]

    def where(self, units: Tensor) -> tuple[Tensor, Tensor]:
        """(positions [K] in the resident arrays of ``units`` [K] (ascending), whether each is resident)."""
        return find_sorted(self.units, units)

    def victims(self, units: Tensor, step: int, pin_from: int, found: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Positions [E] (ascending) of the resident units to evict so that ``units`` [K] (ascending) all fit:
        the least used of those not asked for and last used before ``pin_from`` (empty when they fit). Raises
        ``NoRoom`` when even evicting all of those leaves too little. ``found``: ``where(units)``, when known."""
        at, present = self.where(units) if found is None else found
        missing = int((~present).sum())
        over = len(self) + missing - self.budget
        if over <= 0:
            return torch.zeros(0, dtype=torch.int64)
        if self.native:
            return self._victims_native(at[present].to(torch.int64).contiguous(), step, pin_from, over, missing)
        evictable = self.last_use < _step32(pin_from)
        evictable[at[present]] = False  # this lookup's own
        candidates = torch.nonzero(evictable).flatten()
        if candidates.numel() < over:
            raise NoRoom(len(self) - candidates.numel() + missing)
        coldest = torch.topk(self.frequency(candidates, step), over, largest=False).indices
        return torch.sort(candidates[coldest]).values

    def _victims_native(self, asked: Tensor, step: int, pin_from: int, over: int, missing: int) -> Tensor:
        out = torch.empty(over, dtype=torch.int64)
        m = int(
            _library().et_res_victims(
                self._last.data_ptr(), self._uses.data_ptr(), self._n, asked.data_ptr(), asked.numel(),
                _step32(pin_from), _step32(step), USE_DECAY, over, out.data_ptr(),
            )
        )  # fmt: skip
        if m == -2:
            raise MemoryError("Residency: out of memory choosing the rows to evict")
        if m < 0:
            raise RuntimeError(f"Residency: et_res_victims refused its arguments (status {m}; a bug)")
        if m < over:
            raise NoRoom(len(self) - m + missing)
        return out

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
        """The units at ``positions`` [E] (strictly ascending) leave the resident arrays; their slots are free
        again."""
        positions = positions.to(torch.int64).contiguous()
        e, n = int(positions.numel()), self._n
        if e == 0:
            return
        if self.native:
            rc = _library().et_res_remove(
                self._units.data_ptr(), self._slots.data_ptr(), self._last.data_ptr(), self._uses.data_ptr(), n,
                positions.data_ptr(), e, self._free.data_ptr(), self._nfree, self.budget,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"Residency.remove: positions not strictly ascending in [0, {n}) (a bug)")
        else:
            keep = torch.ones(n, dtype=torch.bool)
            keep[positions] = False
            if int(keep.sum()) != n - e:
                raise RuntimeError(f"Residency.remove: positions not distinct in [0, {n}) (a bug)")
            self._free[self._nfree : self._nfree + e] = self._slots[:n][positions]
            for buffer in (self._units, self._slots, self._last, self._uses):
                buffer[: n - e] = buffer[:n][keep]
        self._n -= e
        self._nfree += e

    def clear(self) -> None:
        """Every unit leaves."""
        self.remove(torch.arange(len(self)))

    def insert(self, units: Tensor) -> Tensor:
        """Units [K] (ascending, not resident) join, never used, each in a free slot: merged in O(R + K log R)
        (natively in one pass from the end), each at its place among the R resident ones. Returns their slots
        [K] (int64)."""
        k, n = units.numel(), len(self)
        if n + k > self.budget:
            raise ValueError(f"Residency: {k} more units exceed the budget of {self.budget} ({n} resident)")
        if k == 0:
            return torch.zeros(0, dtype=torch.int64)
        given = self._free[self._nfree - k : self._nfree].flip(0).contiguous()
        new = units.to(self._units.dtype).contiguous()
        if self.native:
            rc = _library().et_res_insert(
                self._units.data_ptr(), self._slots.data_ptr(), self._last.data_ptr(), self._uses.data_ptr(), n,
                self.budget, new.data_ptr(), given.data_ptr(), k, _NEVER,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError("Residency.insert: units not ascending, or resident already (a bug)")
        else:
            never = torch.full((k,), _NEVER, dtype=torch.int32)
            columns = [(self.slots, given), (self.last_use, never), (self.uses, torch.zeros(k))]
            merged, (slots, last, uses) = merge_sorted(self.units, new, columns)
            for buffer, value in ((self._units, merged), (self._slots, slots), (self._last, last), (self._uses, uses)):
                buffer[: n + k] = value
        self._n += k
        self._nfree -= k
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
        assert n + self._nfree == self.budget, "every slot resident or free"
        assert n <= self.budget, f"{n} resident units over the budget of {self.budget}"
        every = torch.sort(torch.cat((self.slots, self.free))).values
        every_slot = torch.arange(self.budget, dtype=torch.int32)
        assert torch.equal(every, every_slot), "slots distinct, in range, and free the others"
        assert n < 2 or bool((self.units[1:] > self.units[:-1]).all()), "units strictly ascending"
        assert bool(torch.isfinite(self.uses).all()) and bool((self.uses >= 0).all()), "uses finite and >= 0"


__all__ = ["USE_DECAY", "NoRoom", "Residency", "find_sorted", "index_dtype", "merge_sorted"]
