"""Smoke run of every peer: tiny configs, a one-step Adagrad check against TPU numerics, the memory
probe, and a short standard-workload Adagrad/Zipf run. One process; JSON lines on stdout.

    python3 benchmarks/run_peers_smoke.py [--steps 10] [--impls torch,fbgemm]

The check (``benchmarks.check.oracle_check``) runs one Adagrad step (lr 0.1, accumulator 0.1) on
2 tables x 1000 rows x dim 8, batch 16, pooling 4, from identical weights, and compares each impl with
the float64 oracle in ``tests/oracle``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks._harness import OPTIMIZERS, emit, env_record
from benchmarks.check import oracle_check
from benchmarks.membw import probe
from benchmarks.peers import IMPLS
from benchmarks.run import DEFAULT_PEERS, run

TINY = {"tables": 2, "rows": 10_000, "batch": 64}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default=",".join(DEFAULT_PEERS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps on the standard workload")
    ap.add_argument("--skip-standard", action="store_true")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S", help="see run.py --wait-idle")
    args = ap.parse_args(argv)
    impls = [x for x in args.impls.split(",") if x]
    emit(env_record())
    # 1. tiny config, every optimizer and lookup-only: does each peer run at all?
    run(
        impls,
        list(OPTIMIZERS),
        ["zipf"],
        ["standard"],
        ["train", "lookup"],
        steps=2,
        warmup=1,
        overrides={**TINY, "name": "tiny"},
    )
    # 2. one-step numerics against the float64 oracle (TPU Adagrad).
    for name in impls:
        oracle_check(name, IMPLS[name], OPTIMIZERS["adagrad"])
    if args.skip_standard:
        return 0
    # 3. the roofline, then the standard workload (Adagrad, Zipf).
    probe(dim=64, wait_idle_s=args.wait_idle, retries=3 if args.wait_idle else 0)
    run(impls, ["adagrad"], ["zipf"], ["standard"], ["train"], args.steps, 2, wait_idle_s=args.wait_idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
