"""Latency at small batches, where fixed costs dominate (issue 16): one training step of 8 tables of
2000 x 24 (Adagrad), batch 64 / 512 / 2048, 1 / 5 / 20 ids per bag, embtables next to FBGEMM's TBE and
plain PyTorch in the same run, one thread by default (a serving or small-model trainer's setting).

    python -m embtables bench latency                  # JSON lines on stdout, progress on stderr
    python -m embtables bench latency --threads 2 --batches 64,512 --pooling 1 --impls embtables,fbgemm
    python -m embtables bench latency --variation ctr26 --batches 64 --pooling 1   # 26 tables x 100k x 16

Each measurement is a ``train_step`` JSON line as ``embtables bench`` prints them; then one
``latency_summary`` line per size with every impl's least median over ``--rounds`` round-robin rounds and
each peer's ratio to embtables' (``ours``: the
concatenated impl when measured; > 1: embtables is faster; ``speedup_per_feature``: the same against the
default per-feature output, ``embtables``), and a Markdown table on stderr (``--out FILE``
writes it too).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    OPTIMIZERS,
    bench_impl,
    check_table_out,
    emit,
    emit_skip,
    emit_table,
    env_record,
    keep_freed_memory,
)
from benchmarks.peers import IMPLS
from benchmarks.workload import make_batches, variation


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def ours_of(impls: Sequence[str]) -> str:
    """The embtables impl the peers are compared with: the concatenated one when measured (the same output
    as FBGEMM's TBE: one [B, tables x D] tensor), else the nest of per-feature activations."""
    for name in ("embtables-concat", "embtables"):
        if name in impls:
            return name
    return "embtables"


def summary_table(summaries: list[dict[str, Any]], impls: Sequence[str]) -> str:
    """The Markdown table of the ``latency_summary`` records: median ms per impl, peers' ratios to ours."""
    ours = [i for i in impls if i.startswith("embtables")]
    peers = [i for i in impls if not i.startswith("embtables")]
    best = ours_of(impls)
    head = "| batch | ids per bag | " + " | ".join(f"{o} ms" for o in ours)
    head += "".join(f" | {p} ms ({best} speed-up)" for p in peers) + " |"
    lines = [head, "|" + " --- |" * (2 + len(ours) + len(peers))]
    for s in summaries:
        cells = [str(s["batch"]), str(s["pooling"])]
        cells += [f"{s['median_ms'].get(o, float('nan')):.3f}" for o in ours]
        for p in peers:
            ms = s["median_ms"].get(p)
            ratio = s["speedup"].get(p)
            cells.append("—" if ms is None else f"{ms:.3f} ({ratio:.2f}x)" if ratio is not None else f"{ms:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embtables bench latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--impls", default="embtables,embtables-concat,fbgemm,torch", help=f"comma list of {', '.join(IMPLS)}"
    )
    ap.add_argument(
        "--variation", default="small", choices=["small", "ctr26"], help="the tables: 8 x 2000 x 24, or 26 x 100k x 16"
    )
    ap.add_argument("--batches", default="64,512,2048")
    ap.add_argument("--pooling", default="1,5,20", help="ids per bag")
    ap.add_argument("--optimizer", default="adagrad", choices=sorted(OPTIMIZERS))
    ap.add_argument("--ids", default="uniform", choices=["uniform", "zipf"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (and embtables' kernels)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="impls timed round-robin this many times per size; the least median counts (this VM's speed drifts)",
    )
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", help="also write the Markdown table here")
    ap.add_argument(
        "--malloc",
        default="keep",
        choices=["keep", "default"],
        help="keep: glibc keeps freed memory (mallopt, every impl alike; see _harness.keep_freed_memory)",
    )
    args = ap.parse_args(argv)
    check_table_out(ap, args.out)
    torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    emit(env_record())
    impls = _names(args.impls)
    opt = OPTIMIZERS[args.optimizer]
    summaries = []
    for batch in _ints(args.batches):
        for pooling in _ints(args.pooling):
            name = f"latency {args.variation} b{batch} p{pooling}"
            wl = variation(args.variation, ids=args.ids, batch=batch, pooling=pooling, name=name)
            batches = make_batches(wl)
            rounds: dict[str, list[float]] = {}
            for _ in range(max(1, args.rounds)):  # round-robin, so a slow spell of the machine hits every impl
                for name in impls:
                    if name not in IMPLS:
                        emit_skip("train_step", name, f"unknown impl (known: {', '.join(IMPLS)})")
                        continue
                    rec = bench_impl(name, IMPLS[name], wl, batches, opt, "train", args.warmup, args.steps)
                    if rec is not None:
                        rounds.setdefault(name, []).append(float(rec["median_ms"]))
                    gc.collect()
            medians = {name: min(ms) for name, ms in rounds.items()}
            best = ours_of(impls)
            ours = medians.get(best)
            summary = {
                "bench": "latency_summary",
                "batch": batch,
                "pooling": pooling,
                "tables": wl.tables,
                "rows": wl.rows,
                "dim": wl.dim,
                "optimizer": args.optimizer,
                "threads": args.threads,
                "median_ms": medians,  # the least of the rounds' medians
                "round_medians_ms": rounds,
                "ours": best,
                "speedup": {
                    k: round(v / ours, 3) for k, v in medians.items() if ours and not k.startswith("embtables")
                },
                "speedup_per_feature": {
                    k: round(v / medians["embtables"], 3)
                    for k, v in medians.items()
                    if medians.get("embtables") and not k.startswith("embtables")
                },
            }
            emit(summary)
            summaries.append(summary)
    emit_table(summary_table(summaries, impls), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
