"""``use_gradient_accumulation=False`` with one hot id: native kernels vs the pure-torch path.

    python3 benchmarks/bench_noacc.py [--repeats 100000] [--dim 64]

One ``apply_gradients`` applying ``--repeats`` occurrences of row 0 (occurrence by occurrence, spec
§10.2), per kernel path and optimizer; prints one JSON line each. The torch path is vectorised for
SGD and Adagrad without weight decay or weight clipping; the other optimizers take one round per
repeat, so keep ``--repeats`` small for them (``--slow-repeats``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit
from embtables.kernels import native

OPTIMIZERS = {
    "sgd": lambda: et.SGD(0.01, use_gradient_accumulation=False),
    "adagrad": lambda: et.Adagrad(0.01, use_gradient_accumulation=False),
    "adam": lambda: et.Adam(0.01, use_gradient_accumulation=False),
}
VECTORISED = {"sgd", "adagrad"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100_000)
    parser.add_argument("--slow-repeats", type=int, default=2_000, help="repeats for the round-by-round torch path")
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    for path in ("native", "torch"):
        native.set_enabled(path == "native")
        for name, make in OPTIMIZERS.items():
            repeats = args.repeats if path == "native" or name in VECTORISED else args.slow_repeats
            table = et.TableConfig(1000, args.dim, name="t", initializer=et.Constant(0.1))
            emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, make())
            acts = emb({"f": torch.zeros(repeats, 1, dtype=torch.int64)})
            grads = {"f": torch.full_like(acts["f"], 1e-3)}
            start = time.perf_counter()
            emb.apply_gradients(grads)
            seconds = time.perf_counter() - start
            emit(
                {
                    "bench": "noacc_hot_id",
                    "path": path,
                    "optimizer": name,
                    "repeats": repeats,
                    "dim": args.dim,
                    "seconds": round(seconds, 4),
                    "us_per_occurrence": round(1e6 * seconds / repeats, 3),
                    "vectorised": path == "native" or name in VECTORISED,
                }
            )
    native.set_enabled(True)


if __name__ == "__main__":
    main()
