"""``Residency`` (the offloaded cache's bookkeeping, no I/O) driven through random lookups: its invariants hold
after every call, it evicts only units neither asked for nor pinned, the least used of them (against a plain
Python recount), keeps each resident unit in its slot, and refuses exactly when the asked and pinned units
exceed the budget."""

from __future__ import annotations

import random

import pytest
import torch

from embtables.tables.offload_residency import USE_DECAY, NoRoom, Residency


def _frequencies(model: dict[int, tuple[float, int]], step: int) -> dict[int, float]:
    """The decayed use count of each unit of ``model`` ({unit: (uses, last use)}) at ``step``, in float64."""
    return {u: uses * USE_DECAY ** max(0, step - last) for u, (uses, last) in model.items()}


@pytest.mark.parametrize(
    ("unit_bound", "native"), [(40, True), (40, False), (2**40, False)]
)  # units kept as int32 (in C, then in torch), then as int64
@pytest.mark.parametrize("seed", range(4))
def test_random_lookups_keep_the_invariants_and_evict_the_least_used_unpinned_units(
    seed: int, unit_bound: int, native: bool
) -> None:
    rng = random.Random(seed)
    budget = rng.choice([4, 9, 16])
    r = Residency(budget, unit_bound, native=native)
    assert r.native == native
    assert r.units.dtype == (torch.int32 if unit_bound <= 2**31 else torch.int64)
    model: dict[int, tuple[float, int]] = {}  # unit -> (uses as of its last lookup, its last lookup's step)
    refused = 0
    for step in range(300):
        pin_from = step - rng.choice([0, 1])  # a pipelined step keeps the previous one's units
        asked = sorted(rng.sample(range(40), rng.randint(1, budget)))
        counts = [rng.randint(1, 5) for _ in asked]
        units = torch.tensor(asked, dtype=torch.int64)
        pinned = {u for u, (_, last) in model.items() if last >= pin_from and u not in asked}
        missing = [u for u in asked if u not in model]
        try:
            victims = r.victims(units, step, pin_from)
        except NoRoom as room:
            refused += 1
            assert len(pinned) + len(asked) > budget  # the pinned and asked units alone do not fit
            assert room.needed == len(model) - len(set(model) - pinned - set(asked)) + len(missing)
            r.check()
            continue
        chosen = r.units[victims].tolist()
        slots_before = dict(zip(r.units.tolist(), r.slots.tolist()))
        assert not set(chosen) & (pinned | set(asked)), "an asked or pinned unit evicted"
        assert len(chosen) == max(0, len(model) + len(missing) - budget)
        if chosen:  # the least used candidates: none left behind is used less than one chosen
            freq = _frequencies(model, step)
            left = set(model) - pinned - set(asked) - set(chosen)
            assert max(freq[u] for u in chosen) <= min((freq[u] for u in left), default=float("inf")) * (1 + 1e-5)
        r.remove(victims)
        for u in chosen:
            del model[u]
        given = r.insert(torch.tensor(missing, dtype=torch.int64))
        assert torch.equal(r.slots_of(torch.tensor(missing, dtype=torch.int64)), given)
        for u, slot in zip(r.units.tolist(), r.slots.tolist()):  # a unit that stayed kept its slot
            assert slots_before.get(u, slot) == slot
        r.used(units, torch.tensor(counts), step)
        freq = _frequencies(model, step)
        for u, c in zip(asked, counts):
            model[u] = (freq.get(u, 0.0) + c, step)
        r.check()
        assert r.units.tolist() == sorted(model)
        assert bool(r.where(units)[1].all())
    assert 0 < refused < 300  # both outcomes were driven


def test_a_broken_invariant_is_named() -> None:
    r = Residency(3)
    r.insert(torch.tensor([1, 5]))
    r.units = torch.tensor([5, 1])
    with pytest.raises(AssertionError, match="ascending"):
        r.check()
    with pytest.raises(ValueError, match="exceed the budget"):
        Residency(1).insert(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="not resident"):
        Residency(2).used(torch.tensor([3]), torch.tensor([1]), 0)
    r = Residency(3)
    r.insert(torch.tensor([1, 5]))
    r.slots = torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(AssertionError, match="slots distinct"):
        r.check()


@pytest.mark.parametrize("seed", range(3))
def test_the_native_residency_keeps_the_arrays_of_the_torch_one(seed: int) -> None:
    """The same lookups through the C passes (``csrc/residency.c``) and the torch ones: the same resident arrays
    and free slots after every call, and victims of the same uses (a tie may pick either unit: both then evict
    the C one's choice)."""
    g = torch.Generator().manual_seed(seed)
    budget, universe = 3000, 20_000
    c, t = Residency(budget, universe, native=True), Residency(budget, universe, native=False)
    for step in range(60):
        units = torch.unique(torch.randint(0, universe, (int(torch.randint(50, 900, (1,), generator=g)),), generator=g))
        counts = torch.randint(1, 4, units.shape, generator=g)
        pin_from = step - int(torch.randint(0, 2, (1,), generator=g))
        try:
            chosen = c.victims(units, step, pin_from)
        except NoRoom as room:
            with pytest.raises(NoRoom) as also:
                t.victims(units, step, pin_from)
            assert also.value.needed == room.needed
            continue
        torch_chosen = t.victims(units, step, pin_from)
        assert torch.equal(
            torch.sort(c.frequency(chosen, step)).values, torch.sort(t.frequency(torch_chosen, step)).values
        )
        for r in (c, t):
            r.remove(chosen)
            missing = units[~r.where(units)[1]]
            given = r.insert(missing)
            assert torch.equal(r.slots_of(missing), given)
            r.used(units, counts, step)
            r.check()
        for name in ("units", "slots", "last_use", "uses", "free"):
            assert torch.equal(getattr(c, name), getattr(t, name)), (step, name)
    assert len(c) == budget  # the cache filled and rows left it


def test_the_native_passes_refuse_what_they_do_not_expect_and_change_nothing() -> None:
    r = Residency(8, 100, native=True)
    r.insert(torch.tensor([1, 5, 9]))
    before = [getattr(r, n).clone() for n in ("units", "slots", "last_use", "uses", "free")]
    with pytest.raises(RuntimeError, match="ascending"):
        r.remove(torch.tensor([2, 0]))
    with pytest.raises(RuntimeError, match="resident already"):
        r.insert(torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="ascending"):
        r.insert(torch.tensor([7, 6]))
    after = [getattr(r, n) for n in ("units", "slots", "last_use", "uses", "free")]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    r.check()
