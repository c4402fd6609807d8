"""``embtables train``: the main job.

    embtables train                              # DLRM on synthetic CTR data vs its teacher (~2 min)
    embtables train --dataset movielens-100k     # 5-fold RMSE/MAE on MovieLens-100k (~1.5 min)
    embtables train --data clicks.parquet --schema schema.json   # your own data
    embtables quickstart                         # the 10-second version of the first one
    torchrun --nproc_per_node=2 -m embtables train    # the DLRM with its tables sharded over 2 processes

Every job trains through ``embtables.estimator.Estimator`` and writes checkpoints, metrics (CSV) and
a PNG of its curves into ``--model-dir`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from embtables.cli import dlrm, movielens, user_data
from embtables.sharding import comm

DATASETS = ("synthetic", "movielens-100k")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embtables train",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="\n".join(__doc__.splitlines()[2:8]) if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataset", choices=DATASETS, default="synthetic", help="the built-in job (default synthetic)")
    p.add_argument("--data", default=None, help="train on this CSV or Parquet file instead (needs --schema)")
    p.add_argument("--schema", default=None, help="the JSON schema of --data (see docs/estimator.md)")
    p.add_argument("--model-dir", default=None, help="checkpoints, metrics and plots (default: a new temp folder)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log every metrics line")
    group = p.add_argument_group("synthetic (DLRM) job")
    dlrm.add_arguments(group)  # type: ignore[arg-type]
    group = p.add_argument_group("movielens-100k job")
    movielens.add_arguments(group)  # type: ignore[arg-type]
    group = p.add_argument_group("--data job")
    user_data.add_arguments(group)  # type: ignore[arg-type]
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.progress:
        args.progress = sys.stderr.isatty()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    for name in ("steps", "batch_size", "dim", "eval_every", "eval_size", "epochs", "factors"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.data is not None and args.schema is None:
        p.error("--data needs --schema (a JSON file naming the label and the feature columns)")
    if args.schema is not None and args.data is None:
        p.error("--schema goes with --data")
    distributed = comm.init_from_environment()  # under torchrun: shard the tables over the processes
    try:
        if distributed and (args.data is not None or args.dataset != "synthetic"):
            p.error("under torchrun only the synthetic job runs sharded (MovieLens runs its folds in parallel)")
        if args.data is not None:
            return user_data.run(args)
        if args.dataset == "movielens-100k":
            return movielens.run(args)
        return dlrm.run(args)
    finally:
        comm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
