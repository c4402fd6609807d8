"""The cost of subnormal values in a training step (issue 41, item 8; docs/spec.md §1.5):

    python -m embtables bench subnormals                 # 4 x 250k x 64, batch 4096, 20 ids a bag, Adagrad
    python -m embtables bench subnormals --threads 1 --steps 30

Three cases of the same step (lookup + apply_gradients, the native kernels): ``ordinary`` rows and gradients;
``tiny_gradients`` (|g| about 1e-20, whose squares are subnormal: every accumulator update makes one); and
``subnormal_rows`` (every touched row rewritten as subnormals before each step, outside the timer). With
subnormals flushed to zero (the CPU's FTZ/DAZ modes in the kernels) the three cost the same; a CPU that takes a
microcode assist per subnormal operand or result pays several times more for the last two where they are not
flushed. Prints one ``subnormal_step`` JSON line per case (median ms over ``--steps``) and a
``subnormal_summary`` line with each case's ratio to ``ordinary``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit, env_record

CASES = ("ordinary", "tiny_gradients", "subnormal_rows")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=250_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(env_record())
    medians = {}
    for case in CASES:
        medians[case] = _measure(case, args)
        emit({"bench": "subnormal_step", "case": case, "ms": round(medians[case], 3), "threads": args.threads,
              "tables": args.tables, "rows": args.rows, "dim": args.dim, "batch": args.batch,
              "pooling": args.pooling})  # fmt: skip
    base = medians["ordinary"]
    emit({"bench": "subnormal_summary", "ratio_to_ordinary": {c: round(m / base, 3) for c, m in medians.items()}})
    return 0


def _measure(case: str, args: argparse.Namespace) -> float:
    """The median step time (ms) of ``case``."""
    tables = [
        et.TableConfig(args.rows, args.dim, name=f"t{i}", combiner="sum", initializer=et.TruncatedNormal(stddev=0.05))
        for i in range(args.tables)
    ]
    emb = et.DistributedEmbedding({f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}, et.Adagrad(0.01))
    gen = torch.Generator().manual_seed(0)
    scale = 1e-20 if case == "tiny_gradients" else 0.01
    times = []
    for step in range(args.warmup + args.steps):
        lengths = torch.full((args.batch,), args.pooling, dtype=torch.int64)
        ids = {
            f"f{i}": et.Ragged.from_lengths(
                torch.randint(0, args.rows, (args.batch * args.pooling,), generator=gen), lengths
            )
            for i in range(args.tables)
        }
        grads = {k: torch.randn(args.batch, args.dim, generator=gen) * scale for k in ids}
        if case == "subnormal_rows":
            with torch.no_grad():
                for i, v in enumerate(ids.values()):
                    emb.embedding_tables[f"t{i}"].data[v.values] = 1e-39
        start = time.perf_counter()
        emb(ids)
        emb.apply_gradients(grads)
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())
