"""``embtables train``: the main job.

    embtables train                              # DLRM on synthetic CTR data vs its teacher (~1.5 min)
    embtables train --small                      # the same job as a smoke test (~6 s)
    embtables train --dataset movielens-100k     # 5-fold RMSE/MAE on MovieLens-100k (~5 s)
    embtables train --dataset adult              # income > 50K on UCI Adult, wide and deep (~6 s)
    embtables train --data clicks.parquet --schema schema.json   # your own data
    embtables quickstart                         # a smaller version of the first one (~7 s)
    torchrun --nproc_per_node=2 -m embtables train    # the DLRM with its tables sharded over 2 processes

(Times: the whole process, start-up included, on 2 cores.)

Every job trains through ``embtables.estimator.Estimator`` and writes checkpoints, metrics (CSV) and
a PNG of its curves into ``--model-dir`` (default: a new temporary folder, removed at exit unless
``--keep``). ``--steps`` / ``--epochs`` are totals: rerunning with the same ``--model-dir`` resumes and
trains only what is missing. Ctrl-C saves a checkpoint and prints the command that resumes (exit 130);
a routine mistake is one line on stderr with exit code 2 (``--debug`` for the traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from embtables.checkpoint import increments
from embtables.cli import adult, dlrm, movielens, user_data
from embtables.cli.job_runner import Parser, check_model_dir, run_job
from embtables.cli.malloc import keep_freed_memory
from embtables.sharding import comm

DATASETS = ("synthetic", "movielens-100k", "adult")


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="embtables train",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="\n".join(__doc__.splitlines()[2:]) if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataset", choices=DATASETS, default="synthetic", help="the built-in job (default synthetic)")
    p.add_argument("--data", default=None, help="train on this CSV or Parquet file instead (needs --schema)")
    p.add_argument("--schema", default=None, help="the JSON schema of --data (see docs/estimator.md)")
    p.add_argument(
        "--model-dir", default=None,
        help="checkpoints, metrics and plots; a rerun resumes there (default: a temporary folder, removed at exit)",
    )  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the default temporary --model-dir at exit")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch CPU threads (default 1: the jobs' models are small, and more threads wait on each other and "
        "on anything else the machine runs)",
    )  # fmt: skip
    p.add_argument(
        "--malloc", choices=("keep", "default"), default="keep",
        help="keep: glibc keeps freed memory, no fresh page faults for every step's tensors (default); "
        "default: glibc's own thresholds",
    )  # fmt: skip
    p.add_argument(
        "--save-every", type=int, default=None, metavar="N",
        help="also save a checkpoint every N training steps (synthetic and --data jobs; default: at the end only)",
    )  # fmt: skip
    p.add_argument(
        "--incremental", action="store_true",
        help="checkpoints after the first hold only the embedding rows changed since the one before "
        "(docs/checkpoints.md, 'Incremental checkpoints')",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="how every embedding table's rows are stored (default float32; half types: half the memory, updates "
        "stochastically rounded, docs/spec.md section 12)",
    )  # fmt: skip
    p.add_argument(
        "--slot-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="how the optimizer's slots are stored (default float32; a half type needs a half --dtype)",
    )  # fmt: skip
    p.add_argument(
        "--offload", metavar="DIR", default=None,
        help="the synthetic job's fixed tables (every table of the other jobs) keep their rows and slots in files "
        "under DIR (movielens-100k: DIR/fold<k> for fold k), with --cache-rows rows of each in memory "
        "(docs/offload.md); the summary reports each table's hit rate and disk traffic",
    )  # fmt: skip
    p.add_argument(
        "--cache-rows", type=int, default=200_000, metavar="N",
        help="with --offload: the rows of each table in memory at once (default 200000)",
    )  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log every metrics line")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also EMBTABLES_DEBUG=1)")
    group = p.add_argument_group("synthetic (DLRM) job")
    dlrm.add_arguments(group)  # type: ignore[arg-type]
    group = p.add_argument_group("movielens-100k job")
    movielens.add_arguments(group)  # type: ignore[arg-type]
    group = p.add_argument_group("adult job")
    adult.add_arguments(group)  # type: ignore[arg-type]
    group = p.add_argument_group("--data job")
    user_data.add_arguments(group)  # type: ignore[arg-type]
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Argument rules argparse cannot express; each a one-line error with exit code 2."""
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    for name in ("steps", "batch_size", "dim", "eval_every", "eval_size", "epochs", "factors", "folds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.folds > 5:
        p.error(f"--folds must be in 1..5, got {args.folds}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if not (0.0 < args.eval_fraction < 1.0):  # also refuses NaN
        p.error(f"--eval-fraction must be a share of the rows in (0, 1), got {args.eval_fraction}")
    if args.data is not None and args.schema is None:
        p.error("--data needs --schema (a JSON file naming the label and the feature columns)")
    if args.schema is not None and args.data is None:
        p.error("--schema goes with --data")
    if args.save_every is not None and args.save_every < 1:
        p.error(f"--save-every must be at least 1, got {args.save_every}")
    if (args.save_every is not None or args.incremental) and args.data is None and args.dataset != "synthetic":
        p.error(f"--save-every and --incremental apply to the synthetic job and --data jobs, not to {args.dataset} "
                "(it trains its folds from scratch and saves each at its end)")  # fmt: skip
    if args.export_to is not None and args.data is None:
        p.error("--export-to applies to --data jobs (their model can be scored: docs/serving.md)")
    if args.cache_rows < 1:
        p.error(f"--cache-rows must be >= 1, got {args.cache_rows}")
    for flag, path in (("--data", args.data), ("--schema", args.schema)):
        if path is not None and not Path(path).is_file():
            p.error(f"{flag} {path}: no such file")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    _check(p, args)
    if args.progress:
        args.progress = sys.stderr.isatty()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    increments.show_full_writes()  # --incremental: a full checkpoint instead says so, and why
    # One thread unless asked: DLRM's input thread draws the next batch on the other core (78 s against 82 s),
    # MovieLens is faster on one (8.5 s against 10.2 s), and Adult's training beside two busy processes took
    # 5.7 s on one thread against 13.1 s on torch's default of two (docs/estimator.md).
    torch.set_num_threads(args.threads or 1)
    if args.malloc == "keep":
        keep_freed_memory()
    distributed = comm.init_from_environment()  # under torchrun: shard the tables over the processes
    try:
        if distributed and (args.data is not None or args.dataset != "synthetic"):
            p.error("under torchrun only the synthetic job runs sharded (MovieLens runs its folds in parallel)")
        jobs = {"synthetic": dlrm.run, "movielens-100k": movielens.run, "adult": adult.run}
        job = user_data.run if args.data is not None else jobs[args.dataset]
        return run_job(p.prog, argv, args, job, lambda: _model_dir(args.model_dir, args.dataset, distributed))
    finally:
        comm.shutdown()


def _model_dir(given: str | None, dataset: str, distributed: bool) -> Path:
    """The checked ``--model-dir``, or a new temporary one (rank 0's, when sharded)."""
    if given is not None:
        return check_model_dir(given)
    chosen = tempfile.mkdtemp(prefix="embtables-train-") if comm.get_rank() == 0 else None
    return Path(str(comm.broadcast_object(chosen) if distributed else chosen))


if __name__ == "__main__":
    sys.exit(main())
