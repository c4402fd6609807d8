"""Run a snippet in a fresh Python process, so that a crash (segfault, abort) fails the test instead
of killing pytest. The child sees this checkout first on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, *, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run ``code`` (dedented) with ``python -c``; assert exit code 0 and return its stdout.

    A negative return code means the child died from a signal (e.g. -11 is a segmentation fault)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    proc = subprocess.run(
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
