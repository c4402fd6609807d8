"""Offloaded tables sharded over real gloo processes (docs/offload.md): each rank keeps its shard in its own
files, initialized with the rows' global values (the same as one process's), and trains to the bits of the
same sharded tables in memory, div and mod, with and without accumulation, pipelined or not; a rank whose cache
cannot hold a batch's rows makes every rank refuse the lookup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding.lookup_stats import read_all

V, D = 20_000, 64  # a step asks an owner for about 20 distinct rows; its cache holds 48 (two steps' rows)
OPTIMIZERS: dict[str, Any] = {
    "adagrad": lambda: et.Adagrad(0.2),
    "sgd-noacc": lambda: et.SGD(0.3, use_gradient_accumulation=False),
}


def _features(
    directory: str | None, opt_name: str, cache_rows: int = 48, dtype: str = "float32"
) -> dict[str, et.FeatureConfig]:
    offload = et.Offload(directory, cache_rows) if directory is not None else None
    t = et.TableConfig(V, D, name="t", combiner="mean", optimizer=OPTIMIZERS[opt_name](), offload=offload,
                       dtype=getattr(torch, dtype))  # fmt: skip
    return {"a": et.FeatureConfig(t), "s": et.FeatureConfig(t, max_sequence_length=2)}


def _inputs(step: int, lo: int, hi: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(50 + step)
    a = [torch.randint(0, V, (3,), generator=g).tolist() for _ in range(8)]
    s = [torch.randint(0, V, (2,), generator=g).tolist() for _ in range(8)]
    return {"a": et.Ragged.from_lists(a[lo:hi]), "s": et.Ragged.from_lists(s[lo:hi])}


def _grads(step: int, acts: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return {k: torch.randn((8, *v.shape[1:]), generator=g)[lo:hi] for k, v in sorted(acts.items())}


def _ranks(rank: int, world: int, root: str, initial_path: str, cases: list[tuple[str, str, bool, str]]) -> None:
    initial = torch.load(initial_path)
    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    for k, (opt_name, sharding, pipelined, dtype) in enumerate(cases):
        torch.manual_seed(0)
        off = et.DistributedEmbedding(
            _features(f"{root}/{k}", opt_name, dtype=dtype), sharding=sharding,
            pipeline_execution_with_tensor_core=pipelined,
        )  # fmt: skip
        start = off.state_dict()
        if dtype == "float32":
            assert torch.equal(start["t"], initial["t"]), "the initial rows of W ranks are one process's"
        ref = et.DistributedEmbedding(
            _features(None, opt_name, dtype=dtype), sharding=sharding, pipeline_execution_with_tensor_core=pipelined
        )
        ref.load_state_dict(start)
        for step in range(4):
            got, want = off(_inputs(step, lo, hi)), ref(_inputs(step, lo, hi))
            for name in want:
                assert torch.equal(got[name], want[name]), (opt_name, sharding, step, name)
            grads = _grads(step, want, lo, hi)
            off.apply_gradients(grads)
            ref.apply_gradients(grads)
        want_state = ref.state_dict()
        for key, value in off.state_dict().items():
            assert torch.equal(value, want_state[key]), (opt_name, sharding, key)
        stats = off.offload_statistics()["t"]  # summed over the ranks
        assert stats["rows_looked_up"] > 0 and stats["resident_rows"] <= 2 * 48 and stats["evictions"] > 0, stats
    # enqueue(next) before apply_gradients(): the rows this rank owns of its next batch are read ahead
    torch.manual_seed(0)
    off = et.DistributedEmbedding(
        _features(f"{root}/ahead", "adagrad"),
        sharding="mod",
        profile_data_directory=f"{root}/stats",
        profile_sample_rate=1.0,
    )
    ref = et.DistributedEmbedding(_features(None, "adagrad"), sharding="mod")
    ref.load_state_dict(off.state_dict())
    off.enqueue(_inputs(0, lo, hi))
    for step in range(3):
        got, want = off.dequeue(), ref(_inputs(step, lo, hi))
        for name in want:
            assert torch.equal(got[name], want[name]), ("read ahead", step, name)
        if step < 2:
            off.enqueue(_inputs(step + 1, lo, hi))
        grads = _grads(step, want, lo, hi)
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
    summed = off.offload_statistics()["t"]
    assert summed["rows_prefetched"] > 0
    off.flush()  # rank 0 writes the lookup statistics: the table's file holds every rank's cache counters
    if rank == 0:
        (doc,) = [d for d in read_all(f"{root}/stats") if d["table"]["name"] == "t"]
        assert doc["offload"] == summed
    # one rank's cache too small for its rows: every rank refuses the same lookup
    small = et.DistributedEmbedding(_features(f"{root}/small", "adagrad", cache_rows=32), sharding="div")
    ids = {"a": et.Ragged.from_lists([list(range(40))] if rank == 0 else [[1]]), "s": et.Ragged.from_lists([[1]])}
    with pytest.raises(ValueError, match=r"rank 0 refused the lookup.*cache_rows=32"):
        small(ids)


@pytest.mark.distributed
def test_sharded_offloaded_tables_train_to_the_bits_of_sharded_tables_in_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    one = et.DistributedEmbedding(_features(str(tmp_path / "one"), "adagrad"))
    torch.save({"t": one.state_dict()["t"].clone()}, tmp_path / "initial.pt")
    cases = [
        ("adagrad", "div", False, "float32"),
        ("sgd-noacc", "mod", False, "float32"),
        ("adagrad", "mod", True, "float32"),
        ("adagrad", "mod", False, "bfloat16"),  # each slot's update rounded with its row's global id
    ]
    run_world(_ranks, 2, str(tmp_path / "rows"), str(tmp_path / "initial.pt"), cases)


def _pooled_features(directory: str | None) -> dict[str, et.FeatureConfig]:
    """Tables whose features are all combined: pooled on the owners, in memory and offloaded alike."""
    # a step asks an owner for about 36 rows of "summed": its 64-row cache writes rows back and reads them again
    offload = (lambda name: et.Offload(f"{directory}/{name}", 64)) if directory is not None else (lambda name: None)
    summed = et.TableConfig(V, 16, name="summed", combiner="sum", offload=offload("summed"))
    meaned = et.TableConfig(V, 16, name="meaned", combiner="sqrtn", offload=offload("meaned"))
    return {"a": et.FeatureConfig(summed), "b": et.FeatureConfig(meaned), "w": et.FeatureConfig(summed)}


def _pooled_inputs(step: int, lo: int, hi: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ids, weights) of this rank's bags of 3-6 ids; feature "w" weighted."""
    g = torch.Generator().manual_seed(70 + step)
    lists = {k: [torch.randint(0, V, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)] for k in ("a", "b", "w")}  # fmt: skip
    weights = [torch.rand(len(bag), generator=g).tolist() for bag in lists["w"]]
    ids = {k: et.Ragged.from_lists(v[lo:hi]) for k, v in lists.items()}
    return ids, {"a": None, "b": None, "w": et.Ragged.from_lists(weights[lo:hi], dtype=torch.float32)}


def _pooled_ranks(rank: int, world: int, root: str) -> None:
    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    for sharding in ("div", "mod"):
        torch.manual_seed(0)
        off = et.DistributedEmbedding(_pooled_features(f"{root}/{sharding}"), et.Adagrad(0.2), sharding=sharding)
        assert off._engine._pooled_features, "the offloaded tables pool on their owners"
        ref = et.DistributedEmbedding(_pooled_features(None), et.Adagrad(0.2), sharding=sharding)
        ref.load_state_dict(off.state_dict())
        for step in range(4):
            got, want = off(*_pooled_inputs(step, lo, hi)), ref(*_pooled_inputs(step, lo, hi))
            for name in want:
                assert torch.equal(got[name], want[name]), (sharding, step, name)
            g = torch.Generator().manual_seed(900 + step)
            grads = {k: torch.randn((8, 16), generator=g)[lo:hi] for k in sorted(want)}
            off.apply_gradients(grads)
            ref.apply_gradients(grads)
        want_state = ref.state_dict()
        for key, value in off.state_dict().items():
            assert torch.equal(value, want_state[key]), (sharding, key)


@pytest.mark.distributed
def test_sharded_offloaded_bags_of_three_or_more_ids_sum_as_sharded_tables_in_memory(tmp_path: Path) -> None:
    """Bags of 3-6 ids (sum, sqrtn, weighted), W = 2, div and mod: an offloaded table pools on its owners as the
    same table in memory does (each owner's ids in bag order, then the owners' partial sums in rank order), so
    lookups and training are bit-equal (they returned rows and pooled on the asking rank: another order)."""
    run_world(_pooled_ranks, 2, str(tmp_path / "rows"))
