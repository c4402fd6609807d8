"""Ranks out of step raise on every rank instead of aborting (issue 15, item 4), on real gloo processes.

Every sharded operation starts with a fixed-size phase header (phase, step, tables' fingerprint). Before
it, a rank calling ``apply_gradients`` while another already looked up the next batch made gloo abort a
process on mismatched message sizes; a rank skipping ``save``, ``restore`` or ``flush`` did the same or
hung. Now each case raises ``CollectiveError`` on every rank naming each rank's phase and step, nothing
changes, and the ranks can fall back in step and train on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding import comm, exchange_thread
from embtables.sharding.comm import CollectiveError


def _config(prefix: str = "t") -> dict[str, et.FeatureConfig]:
    return {
        f"f{i}": et.FeatureConfig(
            et.TableConfig(
                10, 3, name=f"{prefix}{i}", initializer=et.TruncatedNormal(seed=i), optimizer=et.Adagrad(0.1)
            )
        )
        for i in range(2)
    }


def _batch(emb: et.DistributedEmbedding, rank: int) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([[rank, 2], [3, 4]]) for k in emb.feature_config}


def _grads(acts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(a) for k, a in acts.items()}


def _tables(emb: et.DistributedEmbedding) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in emb.local_shards()["t0"].tensors.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _out_of_step(rank: int, world: int, root: str) -> None:
    emb = et.DistributedEmbedding(_config(), timeout=30, profile_data_directory=os.path.join(root, "stats"))
    acts = emb(_batch(emb, rank))
    emb.apply_gradients(_grads(acts))
    acts = emb(_batch(emb, rank))  # step 2 looked up on both ranks

    # Rank 1 skips apply_gradients of step 2 and looks up step 3.
    before = _tables(emb)
    with pytest.raises(CollectiveError, match=r"rank 0 is in apply_gradients of step 2, rank 1 is in lookup of step 3"):
        if rank == 0:
            emb.apply_gradients(_grads(acts))
        else:
            emb(_batch(emb, rank))
    assert _same(before, _tables(emb))  # nothing changed on either rank
    emb.apply_gradients(_grads(acts))  # back in step: both apply step 2 (rank 1 kept its lookup)

    # Rank 1 skips save; then skips restore; then skips the statistics flush.
    for op, other in (("save", "lookup of step 3"), ("restore", "state read of step 2"), ("flush", "save of step 2")):
        with pytest.raises(CollectiveError, match=rf"rank 0 is in {op} of step 2, rank 1 is in {other}"):
            if rank == 0:
                {"save": lambda: emb.save(root), "restore": lambda: emb.restore(root), "flush": emb.flush}[op]()
            elif op == "save":
                emb(_batch(emb, rank))
            elif op == "restore":
                emb.state_dict()
            else:
                emb.save(root)
        if op == "save":
            assert not [p for p in Path(root).iterdir() if p.name.startswith("ckpt-")]  # nothing was saved
            emb.save(root)  # in step again: both save
    acts = emb(_batch(emb, rank))
    emb.apply_gradients(_grads(acts))  # and train on

    # Two modules called in a different order: same phase and step, different tables.
    first, second = et.DistributedEmbedding(_config("u")), et.DistributedEmbedding(_config("v"))  # one group
    with pytest.raises(CollectiveError, match=r"different .*fingerprint of the tables"):
        _ = (first if rank == 0 else second).embedding_tables
    # Dense gradients of different sizes (different dense models) are refused before they are summed.
    with pytest.raises(CollectiveError, match=r"numbers of dense gradient values: \[4, 5\]"):
        comm.all_reduce_mean_([torch.ones(4 + rank)], step=7)


@pytest.mark.distributed
def test_ranks_out_of_step_raise_on_every_rank_naming_each_phase(tmp_path: Path) -> None:
    run_world(_out_of_step, 2, str(tmp_path), timeout=120, collective_timeout=30)


def _pipelined_out_of_step(rank: int, world: int) -> None:
    os.environ[exchange_thread.ENV] = "background"  # the early lookup runs on the exchange thread
    emb = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True, timeout=30)
    emb.enqueue(_batch(emb, rank))
    acts = emb.dequeue()
    emb.enqueue(_batch(emb, rank))  # step 2's lookup starts on the exchange thread
    if rank == 0:  # the documented loop
        expected = r"rank 0 is in apply_gradients of step 1, rank 1 is in lookup of step 3"
        with pytest.raises(CollectiveError, match=expected):
            emb.apply_gradients(_grads(acts))
    else:  # forgets apply_gradients and runs ahead
        emb.dequeue()
        emb.enqueue(_batch(emb, rank))
        with pytest.raises(CollectiveError, match=r"out of step"):
            emb.dequeue()


@pytest.mark.distributed
def test_pipelined_ranks_out_of_step_raise_instead_of_aborting() -> None:
    run_world(_pipelined_out_of_step, 2, timeout=120, collective_timeout=30)


def _world_of_one(rank: int, world: int) -> None:
    comm.check_phase("lookup", 0, 0)  # a process group of one rank: nothing to compare, no message
    grads = [torch.ones(3)]
    comm.all_reduce_mean_(grads, step=1)
    assert torch.equal(grads[0], torch.ones(3))


@pytest.mark.distributed
def test_a_process_group_of_one_rank_needs_no_phase_header() -> None:
    run_world(_world_of_one, 1, timeout=60, collective_timeout=30)
