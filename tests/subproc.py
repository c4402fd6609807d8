"""Run a snippet in a fresh Python process, so that a crash (segfault, abort) fails the test instead
of killing pytest. The child sees this checkout first on ``sys.path``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fast_child

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, *, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run ``code`` (dedented) with ``python -c``; assert exit code 0 and return its stdout.

    A negative return code means the child died from a signal (e.g. -11 is a segmentation fault)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    proc = fast_child.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative = killed by signal)\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def kill_while_writing(code: str, root: Path, pattern: str = ".embtables-tmp-ckpt-*/rank-00000.safetensors") -> None:
    """Run ``code`` (a writer given ``root`` as ``sys.argv[1]``, printing "ready" before it writes) in a fresh
    process and SIGKILL it once a file matching ``pattern`` under ``root`` is being written (or after 60 s)."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = list(root.glob(pattern))
        if files and files[0].stat().st_size > 0:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def run_on_small_disk(
    code: str, directory: Path, *args: str, size: str = "1m", read_only: bool = False, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented; ``sys.argv[1:]`` = ``args``) with a tmpfs of ``size`` mounted on ``directory``
    (``read_only``: a read-only one) in a private mount namespace (as root, or as a user through a user namespace):
    a real full disk. Skips the test where neither works here."""
    import pytest

    mount = f"mount -t tmpfs -o size={size}{',ro' if read_only else ''} tmpfs {directory}"
    prefix = None
    for flags in (["-m"], ["-r", "-m"]) if shutil.which("unshare") else ():
        probe = subprocess.run(["unshare", *flags, "sh", "-c", f"{mount} && echo ok"], capture_output=True, text=True)
        if probe.returncode == 0 and "ok" in probe.stdout:
            prefix = ["unshare", *flags, "sh", "-c", f'{mount} && exec "$@"', "sh"]
            break
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -m as root, or -r -m) for a small tmpfs")
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
