"""The shared-memory exchange when something fails half-way (issue 38, items 2, 4 and 7), on real gloo
processes: every exchange is all or nothing on every rank, a broken channel hands the exchanges to
the process group (training and ``save`` go on after /dev/shm was full), and a rank killed during the
channel's set-up leaves a file that the next set-up removes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding import comm, shm_channel

pytestmark = pytest.mark.skipif(not shm_channel.wanted(), reason="no /dev/shm or no native library here")

TESTS = Path(__file__).resolve().parent


def _fail_once(kind: str) -> Callable[..., Any]:
    """A replacement for ``_Mapping.reach`` (called after this rank posted its message and before it
    took the peers'): raise once, as an ``mmap`` that fails or a Ctrl-C would, then behave."""
    real = shm_channel._Mapping.reach
    state = {"left": 1}

    def reach(self: Any, end: int) -> None:
        if state["left"]:
            state["left"] = 0
            if kind == "interrupt":
                raise KeyboardInterrupt
            raise OSError(12, "Cannot allocate memory (mmap)")
        real(self, end)

    return reach


def _half_way(rank: int, world: int, kind: str) -> None:
    assert comm.transport() == "shared memory"
    got, _ = comm.all_to_all_v(torch.full((world, 2), float(rank)), [1] * world)
    if rank == 1:
        shm_channel._Mapping.reach = _fail_once(kind)  # type: ignore[method-assign]
    # Rank 1 stops after posting its message: every rank fails this exchange, none reads stale messages.
    errors = (KeyboardInterrupt, comm.CollectiveError) if rank == 1 else comm.CollectiveError
    with pytest.raises(errors) as failed:
        comm.all_to_all_v(torch.full((world, 2), 10.0 + rank), [1] * world)
    if rank == 0:
        assert "rank 1" in str(failed.value), failed.value
    # Then the process group carries every exchange, each with this round's rows.
    for round_ in range(3):
        got, recv = comm.all_to_all_v(torch.full((world, 2), 100.0 * round_ + rank), [1] * world)
        assert recv == [1] * world and got[:, 0].tolist() == [100.0 * round_ + s for s in range(world)]
    assert comm.transport() == "gloo"
    assert comm.any_rank(rank == 1) and comm.max_over_ranks(rank) == world - 1


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["oserror", "interrupt"])
def test_an_exchange_that_fails_half_way_fails_on_every_rank(kind: str) -> None:
    run_world(_half_way, 2, kind, timeout=120, collective_timeout=60)


def _config() -> dict[str, et.FeatureConfig]:
    t = et.TableConfig(5000, 8, name="t", initializer=et.TruncatedNormal(seed=1), optimizer=et.Adagrad(0.1))
    return {"a": et.FeatureConfig(t)}


def _batch(step: int, rank: int, world: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Step ``step``'s ids [B] and gradient [B, 8] for ``rank`` (B = ``rows`` / W): a slice of one
    global batch, so one process running the global batch is the reference."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 5000, (rows,), generator=g)
    grad = torch.randn(rows, 8, generator=g)
    per = rows // world
    return {"a": ids[rank * per : (rank + 1) * per]}, grad[rank * per : (rank + 1) * per]


# Rows per step: step 2's batch sends more than the first MiB of the outbox (its file must grow).
ROWS = [64, 64, 200_000, 64, 200_000]


def _train(emb: et.DistributedEmbedding, step: int, rank: int, world: int) -> None:
    ids, grad = _batch(step, rank, world, ROWS[step])
    emb(ids)
    emb.apply_gradients({"a": grad})


def _half_way_in_training(rank: int, world: int, kind: str, out: str) -> None:
    emb = et.DistributedEmbedding(_config(), sharding="mod")
    for step in range(2):
        _train(emb, step, rank, world)
    assert comm.transport() == "shared memory"
    filler = Path(out + ".filler")
    if kind == "full" and rank == 0:  # /dev/shm full for one step: rank 1's outbox cannot grow
        free = shutil.disk_usage(shm_channel.SHM_DIR).free
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free - (256 << 10))
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    if kind == "oserror" and rank == 1:
        shm_channel._Mapping.reach = _fail_once(kind)  # type: ignore[method-assign]
    comm.barrier()
    with pytest.raises(comm.CollectiveError):  # the step fails on every rank and changes nothing
        _train(emb, 2, rank, world)
    after = emb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    filler.unlink(missing_ok=True)
    comm.barrier()
    for step in range(2, 5):  # the same step again, and on: through the process group
        _train(emb, step, rank, world)
    assert comm.transport() == "gloo"
    emb.save(out + ".ckpt")
    state = emb.state_dict()
    if rank == 0:
        torch.save(state, out + ".state")


def _reference() -> dict[str, torch.Tensor]:
    emb = et.DistributedEmbedding(_config())
    for step in range(5):
        _train(emb, step, 0, 1)
    return emb.state_dict()


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # the owner adds two ranks' sums: float32 rounding of those sums
        torch.testing.assert_close(got[key], value, rtol=2e-5, atol=2e-6, msg=key)


@pytest.mark.distributed
def test_training_goes_on_after_an_exchange_failed_half_way(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    run_world(_half_way_in_training, 2, "oserror", out, timeout=240, collective_timeout=60)
    _same(torch.load(out + ".state"), _reference())
    restored = et.DistributedEmbedding(_config())
    restored.restore(out + ".ckpt")
    _same(restored.state_dict(), _reference())


def _namespace_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def full_shm_in_namespace(out: str) -> None:
    """Run inside a private mount namespace with a small tmpfs on /dev/shm (see the test below)."""
    run_world(_half_way_in_training, 2, "full", out, timeout=240, collective_timeout=60)


@pytest.mark.distributed
def test_a_full_dev_shm_for_one_step_does_not_stop_training_or_saving(tmp_path: Path) -> None:
    if not _namespace_works():
        pytest.skip("no private mount namespace here (unshare -rm and a tmpfs mount are not allowed)")
    out = str(tmp_path / "run")
    code = f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]
        import test_channel_failures
        test_channel_failures.full_shm_in_namespace({out!r})
    """
    script = "mount -t tmpfs -o size=8m tmpfs /dev/shm && exec " + " ".join([sys.executable, "-c", '"$0"'])
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "could not grow its shared memory" in proc.stderr  # the warning of the fall-back names the cause
    _same(torch.load(out + ".state"), _reference())


def _killed_in_set_up(rank: int, world: int, marker: str) -> None:
    if rank == 1:  # dies right after its file got its name, before the peers opened it

        def die(token: str, *args: Any) -> int:
            Path(marker + ".token").write_text(token)  # its channel, among any other worker's in /dev/shm
            deadline = time.monotonic() + 30  # alive (its file locked) until the test holds the file too
            while not Path(marker + ".held").exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
            return -1

        shm_channel.open_peer = die  # type: ignore[assignment]
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's clean-up must not stop it first
    with pytest.raises(comm.CollectiveError):
        comm.transport()
    Path(marker).write_text("done")
    os._exit(0)


def _sets_up(rank: int, world: int) -> None:
    assert comm.transport() == "shared memory"


def _ours(path: Path) -> bool:
    return path.read_bytes()[:8] == np.int64(shm_channel._MAGIC).tobytes()


def _hold_when_named(marker: Path, held: list[int], stop: threading.Event) -> None:
    """Lock the killed rank's channel file (shared, as a live rank holds its own) once the rank has written its
    token and before it dies, then tell it so: a set-up by a test on another worker sweeps only files no process
    holds, so the file stays until this test has looked at it."""
    token_file = Path(str(marker) + ".token")
    while not stop.is_set():
        token = token_file.read_text() if token_file.exists() else ""
        if len(token) == 16:
            with contextlib.suppress(OSError):
                fd = os.open(shm_channel.SHM_DIR / f"embtables-{token}-1", os.O_RDONLY | os.O_CLOEXEC)
                fcntl.flock(fd, fcntl.LOCK_SH)
                held.append(fd)
            Path(str(marker) + ".held").write_text("held")
            return
        time.sleep(0.001)


@pytest.mark.distributed
def test_a_rank_killed_during_set_up_leaves_a_file_the_next_set_up_removes(tmp_path: Path) -> None:
    marker = tmp_path / "done"
    held: list[int] = []
    stop = threading.Event()
    holder = threading.Thread(target=_hold_when_named, args=(marker, held, stop), daemon=True)
    holder.start()
    try:
        with pytest.raises(Exception, match="SIGKILL"):
            run_world(_killed_in_set_up, 2, str(marker), timeout=120, collective_timeout=20)
    finally:
        stop.set()
        holder.join()
    assert marker.exists() and held
    token = (tmp_path / "done.token").read_text()  # tests on other workers may be setting up channels meanwhile
    left = [p for p in shm_channel.SHM_DIR.glob(f"embtables-{token}-*") if _ours(p)]
    assert [p.name for p in left] == [f"embtables-{token}-1"]  # the killed rank's file: it never removed its name
    os.close(held[0])  # now any set-up may sweep it: the next one below must
    # Beside it: a live process's channel file (this one holds it locked), and files that only look alike.
    live = shm_channel.SHM_DIR / "embtables-00112233445566aa-0"
    live_fd = os.open(live, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(live_fd, fcntl.LOCK_SH)
    os.pwrite(live_fd, np.array([shm_channel._MAGIC, 2], dtype=np.int64).tobytes(), 0)
    stranger = shm_channel.SHM_DIR / "embtables-00112233445566bb-0"
    stranger.write_bytes(b"not a channel of embtables, whatever its name")
    odd = shm_channel.SHM_DIR / "embtables-notes-0"
    odd.write_bytes(np.array([shm_channel._MAGIC, 2], dtype=np.int64).tobytes())
    try:
        run_world(_sets_up, 2, timeout=120, collective_timeout=30)
        assert not left[0].exists()
        assert live.exists() and stranger.exists() and odd.exists()
    finally:
        os.close(live_fd)
        for path in (live, stranger, odd):
            path.unlink(missing_ok=True)
