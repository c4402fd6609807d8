"""The shared-memory channel between the ranks of one host (``embtables/sharding/shm_channel.py``),
on real gloo processes: the same results as gloo for every size and dtype, sizes checked, a killed
peer detected at once, nothing left in /dev/shm, and the fallback to gloo when a rank opts out."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from mp_world import run_world

from embtables.sharding import comm, shm_channel

pytestmark = pytest.mark.skipif(not shm_channel.wanted(), reason="no /dev/shm or no native library here")


def _rows(src: int, dst: int, n: int, width: int, dtype: torch.dtype, round_: int) -> torch.Tensor:
    """The rows rank ``src`` sends rank ``dst`` in round ``round_`` (every rank can compute them)."""
    g = torch.Generator().manual_seed(1000 * round_ + 10 * src + dst)
    return (torch.randn(n, width, generator=g) * 1000).to(dtype)


def _count(src: int, dst: int, round_: int) -> int:
    # Zero rows in some rounds; one message of several MiB (past the first 1 MiB outbox: it grows).
    if round_ == 3:
        return 9000 + 100 * src + dst
    return (7 * src + 3 * dst + round_) % 5 * (round_ + 1)


def _shared_memory_token() -> str:
    """Set up the default group's channel (``comm.transport()`` is then "shared memory") and return its token,
    seen as its file is made: other tests on other workers make channels of their own in the same /dev/shm
    meanwhile, so a test looks for its own channel's names only."""
    tokens: list[str] = []
    create_own = shm_channel.create_own

    def recording(token: str, rank: int, world: int) -> int:
        tokens.append(token)
        return create_own(token, rank, world)

    shm_channel.create_own = recording
    try:
        assert comm.transport() == "shared memory"
    finally:
        shm_channel.create_own = create_own
    assert len(tokens) == 1
    return tokens[0]


def _same_as_gloo(rank: int, world: int, names_path: str) -> None:
    token = _shared_memory_token()
    comm.barrier()  # every rank has left the set-up
    left = [p.name for p in shm_channel.SHM_DIR.glob(f"embtables-{token}-*")]
    assert not left, left  # every name removed at set-up
    dtypes = [torch.float32, torch.int64, torch.float64, torch.float32, torch.int32, torch.uint8]
    for round_, dtype in enumerate(dtypes):
        width = 1 + round_ % 3 * 40
        counts = [_count(rank, d, round_) for d in range(world)]
        send = torch.cat([_rows(rank, d, counts[d], width, dtype, round_) for d in range(world)])
        want = torch.cat([_rows(s, rank, _count(s, rank, round_), width, dtype, round_) for s in range(world)])
        known = [_count(s, rank, round_) for s in range(world)] if round_ % 2 else None
        got, recv = comm.all_to_all_v(send, counts, recv_counts=known)
        assert recv == [_count(s, rank, round_) for s in range(world)]
        assert got.dtype == dtype and torch.equal(got, want), round_
        # The same rows as pieces cut anywhere (empty ones included): copied into the message as they are.
        cuts = sorted({0, send.shape[0], *(int(c) % (send.shape[0] + 1) for c in (7, 7, 3 * round_ + 1, 9001))})
        pieces = [send[a:b] for a, b in itertools.pairwise(cuts)] + [send[:0]]
        got, recv = comm.all_to_all_v(pieces, counts, recv_counts=known)
        assert torch.equal(got, want), round_
    # A non-contiguous send, 1-D rows, agreements and phase headers.
    wide = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3)[:, ::2]
    got, recv = comm.all_to_all_v(wide, [4] * world)
    assert recv == [4] * world and torch.equal(got, torch.cat([wide[4 * rank : 4 * rank + 4]] * world))
    ids = torch.arange(world) + 10 * rank
    got, _ = comm.all_to_all_v(ids, [1] * world)
    assert got.tolist() == [10 * s + rank for s in range(world)]
    assert comm.any_rank(rank == 1) and not comm.any_rank(False)
    assert comm.max_over_ranks(5 * rank) == 5 * (world - 1)
    comm.check_phase("lookup", 3, 99)
    # Sizes the caller expects that differ from what a peer sent: every rank raises, and goes on.
    expect = [2] * world
    expect[(rank + 1) % world] = 3
    with pytest.raises(comm.CollectiveError, match="disagree on the sizes"):
        comm.all_to_all_v(torch.zeros(2 * world, 4), [2] * world, recv_counts=expect)
    got, _ = comm.all_to_all_v(torch.full((world, 2), float(rank)), [1] * world)
    assert got[:, 0].tolist() == [float(s) for s in range(world)]
    # Headers of different phases over the channel: the usual out-of-step error, then back in step.
    with pytest.raises(comm.CollectiveError, match="out of step"):
        comm.check_phase("lookup" if rank else "apply_gradients", 1, 7)
    comm.check_phase("lookup", 2, 7)
    Path(names_path + f".{rank}").write_text("ok")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_the_channel_exchanges_what_gloo_would(world: int, tmp_path: Path) -> None:
    run_world(_same_as_gloo, world, str(tmp_path / "done"), timeout=180, collective_timeout=60)
    assert all((tmp_path / f"done.{r}").exists() for r in range(world))


def _killed_peer(rank: int, world: int, marker: str) -> None:
    token = _shared_memory_token()
    if rank == 0:
        Path(marker + ".token").write_text(token)
    comm.all_to_all_v(torch.ones(world, 3), [1] * world)
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's clean-up must not stop it before it reports
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs: only the kernel releases its lock
    start = time.monotonic()
    with pytest.raises(comm.CollectiveError, match=r"rank 1 is gone"):
        comm.all_to_all_v(torch.ones(world, 3), [1] * world)
    elapsed = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(comm.CollectiveError):  # the process group carries on, and sees the peer gone too
        comm.any_rank(True)
    assert comm.transport() == "gloo"
    Path(marker).write_text(f"{max(elapsed, time.monotonic() - start):.3f}")
    os._exit(0)  # skip the process group's teardown with a dead peer


@pytest.mark.distributed
def test_a_killed_peer_is_detected_long_before_the_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "elapsed"
    with pytest.raises(Exception, match="SIGKILL"):  # rank 1 died by SIGKILL: the launcher reports it
        run_world(_killed_peer, 2, str(marker), timeout=120, collective_timeout=100)
    assert float(marker.read_text()) < 5  # the collective timeout is 100 s
    token = (tmp_path / "elapsed.token").read_text()
    assert not list(shm_channel.SHM_DIR.glob(f"embtables-{token}-*"))  # the killed rank's name too


def _one_rank_opts_out(rank: int, world: int) -> None:
    if rank == 1:
        os.environ["EMBTABLES_SHM"] = "0"
    assert comm.transport() == "gloo"  # every rank falls back when one cannot take part
    got, recv = comm.all_to_all_v(torch.full((world, 2), float(rank)), [1] * world)
    assert recv == [1] * world and got[:, 0].tolist() == [float(s) for s in range(world)]
    assert comm.any_rank(rank == 0)


@pytest.mark.distributed
def test_every_rank_falls_back_to_gloo_when_one_cannot_share_memory() -> None:
    run_world(_one_rank_opts_out, 2, timeout=120, collective_timeout=30)


def test_one_process_needs_no_channel() -> None:
    assert comm.transport() == "local"
    # Pieces are read as their concatenation; pieces that do not fit together are refused.
    got, counts = comm.all_to_all_v([torch.ones(2, 3), torch.zeros(1, 3)], [3])
    assert counts == [3] and torch.equal(got, torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3]))
    with pytest.raises(ValueError, match="share one dtype"):
        comm.all_to_all_v([torch.ones(2, 3), torch.zeros(1, 3, dtype=torch.int64)], [3])
    with pytest.raises(ValueError, match="share one dtype"):
        comm.all_to_all_v([torch.ones(2, 3), torch.zeros(1, 4)], [3])
    with pytest.raises(ValueError, match="nothing to send"):
        comm.all_to_all_v([], [0])


def _full_shm(rank: int, world: int, marker: str) -> None:
    assert comm.transport() == "shared memory"
    comm.all_to_all_v(torch.ones(world, 3), [1] * world)
    if rank == 1:  # /dev/shm full: this rank's outbox cannot grow past its first MiB
        real = os.posix_fallocate

        def full(fd: int, offset: int, size: int) -> None:
            if size > 2 << 20:
                raise OSError(28, "No space left on device")
            real(fd, offset, size)

        os.posix_fallocate = full  # type: ignore[assignment]
    start = time.monotonic()
    with pytest.raises(comm.CollectiveError, match=r"could not grow its shared memory|shared memory is full"):
        comm.all_to_all_v(torch.ones(world * 300_000, 4), [300_000] * world)  # 4.6 MiB to each peer
    Path(marker + f".{rank}").write_text(f"{time.monotonic() - start:.3f}")
    os._exit(0)  # the channel is broken for good: skip the process group's teardown


def _broken_after_an_exchange(rank: int, world: int) -> None:
    comm.all_to_all_v(torch.ones(world, 3), [1] * world)  # the channel is set up
    channel = comm._channel(None)
    assert channel is not None
    if rank == 0:  # slow to see that rank 1 took its message: rank 1 breaks the channel meanwhile
        wait = channel._wait

        def late(peer: int, offset: int, target: int, deadline: float, what: str) -> None:
            if offset == channel._taken():
                time.sleep(0.5)
            wait(peer, offset, target, deadline, what)

        channel._wait = late  # type: ignore[method-assign]
    got, _ = comm.all_to_all_v(torch.full((world, 3), float(rank)), [1] * world)
    assert got[:, 0].tolist() == [0.0, 1.0]  # completed on every rank, though rank 1 broke the channel after it
    if rank == 1:
        channel._fail("rank 1 stopped after the exchange", shm_channel._FAILED)
        time.sleep(2)  # rank 0 reads the broken channel, not a dead process
        os._exit(0)
    with pytest.raises(comm.CollectiveError, match=r"rank 1 failed"):
        comm.all_to_all_v(torch.ones(world, 3), [1] * world)  # the next exchange fails
    os._exit(0)


@pytest.mark.distributed
def test_an_exchange_a_peer_completed_before_it_broke_the_channel_completes_here_too() -> None:
    """A rank that finished an exchange and then broke the channel (its next exchange failed) moves its words
    past that exchange: a peer still waiting in it finishes it, and fails at the next one, as its own error
    was found there (it failed the completed exchange before)."""
    run_world(_broken_after_an_exchange, 2, timeout=60, collective_timeout=30)


@pytest.mark.distributed
def test_a_full_dev_shm_fails_every_rank_at_once(tmp_path: Path) -> None:
    marker = str(tmp_path / "elapsed")
    run_world(_full_shm, 2, marker, timeout=120, collective_timeout=100)
    assert all(float(Path(f"{marker}.{r}").read_text()) < 5 for r in range(2))  # not the 100 s timeout
