"""The standard benchmark: every selected impl x optimizer x id distribution x variation in ONE process.

    embtables bench                                        # standard workload, all peers, Adagrad
    embtables bench --optimizers adagrad,sgd --ids zipf,uniform --variations standard,dim16
    embtables bench --modes lookup --impls torch,fbgemm
    embtables bench --probe-only                           # the machine's memory bandwidth only

(``python3 benchmarks/run.py`` from a checkout is the same.) Results are JSON lines on stdout (one per
measurement, plus an ``env`` line and ``skipped`` lines); progress goes to stderr. Impls run one after
another, each freed before the next is built, so the peak RSS of one does not include another's tables.
Every impl, embtables included, is registered with :func:`benchmarks.peers.register_impl`.

The other benchmarks, each with its own --help (BENCHMARKS.md has their results):

    embtables bench latency            small batches (64 to 64k) against the peers, one and more threads
    embtables bench sharded            W = 1 vs W = 2 processes, and TorchRec DMP
    embtables bench estimator          the Estimator's overhead over the bare module
    embtables bench checkpoint         save / restore / export times and sizes
    embtables bench movielens          the MovieLens job against Surprise's SVD, whole processes
    embtables bench extra-optimizers   the seven TPUEstimator-era optimizers
    embtables bench noacc              use_gradient_accumulation=False
    embtables bench dynamic            dynamic vocabularies against fixed tables
    embtables bench precision          bfloat16 rows (and slots) against float32
    embtables bench subnormals         a step over subnormal rows and gradients against ordinary ones
    embtables bench offload            offloaded tables (rows on disk) against the same tables in memory
    embtables bench gpu                the fused GPU kernels (embtables bench --device cuda)
    embtables bench gpu-launches       the GPU step's launches and host syncs, counted on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    OPTIMIZERS,
    RECORDS,
    bench_impl,
    emit,
    emit_skip,
    env_record,
    workload_fields,
)
from benchmarks.check import oracle_check
from benchmarks.membw import probe
from benchmarks.peers import IMPLS
from benchmarks.report import write_report
from benchmarks.workload import VARIATIONS, Workload, make_batches, variation

DEFAULT_PEERS = ("torch", "fbgemm", "fbgemm-rowwise", "torchrec", "tensorflow")  # the peers, in order


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def fits(wl: Workload, slots: int, mode: str) -> tuple[bool, str]:
    """Weights + optimizer slots (+25% and 1 GiB headroom for inputs, gradients and copies)."""
    need = wl.table_bytes() * (1 + (slots if mode == "train" else 0))
    need = int(need * 1.25) + (1 << 30)
    have = available_memory_bytes()
    return need <= have, f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"


def run(
    impls: Sequence[str],
    optimizers: Sequence[str],
    ids: Sequence[str],
    variations: Sequence[str],
    modes: Sequence[str],
    steps: int,
    warmup: int,
    overrides: dict[str, Any] | None = None,
    wait_idle_s: float = 0.0,
) -> list[dict[str, Any]]:
    results = []
    for vname in variations:
        for dist in ids:
            wl = variation(vname, ids=dist, **(overrides or {}))
            batches = None
            for mode in modes:
                for oname in optimizers if mode == "train" else ["lookup"]:
                    opt = OPTIMIZERS.get(oname, OPTIMIZERS["sgd"])
                    ok, why = fits(wl, opt.slots, mode)
                    for name in impls:
                        bench = "train_step" if mode == "train" else "lookup"
                        if name not in IMPLS:
                            emit_skip(bench, name, f"unknown impl (known: {', '.join(IMPLS)})")
                            continue
                        if not ok:
                            emit_skip(bench, name, f"does not fit in memory: {why}", **workload_fields(wl))
                            continue
                        if batches is None:
                            batches = make_batches(wl)
                        rec = bench_impl(
                            name,
                            IMPLS[name],
                            wl,
                            batches,
                            opt,
                            mode,
                            warmup,
                            steps,
                            wait_idle_s=wait_idle_s,
                            retries=3 if wait_idle_s > 0 else 0,
                        )
                        if rec is not None:
                            results.append(rec)
                        gc.collect()
    return results


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embtables bench",  # also `python3 benchmarks/run.py`
        description=__doc__.replace("``", "").replace(":func:", "") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--impls", default=",".join(["embtables", *DEFAULT_PEERS]), help=f"comma list of {', '.join(IMPLS)}"
    )
    ap.add_argument("--no-check", action="store_true", help="skip the one-step checks against the oracle")
    ap.add_argument("--out", default="bench_out", help="where report.md, chart.png and results.jsonl go")
    ap.add_argument("--optimizers", default="adagrad", help=f"comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--ids", default="zipf", help="zipf,uniform")
    ap.add_argument("--variations", default="standard", help=f"comma list of {', '.join(VARIATIONS)}")
    ap.add_argument("--modes", default="train", help="train,lookup")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-probe", action="store_true", help="skip the memory-bandwidth probe")
    ap.add_argument("--probe-only", action="store_true")
    ap.add_argument("--probe-gib", type=float, default=2.0, help="probe table size in GiB")
    ap.add_argument("--tables", type=int, help="override the workload's table count")
    ap.add_argument("--rows", type=int, help="override the workload's row count")
    ap.add_argument("--batch", type=int, help="override the workload's batch size")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each measurement wait up to S seconds for other processes to go idle",
    )
    args = ap.parse_args(argv)
    emit(env_record())
    overrides = {k: v for k in ("tables", "rows", "batch") if (v := getattr(args, k)) is not None}
    if not args.no_probe:
        shapes: dict[tuple[int, int], int] = {}  # (dim, rows) -> ids per table per step; one probe each
        for vname in _csv(args.variations):
            w = variation(vname, **overrides)  # the sizes measured, --rows / --batch included
            shapes.setdefault((w.dim, w.rows), w.batch * w.pooling)
        for (dim, rows), run_len in sorted(shapes.items()):
            probe(
                dim=dim,
                rows=rows,
                run=run_len,
                table_gib=args.probe_gib,
                wait_idle_s=args.wait_idle,
                retries=3 if args.wait_idle else 0,
            )
        gc.collect()
    if args.probe_only:
        return 0
    if not args.no_check:
        for name in _csv(args.impls):
            for oname in _csv(args.optimizers):
                if name in IMPLS and "train" in _csv(args.modes):
                    oracle_check(name, IMPLS[name], OPTIMIZERS[oname])
    run(
        _csv(args.impls),
        _csv(args.optimizers),
        _csv(args.ids),
        _csv(args.variations),
        _csv(args.modes),
        args.steps,
        args.warmup,
        overrides,
        args.wait_idle,
    )
    out = Path(args.out)
    write_report(RECORDS, out)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    print(f"report: {out / 'report.md'}, {out / 'chart.png'}, {out / 'results.jsonl'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
