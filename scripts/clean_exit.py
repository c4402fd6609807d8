"""Run a torchrun program that uses embtables and never calls ``destroy_process_group()`` many times,
and count the runs that do not exit 0 (issue 22: gloo used to end about one exit in four with SIGABRT).

    python scripts/clean_exit.py               # 100 runs of 2 processes, prints one JSON line
    python scripts/clean_exit.py --runs 10 --pipelined
    python scripts/clean_exit.py --runs 10 --both   # each run: a synchronous and a pipelined module
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = '''
import sys
import torch
import torch.distributed as dist
import embtables as et

dist.init_process_group("gloo")              # as README.md and docs/sharding.md show it
table = et.TableConfig(100, 4, name="t")
modules = [
    et.DistributedEmbedding({"a": et.FeatureConfig(table)}, optimizer=et.Adagrad(0.1), sharding="div",
                            pipeline_execution_with_tensor_core=pipelined)
    for pipelined in {"sync": [False], "pipelined": [True], "both": [False, True]}[sys.argv[1]]
]
for emb in modules:
    for step in range(3):
        acts = emb({"a": torch.tensor([dist.get_rank(), 5 + step])})
        acts["a"].sum().backward()
        emb.apply_gradients()
print("rank", dist.get_rank(), "done")      # and no destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--pipelined", action="store_true", help="the module pipelined")
    p.add_argument("--both", action="store_true", help="a synchronous and a pipelined module in each run")
    args = p.parse_args(argv)
    mode = "both" if args.both else "pipelined" if args.pipelined else "sync"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    failures: list[dict[str, object]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "train.py"
        program.write_text(PROGRAM)
        for i in range(args.runs):
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                 f"--master_port={free_port()}", str(program), mode],
                capture_output=True, text=True, env=env, timeout=300,
            )  # fmt: skip
            if proc.returncode != 0:
                failures.append({"run": i, "rc": proc.returncode, "tail": proc.stderr[-400:]})
            print(f"run {i + 1}/{args.runs}: exit {proc.returncode}", file=sys.stderr, flush=True)
    print(json.dumps({"runs": args.runs, "nproc": args.nproc, "pipelined": args.pipelined, "mode": mode,
                      "failed": len(failures), "seconds": round(time.perf_counter() - start, 1),
                      "failures": failures[:3]}))  # fmt: skip
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
