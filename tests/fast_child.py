"""Child processes that start in milliseconds: forked from a server that imported torch and embtables once.

A test that runs ``python -m embtables ...`` or ``python -c CODE`` pays seconds of CPU importing torch in
every child; on the 2 cores the suite runs on, that was a large share of its time. ``run`` takes the same
arguments as ``subprocess.run`` and, for those two command forms, forks the child from ``multiprocessing``'s
fork server instead (preloaded with ``PRELOAD``; ``tests/mp_world.py``'s ranks come from the same server). The
child is still a process of its own: a crash (a signal) is its exit status, its exit code is what
``sys.exit`` or an uncaught exception makes it, ``atexit`` handlers run, and it sees its own ``cwd``,
environment, stdin and argv. What a fork cannot give is a variable read while the preloaded modules import
(OpenMP's and the allocator's settings, ``EMBTABLES_NATIVE``, matplotlib's, ...): a command whose environment
changes one of ``IMPORT_TIME_PREFIXES`` runs as a real ``subprocess.run``, as does every other command.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

# torch._dynamo: every job's dense optimizer imports it (torch.optim, about 2 s); pyplot: the jobs' curves
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "matplotlib.pyplot", "embtables",
           "embtables.__main__"]  # fmt: skip
# variables read while the preloaded modules import: a child that changes one must start from scratch
IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "LD_", "PYTHON", "TORCH", "CUDA", "TRITON",
                        "EMBTABLES_NATIVE", "EMBTABLES_CACHE_DIR", "CC", "MPL")  # fmt: skip


@functools.cache
def start_method() -> str:
    """ "forkserver" (preloaded with ``PRELOAD``) where the platform has it, else "spawn"."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def _exit_code(exc: SystemExit) -> int:
    """The status ``python`` exits with for an uncaught ``SystemExit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(argv: list[str], cwd: str, env: dict[str, str], stdin: str, stdout: str, stderr: str) -> None:
    """In the forked child: take the command's cwd, environment and standard streams, run it as ``python``
    would, then leave with its exit code (never returning into multiprocessing's own exit path)."""
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - multiprocessing gave the child a /dev/null of its own
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as the command's environment says, not as the server found it
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = ["", *extra]  # as `python -c` / `python -m` put the working directory first
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            import runpy

            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads finish, as at interpreter exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream has nothing left to write
                stream.flush()
        os._exit(code)


def _forkable(cmd: Sequence[str], env: Mapping[str, str] | None) -> bool:
    if start_method() != "forkserver" or len(cmd) < 3 or cmd[0] != sys.executable:
        return False
    if not (cmd[1] == "-c" or (cmd[1] == "-m" and cmd[2] == "embtables")):
        return False
    if env is None:
        return True
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
    return not any(k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONPATH" for k in changed)


def run(
    cmd: Sequence[str],
    *,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(cmd, ...)`` (the arguments named here only), forked from the preloaded server when
    ``cmd`` is ``[sys.executable, "-m", "embtables", ...]`` or ``[sys.executable, "-c", CODE, ...]``."""
    if not _forkable(cmd, env) or not capture_output:
        return subprocess.run(list(cmd), capture_output=capture_output, text=text, timeout=timeout, env=env,
                              cwd=cwd, input=input, check=check)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="embtables-child-") as tmp:
        paths = [os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")]
        with open(paths[0], "w") as f:
            f.write(input or "")
        for p in paths[1:]:
            open(p, "wb").close()
        ctx = multiprocessing.get_context("forkserver")
        proc = ctx.Process(
            target=_child,
            args=(list(cmd[1:]), os.fspath(cwd or os.getcwd()), dict(os.environ if env is None else env), *paths),
        )
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        outs = []
        for p in paths[1:]:
            with open(p, "rb") as f:
                data = f.read()
            outs.append(data.decode(errors="replace") if text else data)
        if timed_out:
            raise subprocess.TimeoutExpired(list(cmd), timeout or 0.0, output=outs[0], stderr=outs[1])
        done = subprocess.CompletedProcess(list(cmd), int(proc.exitcode or 0), outs[0], outs[1])
        if check:
            done.check_returncode()
        return done


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a rendezvous' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_as_torchrun_workers(cmd: Sequence[str], nproc: int, *, env: Mapping[str, str], **kwargs: Any) -> list[Any]:
    """``cmd`` run by ``nproc`` processes at once through ``run`` (forked where it can be), each with the
    variables ``torchrun --nproc_per_node=nproc`` sets for a worker (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); by rank, each one's completed process, or what its ``run``
    raised (a timeout: a rank whose peer failed first may wait for it until then)."""
    port = str(free_port())
    outs: list[Any] = [None] * nproc

    def worker(rank: int) -> None:
        ranked = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                  "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        try:
            outs[rank] = run(cmd, env=ranked, **kwargs)
        except BaseException as exc:
            outs[rank] = exc

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(nproc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs
