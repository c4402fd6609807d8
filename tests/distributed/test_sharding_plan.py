"""The row placement of issue 7 (``embtables.sharding.plan``) against spec §3's formulas (``oracle.np_partition``)."""

from __future__ import annotations

import pytest
import torch
from oracle.np_partition import div_owner, mod_owner, shards

from embtables.kernels.affine_rows import AffineRows
from embtables.sharding.plan import TablePlan


def test_spec_examples() -> None:
    assert shards("div", 13, 5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert shards("mod", 13, 5) == [[0, 5, 10], [1, 6, 11], [2, 7, 12], [3, 8], [4, 9]]
    for strategy in ("div", "mod"):
        plan = TablePlan(strategy, 13, 5)
        assert [plan.global_rows(r).tolist() for r in range(5)] == shards(strategy, 13, 5)


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_every_id_against_the_spec_formulas(strategy: str) -> None:
    owner = div_owner if strategy == "div" else mod_owner
    for v in range(1, 41):
        for w in range(1, 8):  # includes V < W (empty shards) and uneven V / W
            plan = TablePlan(strategy, v, w)
            ids = torch.arange(v)
            rank, local = plan.owner(ids)
            assert list(zip(rank.tolist(), local.tolist())) == [owner(i, v, w) for i in range(v)], (v, w)
            sizes = plan.shard_sizes()
            assert sum(sizes) == v and sizes == [len(s) for s in shards(strategy, v, w)]
            for r in range(w):
                rows = plan.global_rows(r)
                assert rows.tolist() == sorted(rows.tolist())
                affine = plan.affine_rows(r)  # a rank owning none: one placeholder row, id V
                assert affine.tensor().tolist() == (rows.tolist() or [v]) and affine.ids(torch.tensor([0])) == (
                    rows[:1] if rows.numel() else v)  # fmt: skip
                back_rank, back_local = plan.owner(rows)
                assert back_rank.tolist() == [r] * len(rows) and back_local.tolist() == list(range(len(rows)))


def test_table_wise() -> None:
    plan = TablePlan("table", 7, 3, rank=2)
    assert plan.shard_sizes() == [0, 0, 7]
    rank, local = plan.owner(torch.tensor([0, 6, 3]))
    assert rank.tolist() == [2, 2, 2] and local.tolist() == [0, 6, 3]
    assert plan.global_rows(2).tolist() == list(range(7)) and plan.global_rows(0).numel() == 0
    assert plan.affine_rows(2) == AffineRows(0, 1, 7) and plan.affine_rows(0) == AffineRows(7, 1, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "row", "vocabulary_size": 4, "world_size": 2}, "strategy"),
        ({"strategy": "div", "vocabulary_size": 0, "world_size": 2}, "vocabulary_size"),
        ({"strategy": "mod", "vocabulary_size": 4, "world_size": 0}, "world_size"),
        ({"strategy": "table", "vocabulary_size": 4, "world_size": 2, "rank": 2}, "rank"),
    ],
)
def test_bad_plans_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TablePlan(**kwargs)  # type: ignore[arg-type]


def test_a_placement_is_one_typed_value() -> None:
    from embtables.sharding.plan import Placement

    assert str(Placement("div")) == "div" and str(Placement("table", 3)) == "table@3"
    plan = TablePlan.of(Placement("table", 1), 10, 2)
    assert plan.placement == Placement("table", 1) and [plan.owned_rows(r) for r in range(2)] == [0, 10]
    assert TablePlan("div", 10, 3).placement == Placement("div")
    for bad in (("rows", 0), ("div", 2), ("table", -1), ("table", True)):
        with pytest.raises(ValueError, match="Placement"):
            Placement(*bad)  # type: ignore[arg-type]
