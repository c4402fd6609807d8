"""``embtables.sharding.comm`` collectives with real processes (gloo on localhost)."""

from __future__ import annotations

import pytest
import torch
from mp_world import run_world

from embtables.sharding import comm


def _exchange(rank: int, world: int) -> None:
    # Rank r sends r + 1 rows to every rank d, each row [r, d, k]; rank d receives world blocks.
    send_counts = [rank + 1] * world
    rows = torch.tensor([[rank, d, k] for d in range(world) for k in range(rank + 1)])
    got, recv_counts = comm.all_to_all_v(rows, send_counts)
    assert recv_counts == [src + 1 for src in range(world)]
    want = torch.tensor([[src, rank, k] for src in range(world) for k in range(src + 1)])
    assert torch.equal(got, want)
    # Empty sends work too.
    empty, counts = comm.all_to_all_v(torch.zeros(0, 4), [0] * world)
    assert empty.shape == (0, 4) and counts == [0] * world
    # Variable-size gather, and an "any rank" flag.
    parts = comm.all_gather_v(torch.full((rank, 2), float(rank)))
    assert [tuple(p.shape) for p in parts] == [(r, 2) for r in range(world)]
    assert all(bool((p == r).all()) for r, p in enumerate(parts))
    assert comm.any_rank(rank == world - 1) is True
    assert comm.any_rank(False) is False
    assert comm.get_rank() == rank and comm.get_world_size() == world


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_real_processes(world: int) -> None:
    run_world(_exchange, world)


def _one_rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("bad id on rank 1")
    comm.barrier()  # the others wait for rank 1, which never comes: the collective timeout must end it


@pytest.mark.distributed
def test_a_failing_rank_fails_the_run_with_its_traceback() -> None:
    with pytest.raises(Exception, match="bad id on rank 1"):
        run_world(_one_rank_fails, 2, timeout=60, collective_timeout=5)


def test_single_process_fallbacks() -> None:
    rows = torch.arange(6).reshape(3, 2)
    got, counts = comm.all_to_all_v(rows, [3])
    assert torch.equal(got, rows) and counts == [3]
    assert comm.any_rank(True) and not comm.any_rank(False)
    assert [t.tolist() for t in comm.all_gather_v(rows)] == [rows.tolist()]
    with pytest.raises(ValueError, match="send_counts"):
        comm.all_to_all_v(rows, [2])
