"""Failure behaviour of a sharded ``DistributedEmbedding`` on real gloo processes (issue 7, item 7).

A bad batch or gradient on one rank raises on every rank in that step and changes no table anywhere;
configs that differ between ranks fail at construction; a rank that dies or stops answering makes
the others raise ``CollectiveError`` within the configured timeout instead of hanging."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding import exchange_thread
from embtables.sharding.comm import CollectiveError


def _config(dim: int = 4) -> dict[str, et.FeatureConfig]:
    t = et.TableConfig(10, dim, name="t", initializer=et.TruncatedNormal(seed=1), optimizer=et.Adagrad(0.1))
    return {"a": et.FeatureConfig(t)}


def _ids(rank: int, bad: bool = False) -> dict[str, torch.Tensor]:
    return {"a": torch.tensor([[rank, 3], [99 if bad else 9, rank + 1]])}


def _bad_batch_and_gradient(rank: int, world: int) -> None:
    emb = et.DistributedEmbedding(_config(), sharding="mod")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    # A bad id on rank 1 only: every rank raises in this step's lookup, naming the rank and the rule.
    with pytest.raises(ValueError, match=r"vocabulary_size|rank 1"):
        emb(_ids(rank, bad=rank == 1))
    # The step after is normal on every rank.
    acts = emb(_ids(rank))
    # A gradient of the wrong shape on rank 0 only: every rank refuses, no table changes anywhere.
    grad = torch.ones(3, 4) if rank == 0 else torch.ones_like(acts["a"])
    with pytest.raises(ValueError, match=r"shape|rank 0"):
        emb.apply_gradients({"a": grad})
    # A NaN gradient on rank 1 only.
    grad = torch.full_like(acts["a"], float("nan")) if rank == 1 else torch.ones_like(acts["a"])
    with pytest.raises(ValueError, match="NaN"):
        emb.apply_gradients({"a": grad})
    after = emb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The lookup is still pending: a good gradient now applies on every rank.
    emb.apply_gradients({"a": torch.ones_like(acts["a"])})
    assert not torch.equal(emb.state_dict()["t"], before["t"])


def _mismatched_configs(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"different configs.*dim"):
        et.DistributedEmbedding(_config(dim=4 + rank))


def _dead_rank(rank: int, world: int, marker: str) -> None:
    emb = et.DistributedEmbedding(_config(), timeout=5)
    emb(_ids(rank))
    if rank == 1:
        os._exit(0)  # dies without a word in the middle of a step
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 0 of 2"):
        emb.apply_gradients({"a": torch.ones(2, 4)})
    Path(marker).write_text(f"{time.monotonic() - start:.1f}")


def _silent_rank(rank: int, world: int, marker: str) -> None:
    emb = et.DistributedEmbedding(_config(), timeout=2)
    if rank == 1:
        time.sleep(5)  # alive but never arrives in time
    start = time.monotonic()
    with pytest.raises(CollectiveError):
        emb(_ids(rank))
    if rank == 0:
        Path(marker).write_text(f"{time.monotonic() - start:.1f}")


@pytest.mark.distributed
def test_a_bad_batch_or_gradient_on_one_rank_is_refused_on_every_rank() -> None:
    run_world(_bad_batch_and_gradient, 2)


@pytest.mark.distributed
def test_ranks_built_from_different_configs_fail_at_construction() -> None:
    run_world(_mismatched_configs, 2)


@pytest.mark.distributed
def test_a_dead_rank_makes_the_others_fail_within_the_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "elapsed"
    run_world(_dead_rank, 2, str(marker), timeout=120)
    assert float(marker.read_text()) < 30


@pytest.mark.distributed
def test_a_rank_that_never_arrives_makes_the_others_fail_after_the_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "elapsed"
    run_world(_silent_rank, 2, str(marker), timeout=120)
    assert 1.5 < float(marker.read_text()) < 30


def _overflowing_sums(rank: int, world: int) -> None:
    emb = et.DistributedEmbedding(_config(), sharding="div")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    # Both ranks look up row 3: each gradient is finite, their sum on the owner is not.
    acts = emb({"a": torch.tensor([[3], [3]])})
    with pytest.raises(ValueError, match=r"overflows float32|refused on another rank"):
        emb.apply_gradients({"a": torch.full_like(acts["a"], 3e38)})
    assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items())
    emb.apply_gradients({"a": torch.ones_like(acts["a"])})  # the lookup is still pending: a good gradient applies
    assert not torch.equal(emb.state_dict()["t"], before["t"])


@pytest.mark.distributed
def test_an_owner_sum_that_overflows_is_refused_on_every_rank() -> None:
    run_world(_overflowing_sums, 2)


def _edited_row_on_one_rank(rank: int, world: int) -> None:
    emb = et.DistributedEmbedding(_config(), sharding="div")  # rank 0 owns rows 0-4, rank 1 rows 5-9
    acts = emb({"a": torch.tensor([[3], [8]])})
    shard = emb.local_shards()["t"]
    at = int((shard.rows == (3 if rank == 0 else 8)).nonzero())
    if rank == 1:  # between the lookup and apply_gradients, through .data: the update's check reads it
        shard.tensors[""].data[at] = float("nan")
    before = {k: v.clone() for k, v in shard.tensors.items()}
    # refused on every rank: rank 1 names its table and the row by its global id, rank 0 the other rank
    refusal = r"rank 1: table 't': the update of row 8 would" if rank == 1 else r"refused on another rank"
    with pytest.raises(ValueError, match=refusal):
        emb.apply_gradients({"a": torch.ones_like(acts["a"])})
    for k, v in emb.local_shards()["t"].tensors.items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()) and torch.equal(v.isnan(), before[k].isnan())
    if rank == 1:
        shard.tensors[""].data[at] = 0.5
    emb.apply_gradients({"a": torch.ones_like(acts["a"])})  # the lookup was kept: now it applies on every rank
    assert bool((emb.local_shards()["t"].tensors["accumulators"][at] > before["accumulators"][at]).all())


@pytest.mark.distributed
def test_an_update_refused_by_one_ranks_rows_changes_nothing_on_any_rank() -> None:
    run_world(_edited_row_on_one_rank, 2)


def _pipelined_refusals(rank: int, world: int, thread: str) -> None:
    os.environ[exchange_thread.ENV] = thread  # the sums and the update's check on the exchange thread, or in place
    emb = et.DistributedEmbedding(_config(), sharding="div", pipeline_execution_with_tensor_core=True, timeout=30)
    assert (emb._pipeline.worker is not None) == (thread == "background")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    acts = emb({"a": torch.tensor([[3], [3]])})
    # A gradient checked here (shape, NaN) still raises in apply_gradients, on every rank; the lookup stays.
    with pytest.raises(ValueError, match=r"shape|rank 0"):
        emb.apply_gradients({"a": torch.ones(3, 4) if rank == 0 else torch.ones_like(acts["a"])})
    with pytest.raises(ValueError, match=r"NaN|rank 1"):
        emb.apply_gradients({"a": torch.full_like(acts["a"], float("nan") if rank == 1 else 1.0)})
    # Finite gradients whose sum on the owner overflows: found as the update lands (on the exchange thread, or in
    # place after the next lookup), after apply_gradients returned; the next call that waits for it raises it on
    # every rank, naming the step.
    emb.apply_gradients({"a": torch.full_like(acts["a"], 3e38)})
    with pytest.raises(ValueError, match=r"training step 1 was refused.*(overflows float32|refused on another rank)"):
        emb.state_dict()
    assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items())  # raised once; nothing changed
    # The same in the pipelined loop: the refusal of step 2 surfaces at the apply_gradients of step 3,
    # which changes nothing and keeps its lookup, so calling it again applies step 3.
    acts = emb({"a": torch.tensor([[3], [3]])})
    emb.apply_gradients({"a": torch.full_like(acts["a"], 3e38)})
    acts = emb({"a": torch.tensor([[3], [rank]])})
    with pytest.raises(ValueError, match=r"training step 2 was refused"):
        emb.apply_gradients({"a": torch.ones_like(acts["a"])})
    assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items())
    emb.apply_gradients({"a": torch.ones_like(acts["a"])})
    after = emb.state_dict()
    assert not torch.equal(after["t"][3], before["t"][3]) and torch.equal(after["t"][5], before["t"][5])


@pytest.mark.distributed
@pytest.mark.parametrize("thread", ["background", "in_place"])
def test_a_pipelined_update_refused_as_it_lands_raises_on_every_rank_at_the_next_call(thread: str) -> None:
    run_world(_pipelined_refusals, 2, thread, timeout=120, collective_timeout=30)


def _reused_gradient(rank: int, world: int) -> None:
    import threading

    os.environ[exchange_thread.ENV] = "background"  # the gradient is read on the exchange thread

    def train(reuse: bool) -> dict[str, torch.Tensor]:
        emb = et.DistributedEmbedding(_config(), sharding="div", pipeline_execution_with_tensor_core=True)
        acts = emb({"a": torch.tensor([[3, rank], [9, 1]])})
        engine, go = emb._engine, threading.Event()
        summing = engine.table_gradients

        def late(*args: object) -> object:  # the background reads the gradient only once the caller reused it
            assert go.wait(30)
            return summing(*args)

        engine.table_gradients = late  # type: ignore[method-assign]
        grad = torch.arange(acts["a"].numel(), dtype=torch.float32).reshape(acts["a"].shape) + rank
        emb.apply_gradients({"a": grad})
        if reuse:
            grad.fill_(1e30)
        go.set()
        return emb.state_dict()

    kept, reused = train(reuse=False), train(reuse=True)
    assert all(torch.equal(kept[k], reused[k]) for k in kept)
    # A pipelined module exchanges on a group of its own, with the default group's timeout.
    from embtables.sharding import comm

    group = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True)._engine.group
    assert group is not None and group is not torch.distributed.group.WORLD
    assert comm.timeout_of(group) == comm.timeout_of() == 30


@pytest.mark.distributed
def test_a_pipelined_gradient_reused_after_apply_gradients_returns_changes_nothing() -> None:
    run_world(_reused_gradient, 2, timeout=120, collective_timeout=30)


def _two_pipelined_modules(rank: int, world: int) -> None:
    def batch(t: int) -> dict[str, torch.Tensor]:
        return {"a": torch.tensor([[rank, t % 10], [3, (t + rank) % 10]])}

    def grad(t: int, acts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"a": torch.full_like(acts["a"], 0.1 * (t + 1))}

    def alone() -> dict[str, torch.Tensor]:
        emb = et.DistributedEmbedding(_config(), sharding="div", pipeline_execution_with_tensor_core=True)
        emb.enqueue(batch(0))
        for t in range(6):
            acts = emb.dequeue()
            if t + 1 < 6:
                emb.enqueue(batch(t + 1))
            emb.apply_gradients(grad(t, acts))
        return emb.state_dict()

    want = alone()
    # Two pipelined modules stepped in turn: each one's exchange thread works while the other's runs.
    first, second = (et.DistributedEmbedding(_config(), sharding="div", pipeline_execution_with_tensor_core=True)
                     for _ in range(2))  # fmt: skip
    for emb in (first, second):
        emb.enqueue(batch(0))
    for t in range(6):
        for emb in (first, second):
            acts = emb.dequeue()
            if t + 1 < 6:
                emb.enqueue(batch(t + 1))
            emb.apply_gradients(grad(t, acts))
    for emb in (first, second):
        got = emb.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.distributed
def test_two_pipelined_modules_stepped_in_turn_train_like_one() -> None:
    run_world(_two_pipelined_modules, 2, timeout=120, collective_timeout=30)
