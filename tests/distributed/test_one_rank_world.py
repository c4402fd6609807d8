"""A process group of one rank through the sharded engine, on the CPU over gloo (the same check runs over
NCCL on a GPU in tests/numerics/test_gpu_engine.py)."""

from __future__ import annotations

from one_rank_world import run_one_rank_world


def test_a_world_of_one_rank_takes_the_sharded_engine_and_trains_like_one_process() -> None:
    assert run_one_rank_world("gloo", "cpu") == "ShardedEmbeddingCollection"
