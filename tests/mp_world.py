"""Run a function on W real processes joined by a gloo process group on localhost (multi-process tests).

``run_world(fn, W, *args)`` starts W processes; each calls ``fn(rank, W, *args)`` with the default
process group initialised (gloo, a free localhost port, a short collective timeout; ``backend="nccl"``:
NCCL, rank r on GPU r). A worker's
exception fails the test with that worker's traceback; a run that outlives ``timeout`` is killed and
fails instead of hanging. ``fn`` must be a module-level function (it is pickled by name).

The processes come from the fork server of ``fast_child`` that imported torch and embtables once (per pytest
worker): a rank starts in milliseconds instead of importing torch again (seconds of CPU, twice per world).
The server imports only ``fast_child.PRELOAD`` and starts no threads, so its children start as clean as
spawned ones; a rank sets any environment it needs inside ``fn``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from fast_child import free_port, start_method


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, timeout_s: float, args: tuple[Any, ...], backend: str
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world, *args)
        gc.collect()  # modules in reference cycles release their process groups now, not in finalisation
        with contextlib.suppress(RuntimeError):  # a peer may have exited on purpose (the dead-rank tests)
            dist.barrier()  # no rank tears its connections down while another still talks on them
    except BaseException:
        raise RuntimeError(f"rank {rank} of {world} failed:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300,
    collective_timeout: float = 120,
    backend: str = "gloo",
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes (gloo, or NCCL with one GPU per rank); raise
    if any fails or time runs out."""
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), collective_timeout, args, backend),
        nprocs=world,
        join=False,
        start_method=start_method(),
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_world: {world} processes did not finish within {timeout} s (killed).")
    except mp.ProcessRaisedException as exc:
        # torch reports the first dead process it notices, often a rank that only lost its peer; collect
        # every rank's own traceback so the original error is always in the message.
        messages = []
        for rank, path in enumerate(ctx.error_files):
            if os.path.exists(path) and os.path.getsize(path) > 0:
                with open(path, "rb") as f:
                    messages.append(f"--- rank {rank}:\n{pickle.load(f)}")
        raise RuntimeError("\n".join(messages) or str(exc)) from None
