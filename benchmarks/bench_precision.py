"""Half-precision tables against float32 (issue 41), side by side in one process:

    python -m embtables bench precision                       # standard (2 threads) and small (1 thread)
    python -m embtables bench precision --workloads small --steps 200

The impls ``embtables`` (float32), ``embtables-bf16`` (bfloat16 rows, float32 slots),
``embtables-bf16-slots`` (bfloat16 rows and slots), ``embtables-bf16-slots-nearest`` (the same rounded to nearest:
the stochastic rounding's own cost is the ratio of the two), and the peers ``fbgemm`` (float32) and ``fbgemm-fp16``
(FBGEMM's CPU TBE with float16 weights, float32 slots: the half peer; skipped when fbgemm_gpu is missing),
Adagrad, Zipf ids, on the standard workload (8 x 1M x 64, batch 4096, 20 ids a bag) with 2 threads and the
small one (8 x 2000 x 24, batch 512, one id) with 1 thread. Each measurement is a ``train_step`` JSON line as
``embtables bench`` prints them; then one ``precision_summary`` line per workload: every impl's median step, its
ratio to float32, the bytes of its tables and slots, its peak RSS, its useful bytes per second and their share of
the random-gather ceiling of rows of its size (the memory probe, ``--no-probe`` skips it), the stochastic rounding's
cost (``stochastic_vs_nearest``) and the half peer's step over embtables' (``fbgemm_fp16_vs_bf16_slots``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import RECORDS, emit, env_record
from benchmarks.membw import probe
from benchmarks.run import run
from benchmarks.workload import variation

IMPLS = ("embtables", "embtables-bf16", "embtables-bf16-slots", "embtables-bf16-slots-nearest", "fbgemm", "fbgemm-fp16")
THREADS = {"standard": 2, "small": 1}
ROW_BYTES = {"embtables": 4, "embtables-bf16": 2, "embtables-bf16-slots": 2, "embtables-bf16-slots-nearest": 2,
             "fbgemm": 4, "fbgemm-fp16": 2}  # fmt: skip
SLOT_BYTES = {"embtables": 4, "embtables-bf16": 4, "embtables-bf16-slots": 2, "embtables-bf16-slots-nearest": 2,
              "fbgemm": 4, "fbgemm-fp16": 4}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="standard,small", help="comma list of standard, small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-probe", action="store_true", help="skip the random-gather ceiling")
    args = ap.parse_args(argv)
    emit(env_record())
    for name in [w for w in args.workloads.split(",") if w]:
        wl = variation(name)
        threads = THREADS.get(name, 1)
        torch.set_num_threads(threads)
        ceilings: dict[int, float] = {}
        if not args.no_probe:
            for value_bytes in sorted(set(ROW_BYTES.values())):  # rows of the bytes each impl's rows take
                got = probe(dim=wl.dim * value_bytes // 4, rows=wl.rows, run=wl.batch * wl.pooling, threads=threads)
                gathers = [r["GBps"] for r in got if r["bench"] == "membw_gather" and r["layout"] == "table"]
                ceilings[value_bytes] = max(gathers) if gathers else 0.0
        first = len(RECORDS)
        run(list(IMPLS), ["adagrad"], ["zipf"], [name], ["train"], args.steps, args.warmup)
        measured = {r["impl"]: r for r in RECORDS[first:] if r.get("bench") == "train_step"}
        emit(_summary(name, wl, threads, measured, ceilings))
    return 0


def _summary(
    name: str, wl: Any, threads: int, measured: dict[str, dict[str, Any]], ceilings: dict[int, float]
) -> dict[str, Any]:
    measured = {k: r for k, r in measured.items() if "median_ms" in r}  # skipped impls have none
    base = measured.get("embtables", {}).get("median_ms")
    stochastic = measured.get("embtables-bf16-slots", {}).get("median_ms")
    nearest = measured.get("embtables-bf16-slots-nearest", {}).get("median_ms")
    out: dict[str, Any] = {"bench": "precision_summary", "workload": name, "threads": threads, "impls": {}}
    for impl in IMPLS:
        r = measured.get(impl)
        if r is None:
            continue
        table_bytes = wl.tables * wl.rows * wl.dim * (ROW_BYTES[impl] + SLOT_BYTES[impl])  # Adagrad: one slot
        ceiling = ceilings.get(ROW_BYTES[impl], 0.0)
        out["impls"][impl] = {
            "median_ms": r["median_ms"],
            "vs_float32": round(r["median_ms"] / base, 3) if base else None,
            "table_and_slot_GiB": round(table_bytes / 2**30, 3),
            "peak_rss_MB": r.get("peak_rss_MB"),
            "useful_GBps": r.get("useful_GBps"),
            "gather_ceiling_GBps": ceiling or None,
            "share_of_ceiling": round(r["useful_GBps"] / ceiling, 3) if ceiling and r.get("useful_GBps") else None,
        }
    if stochastic and nearest:
        out["stochastic_vs_nearest"] = round(stochastic / nearest, 3)  # the goal: <= 1.10
    half_peer = measured.get("fbgemm-fp16", {}).get("median_ms")
    if stochastic and half_peer:
        out["fbgemm_fp16_vs_bf16_slots"] = round(half_peer / stochastic, 3)  # > 1: embtables faster
    return out


if __name__ == "__main__":
    sys.exit(main())
