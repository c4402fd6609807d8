"""``embtables predict MODEL --input FILE [--output FILE]``: one prediction per row of a CSV or Parquet file.

MODEL is a model artifact (``embtables export MODEL_DIR OUT --model``) or a model directory of
``embtables train --data`` (exported into a temporary artifact first). The predictions are written in the rows'
order as a CSV with one column ``prediction`` (a probability for a binary task, the value for a regression) to
``--output``, or to stdout. A bad row is the training job's one-line error (which rows, which column, why) and
exit code 2.

``--output`` is written whole or not at all (a temporary file beside it, renamed over it). An existing file is
replaced only when it is a predictions CSV (its first line is ``prediction``) or with ``--overwrite``, and never
when it is the input.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from embtables.checkpoint.owned_dirs import write_atomically
from embtables.cli.model_files import opened_model
from embtables.cli.output_files import check_output
from embtables.cli.user_data import read_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model artifact (embtables export --model) or a model directory of train --data")
    p.add_argument("--input", required=True, help="the rows to score: a CSV or Parquet file with the model's columns")
    p.add_argument("--output", default=None, help="the CSV of predictions to write (default: stdout)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output that is not a predictions CSV"
    )
    p.add_argument("--batch-size", type=int, default=8192, help="rows scored at once (default 8192)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    source = Path(args.input)
    if not source.is_file():
        raise FileNotFoundError(f"--input {source}: no such file")
    if args.output:
        check_output(Path(args.output), "--output", "a predictions CSV (its first line is 'prediction')",
                     _predictions_csv, [source], args.overwrite, folders=[Path(args.model)])  # fmt: skip
    rows = read_table(source)
    with opened_model(args.model) as model:
        progress = args.progress and sys.stderr.isatty()
        predictions = model.predict(rows, batch_size=args.batch_size, progress=progress)
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["prediction"])
    writer.writerows([repr(float(p))] for p in predictions)
    if not args.output:
        sys.stdout.write(text.getvalue())
    else:
        write_atomically(Path(args.output), lambda f: f.write(text.getvalue().encode()))
        what = "probabilities" if model.task == "binary" else "predictions"
        print(f"{args.output}: {len(predictions)} {what} (model step {model.step})", file=sys.stderr)
    return 0


def _predictions_csv(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a predictions CSV this command writes."""
    return head.split(b"\n", 1)[0].rstrip(b"\r") == b"prediction"


__all__ = ["add_arguments", "run"]
