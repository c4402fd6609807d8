"""The README's sharded example runs under torchrun with 2 CPU processes (gloo) and trains."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mp_world import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_the_sharded_example_trains_under_torchrun(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(ROOT / "examples" / "sharded_training.py"), "--steps", "60", "--sharding", "mod", "--pipeline",
        "--stats-dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[-1] < losses[0], out.stdout
    assert "sharding=[item: mod, user: mod]" in out.stdout
    assert len(list(tmp_path.glob("*.json"))) == 2
