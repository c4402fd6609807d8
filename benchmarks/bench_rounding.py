"""The C kernels' rounding of float32 rows to half types, on its own (issue 58, item 2):

    python -m embtables bench rounding                 # 52,323 x 64 (a standard step's distinct rows), 1 thread
    python -m embtables bench rounding --rows 4096 --dim 24 --reps 200

The loops every half table writes with (``et_round_rows`` runs them over [U, D] rows), each type (bfloat16,
float16) and mode (stochastic, to nearest), through the vector loops (8 values at a time, compiled for this CPU)
and the scalar ones (``native.rounding_path``; the same bits, tested in tests/numerics/test_rounding_paths.py),
interleaved, into one output reused (no page faults timed). One ``rounding`` JSON line per case: the median ms,
values a second and the ratio scalar / vector; then a ``rounding_summary`` line with the stochastic rounding's
cost over rounding to nearest on each path.
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

from benchmarks._harness import emit, env_record, median_seconds
from embtables.kernels import native

TYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=52_323)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50, help="timed calls per case and round (the median is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each case reports its best median")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    emit(env_record())
    if native.rounding_path() is None:
        emit({"bench": "rounding", "skipped": "the native kernels are not built here"})
        return 0
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(args.rows, args.dim, generator=gen) * 0.05).contiguous()  # trained-weight magnitudes
    rows = torch.randperm(args.rows * 8, generator=gen)[: args.rows].contiguous()
    out = torch.zeros(args.rows, args.dim, dtype=torch.int16)
    before = native.rounding_path()
    cases = [(t, s, v) for t in TYPES for s in (True, False) for v in (True, False)]
    best: dict[tuple[str, bool, bool], float] = {}
    try:
        for _ in range(max(1, args.rounds)):
            for kind, stochastic, vector in cases:
                native.rounding_path(vector)
                call = lambda: native.round_rows(x, rows, 1, 2, 3, TYPES[kind], stochastic=stochastic, out=out)  # noqa: E731,B023
                sec = median_seconds(call, args.reps)
                key = (kind, stochastic, vector)
                best[key] = min(best.get(key, sec), sec)
    finally:
        native.rounding_path(before)
    values = args.rows * args.dim
    summary: dict[str, Any] = {"bench": "rounding_summary", "rows": args.rows, "dim": args.dim}
    for kind in TYPES:
        for stochastic in (True, False):
            vec, sca = best[(kind, stochastic, True)], best[(kind, stochastic, False)]
            mode = "stochastic" if stochastic else "nearest"
            emit({"bench": "rounding", "type": kind, "mode": mode, "rows": args.rows, "dim": args.dim,
                  "vector_ms": round(vec * 1e3, 3), "scalar_ms": round(sca * 1e3, 3),
                  "vector_Gvalues_per_s": round(values / vec / 1e9, 3),
                  "scalar_over_vector": round(sca / vec, 2)})  # fmt: skip
        for path, vector in (("vector", True), ("scalar", False)):
            summary[f"{kind}_stochastic_vs_nearest_{path}"] = round(
                best[(kind, True, vector)] / best[(kind, False, vector)], 2
            )
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
