"""Where a pipelined sharded module's background work runs (``sharding/exchange_thread.py``): the rule, chosen
the same on every rank, and a bad ``EMBTABLES_PIPELINE_THREAD`` refused by every rank alike. That both places
give the same bits is tested by ``test_sharded_equivalence.py`` (each pipelined case in both modes)."""

from __future__ import annotations

import os

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding import exchange_thread
from embtables.sharding.exchange_thread import RankRoom, decide


def _room(host: str = "a", cores: int = 2, threads: int = 1, gpu: bool = False, forced: str = "auto") -> RankRoom:
    return RankRoom(host, cores, threads, gpu, forced)


def test_the_thread_is_used_only_where_every_rank_has_a_gpu_or_a_spare_core() -> None:
    # two ranks on one 2-core host, one torch thread each: no core left over, no GPU: in place
    assert not decide([_room(), _room()])
    # the same ranks on 4 cores (2 a rank for 1 thread), or on two hosts (2 cores a rank): the thread
    assert decide([_room(cores=4), _room(cores=4)])
    assert decide([_room(host="a"), _room(host="b")])
    # a rank whose torch threads take all its cores has no room, and one such rank decides for all
    assert not decide([_room(host="a", cores=8, threads=8), _room(host="b", cores=8, threads=2)])
    # a GPU takes the dense model: the thread, whatever the cores
    assert decide([_room(gpu=True), _room(gpu=True)])
    assert not decide([_room(gpu=True), _room()])


def test_the_setting_forces_either_way_and_the_ranks_still_agree() -> None:
    assert decide([_room(forced="background"), _room(forced="background")])
    assert not decide([_room(cores=64, gpu=True, forced="in_place"), _room(cores=64, gpu=True)])
    assert not decide([_room(forced="background"), _room()])  # the other rank has no room
    with pytest.raises(ValueError, match=r"EMBTABLES_PIPELINE_THREAD='threads' on rank 1 is not a choice"):
        decide([_room(), _room(forced="threads")])


def _config() -> dict[str, et.FeatureConfig]:
    return {"f": et.FeatureConfig(et.TableConfig(40, 4, name="t", optimizer=et.SGD(0.1)))}


def _bad_setting_on_rank_one(rank: int, world: int) -> None:
    torch.manual_seed(0)
    os.environ[exchange_thread.ENV] = "threads" if rank == 1 else "auto"
    with pytest.raises(ValueError, match=r"EMBTABLES_PIPELINE_THREAD='threads' on rank 1 is not a choice"):
        et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True, sharding="div")
    # a synchronous module never asks (nothing runs in the background), and both ranks go on together
    emb = et.DistributedEmbedding(_config(), sharding="div")
    acts = emb({"f": et.Ragged.from_lists([[1, 2], [39]])})
    emb.apply_gradients({"f": torch.ones_like(acts["f"])})
    assert emb._pipeline.worker is None


@pytest.mark.distributed
def test_a_bad_setting_on_one_rank_is_refused_by_every_rank() -> None:
    run_world(_bad_setting_on_rank_one, 2)
