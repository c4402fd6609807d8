"""``DistributedEmbedding.changed_rows`` (issue 43, tracking): the rows the engine's writes changed since the
last save or restore, on every kernel path, for lazy and non-lazy optimizers, updates applied occurrence by
occurrence, dynamic tables and state-dict loads; a refused step changes and marks nothing; sharded over two
ranks, the ranks' rows together are one process's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_world import run_world

import embtables as et


def _module(optimizer: Any, *, accumulate: bool = True, sharding: str | None = None) -> et.DistributedEmbedding:
    b_opt = None if accumulate else et.SGD(0.1, use_gradient_accumulation=False)
    tb = et.TableConfig(30, 8, name="tb", initializer=et.TruncatedNormal(seed=2), optimizer=b_opt)
    features = {
        "a": et.FeatureConfig(et.TableConfig(40, 4, name="ta", initializer=et.TruncatedNormal(seed=1))),
        "b": et.FeatureConfig(tb),
    }
    kwargs = {} if sharding is None else {"sharding": sharding}
    return et.DistributedEmbedding(features, optimizer, **kwargs)


def _ids(step: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(step)
    return {
        "a": [torch.randint(0, 40, (1 + i % 3,), generator=g).tolist() for i in range(6)],
        "b": [torch.randint(0, 30, (2,), generator=g).tolist() for _ in range(6)],
    }


def _step(emb: et.DistributedEmbedding, ids: dict[str, list[list[int]]], scale: float = 1.0) -> None:
    acts = emb({k: et.Ragged.from_lists(v) for k, v in ids.items()})
    (scale * sum(a.sum() for a in acts.values())).backward()
    emb.apply_gradients()


def _union(steps: list[dict[str, list[list[int]]]]) -> dict[str, list[int]]:
    out: dict[str, set[int]] = {"ta": set(), "tb": set()}
    for ids in steps:
        out["ta"].update(i for bag in ids["a"] for i in bag)
        out["tb"].update(i for bag in ids["b"] for i in bag)
    return {k: sorted(v) for k, v in out.items()}


def _changed(emb: et.DistributedEmbedding) -> dict[str, list[int]]:
    return {k: v.tolist() for k, v in emb.changed_rows().items()}


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulated", "occurrence_by_occurrence"])
def test_the_rows_of_every_update_since_the_last_save(kernel_path: str, accumulate: bool, tmp_path: Path) -> None:
    emb = _module(et.Adagrad(0.1), accumulate=accumulate)
    assert _changed(emb) == {"ta": [], "tb": []}
    steps = [_ids(s) for s in range(3)]
    for ids in steps[:2]:
        _step(emb, ids)
    assert _changed(emb) == _union(steps[:2])
    emb.save(tmp_path)
    assert _changed(emb) == {"ta": [], "tb": []}
    _step(emb, steps[2])
    assert _changed(emb) == _union(steps[2:])
    emb.restore(tmp_path)
    assert _changed(emb) == {"ta": [], "tb": []}
    emb.load_state_dict(emb.state_dict())
    assert _changed(emb) == {"ta": list(range(40)), "tb": list(range(30))}


def test_a_non_lazy_optimizer_changes_every_row(kernel_path: str) -> None:
    emb = _module(et.Adam(0.01, lazy_adam=False))
    _step(emb, _ids(0))
    assert _changed(emb) == {"ta": list(range(40)), "tb": list(range(30))}


def test_a_refused_step_marks_nothing(kernel_path: str) -> None:
    emb = _module(et.SGD(1e38))
    _step(emb, _ids(0))
    before = _changed(emb)
    with pytest.raises(ValueError, match="non-finite"):
        _step(emb, _ids(1), scale=1e30)
    assert _changed(emb) == before


def test_a_dynamic_tables_new_keys_mark_their_rows() -> None:
    table = et.TableConfig(8, 4, name="t", dynamic=et.DynamicVocabulary(), initializer=et.TruncatedNormal(seed=3))
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))
    acts = emb({"f": et.Ragged.from_lists([[1001, 7], [2**40]])})
    sum(a.sum() for a in acts.values()).backward()
    emb.apply_gradients()
    changed = emb.changed_rows()["t"]
    assert changed.numel() == 3  # three keys, three rows, each given to its key and updated


def _rank(rank: int, world: int, sharding: str, want: dict[str, list[int]]) -> None:
    os.environ["EMBTABLES_SHM"] = "0"
    emb = _module(et.Adagrad(0.1), sharding=sharding)
    for s in range(2):
        ids = _ids(s)
        lo, hi = rank * 3, rank * 3 + 3  # each rank its half of the global batch
        _step(emb, {k: v[lo:hi] for k, v in ids.items()})
    mine = {k: v.tolist() for k, v in emb.changed_rows().items()}
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    for name, rows in want.items():
        together = sorted(r for part in gathered for r in part[name])
        assert together == rows, (name, together, rows)
        assert len(together) == len(set(together))  # a row is one rank's


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", ["div", "mod"])
def test_sharded_ranks_report_their_own_rows_and_together_one_process(sharding: str) -> None:
    run_world(_rank, 2, sharding, _union([_ids(0), _ids(1)]), timeout=300)
