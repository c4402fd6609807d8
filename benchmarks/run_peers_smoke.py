"""Smoke run of every peer: tiny configs, a one-step Adagrad check against TPU numerics, the memory
probe, and a short standard-workload Adagrad/Zipf run. One process; JSON lines on stdout.

    python3 benchmarks/run_peers_smoke.py [--steps 10] [--impls torch,fbgemm]

The check runs one Adagrad step (lr 0.1, accumulator 0.1) on 2 tables x 1000 rows x dim 8, batch 16,
pooling 4, from identical weights, and compares each peer with float64 numpy TPU Adagrad:
``g = sum of the activation-gradient rows over every occurrence of a row; a += g^2; w -= lr g / sqrt(a)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks._harness import OPTIMIZERS, Skip, emit, emit_skip, env_record
from benchmarks.membw import probe
from benchmarks.peers import IMPLS
from benchmarks.run import DEFAULT_PEERS, run
from benchmarks.workload import Workload, activation_grad, initial_weights, make_batches

CHECK = Workload(name="check", tables=2, rows=1000, dim=8, batch=16, pooling=4, num_batches=1)
TINY = {"tables": 2, "rows": 10_000, "batch": 64}


def tpu_adagrad_reference(wl: Workload, lr: float, acc0: float) -> list[np.ndarray]:
    batch = make_batches(wl)[0]
    grad = activation_grad(wl).astype(np.float64)
    out = []
    for t in range(wl.tables):
        w = initial_weights(wl, t).astype(np.float64)
        g = np.zeros_like(w)
        sample = np.repeat(np.arange(wl.batch), wl.pooling)
        np.add.at(g, batch.ids[t], grad[sample, t * wl.dim : (t + 1) * wl.dim])
        rows = np.unique(batch.ids[t])
        a = acc0 + g[rows] ** 2
        w[rows] -= lr * g[rows] / np.sqrt(a)
        out.append(w)
    return out


def adagrad_check(name: str) -> dict[str, Any] | None:
    opt = OPTIMIZERS["adagrad"]
    try:
        impl = IMPLS[name](CHECK, make_batches(CHECK), opt, "train")
    except Skip as exc:
        emit_skip("adagrad_check", name, str(exc))
        return None
    if impl.set_weights is None or impl.read_weights is None:
        emit_skip("adagrad_check", name, "impl exposes no set_weights/read_weights")
        return None
    w0 = [initial_weights(CHECK, t) for t in range(CHECK.tables)]
    impl.set_weights(w0)
    impl.run(0)
    got = impl.read_weights()
    ref = tpu_adagrad_reference(CHECK, opt.lr, opt.initial_accumulator)
    abs_err = max(float(np.abs(g - r).max()) for g, r in zip(got, ref, strict=True))
    upd = max(float(np.abs(r - w).max()) for r, w in zip(ref, w0, strict=True))
    rec = {
        "bench": "adagrad_check",
        "impl": impl.impl,
        "optimizer": impl.optimizer,
        "max_abs_err": abs_err,
        "max_update": upd,
        "rel_err_of_update": abs_err / upd,
        "float32_ulp_at_w": float(np.spacing(np.float32(max(float(np.abs(r).max()) for r in ref)))),
        "notes": impl.notes,
    }
    emit(rec)
    return rec


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
    # 2. one-step Adagrad numerics against TPU Adagrad.
    for name in impls:
        adagrad_check(name)
    if args.skip_standard:
        return 0
    # 3. the roofline, then the standard workload (Adagrad, Zipf).
    probe(dim=64, wait_idle_s=args.wait_idle, retries=3 if args.wait_idle else 0)
    run(impls, ["adagrad"], ["zipf"], ["standard"], ["train"], args.steps, 2, wait_idle_s=args.wait_idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
