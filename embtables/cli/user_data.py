"""``embtables train --data FILE --schema SCHEMA``: a model on the user's own CSV or Parquet file.

The schema is a JSON file::

    {
      "label": "clicked",                  # the target column
      "task": "binary",                    # "binary" (BCE; AUC, log-loss) or "regression" (MSE; RMSE, MAE)
      "dim": 16,                           # embedding width (optional, default 16)
      "features": {                        # one embedding table per feature column
        "user_id": {"type": "identity", "num_buckets": 100000},
        "country": {"type": "vocabulary", "vocabulary": ["US", "FR", "IN"]},
        "url":     {"type": "hash", "hash_bucket_size": 50000},
        "tags":    {"type": "hash", "hash_bucket_size": 1000, "separator": "|"}   # multi-valued cell
      }
    }

The rows are shuffled with ``--seed`` and the last ``--eval-fraction`` held out. The model is the
DLRM of the synthetic job (pairwise dot products of the embeddings, then an MLP), trained with the
``Estimator`` for ``--epochs`` epochs; metrics, checkpoints and ``eval_metrics.csv`` go to ``--model-dir``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from embtables.cli.dlrm import DLRM
from embtables.estimator import (
    AdagradParameters,
    EmbeddingConfigSpec,
    Estimator,
    auc,
    categorical_column_with_hash_bucket,
    categorical_column_with_identity,
    categorical_column_with_vocabulary_list,
    embedding_column,
    log_loss,
    mae,
    rmse,
)

TASKS = ("binary", "regression")


class SchemaError(ValueError):
    """The schema file is not what ``--schema`` documents."""


def read_table(path: Path) -> dict[str, np.ndarray]:
    """The columns of a CSV or Parquet file as NumPy arrays (needs pandas / pyarrow: ``embtables[data]``)."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq  # type: ignore[import-untyped,unused-ignore]

            table = pq.read_table(path)
            return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
        import pandas as pd  # type: ignore[import-untyped,unused-ignore]

        frame = pd.read_csv(path)
        return {str(c): frame[c].to_numpy() for c in frame.columns}
    except ImportError as exc:
        raise ImportError(f"reading {path.name} needs {exc.name}; pip install 'embtables[data]'") from None


def columns_from_schema(schema: dict[str, Any], available: set[str]) -> list[Any]:
    """The embedding columns the schema describes, checked against the file's columns."""
    if not isinstance(schema.get("features"), dict) or not schema["features"]:
        raise SchemaError("schema: `features` must be a non-empty object {column: {type: ...}}.")
    dim = schema.get("dim", 16)
    cols = []
    for name, f in schema["features"].items():
        if name not in available:
            raise SchemaError(f"schema: feature {name!r} is not a column of the data (it has {sorted(available)}).")
        kind = f.get("type") if isinstance(f, dict) else None
        if kind == "identity":
            cat: Any = categorical_column_with_identity(name, int(f["num_buckets"]), f.get("default_value"))
        elif kind == "hash":
            cat = categorical_column_with_hash_bucket(name, int(f["hash_bucket_size"]))
        elif kind == "vocabulary":
            cat = categorical_column_with_vocabulary_list(
                name, list(f["vocabulary"]), num_oov_buckets=int(f.get("num_oov_buckets", 0))
            )
        else:
            raise SchemaError(f"schema: feature {name!r} needs type identity, hash or vocabulary, got {kind!r}.")
        cols.append(embedding_column(cat, int(f.get("dim", dim)), combiner=f.get("combiner", "mean")))
    return cols


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of rows held out (default 0.1)")


def read_schema(path: Path) -> dict[str, Any]:
    """The schema file as a JSON object, or ``SchemaError`` saying what is wrong with it."""
    try:
        schema = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"--schema {path}: cannot be read ({exc})") from None
    except ValueError as exc:
        raise SchemaError(f"--schema {path} is not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise SchemaError(f"--schema {path} must hold a JSON object {{\"label\": ..., \"features\": ...}}, "
                          f"not a {type(schema).__name__}")  # fmt: skip
    return schema


def labels_of(column: np.ndarray, name: str, path: str) -> np.ndarray:
    """The label column as float32, or ``SchemaError`` when it is not numbers or holds NaN."""
    try:
        y = np.asarray(column, dtype=np.float32)
    except (TypeError, ValueError):
        raise SchemaError(
            f"the label column {name!r} of {path} is not numeric (e.g. {column[0]!r}); encode it as numbers"
        ) from None
    if not np.isfinite(y).all():
        raise SchemaError(f"the label column {name!r} of {path} has {int((~np.isfinite(y)).sum())} empty or NaN values")
    return y


def run(args: argparse.Namespace) -> int:
    epochs = args.epochs or 12  # --epochs; its default is the movielens job's
    schema = read_schema(Path(args.schema))
    data = read_table(Path(args.data))
    label = schema.get("label")
    task = schema.get("task", "binary")
    if not isinstance(label, str) or label not in data:
        raise SchemaError(f"schema label {label!r} is not a column of {args.data} (it has {sorted(data)[:10]})")
    if task not in TASKS:
        raise SchemaError(f"schema task must be one of {TASKS}, got {task!r}")
    try:
        cols = columns_from_schema(schema, set(data) - {label})
    except (KeyError, TypeError) as exc:
        raise SchemaError(f"schema: a feature entry is incomplete ({type(exc).__name__}: {exc})") from None
    y = labels_of(data[label], label, args.data)
    for name, f in schema["features"].items():
        if f.get("separator"):  # a multi-valued cell, e.g. "a|b|c"
            sep = f["separator"]
            data[name] = np.array(
                [[] if not isinstance(v, str) or not v else v.split(sep) for v in data[name]], dtype=object
            )
    n = len(data[label])
    order = np.random.default_rng(args.seed).permutation(n)
    n_eval = max(1, int(n * args.eval_fraction))
    train_idx, eval_idx = order[: n - n_eval], order[n - n_eval :]
    feature_names = list(schema["features"])
    dims = {c.dimension for c in cols}
    if len(dims) != 1:
        raise SchemaError("the DLRM model needs one `dim` for every feature")
    binary = task == "binary"
    model = DLRM([c.name for c in cols], dims.pop())
    model_dir = Path(args.model_dir)  # checked (or made) by the job runner
    est = Estimator(
        model,
        EmbeddingConfigSpec(
            feature_columns=cols, optimization_parameters=AdagradParameters(0.1, initial_accumulator=1e-4)
        ),
        model_dir,
        dense_optimizer=lambda p: torch.optim.Adam(p, lr=2e-3),
        loss_fn=nn.functional.binary_cross_entropy_with_logits if binary else nn.functional.mse_loss,
        predictions_fn=torch.sigmoid if binary else None,
        eval_metrics={"auc": auc, "log_loss": log_loss} if binary else {"rmse": rmse, "mae": mae},
        save_checkpoints_steps=None,
        progress=args.progress,
    )
    try:

        def batches(index: np.ndarray, shuffle_seed: int | None) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
            rows = index if shuffle_seed is None else index[np.random.default_rng(shuffle_seed).permutation(len(index))]
            for s in range(0, len(rows), args.batch_size):
                r = rows[s : s + args.batch_size]
                yield {k: data[k][r] for k in feature_names}, y[r]

        print(f"{args.data}: {n} rows ({len(train_idx)} train, {len(eval_idx)} held out), task {task}, "
              f"{len(cols)} embedding tables, model_dir {model_dir}")  # fmt: skip
        start = time.perf_counter()
        result: dict[str, float] = {}
        done = est.restore() // max(1, math.ceil(len(train_idx) / args.batch_size))  # --epochs is a total
        if est.global_step:
            print(f"resumed from step {est.global_step} in {model_dir} ({done} of {epochs} epochs done)")
        if done >= epochs:
            print(f"finished: {done} epochs already trained; evaluating only")
            result = est.evaluate(lambda: batches(eval_idx, None))
        for epoch in range(done, epochs):
            est.train(functools.partial(batches, train_idx, args.seed * 1000 + epoch))
            result = est.evaluate(lambda: batches(eval_idx, None))
            metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "global_step")
            print(
                f"epoch {epoch + 1:3d}  step {est.global_step:6d}  {metrics}  {time.perf_counter() - start:6.1f} s",
                flush=True,
            )
        print(json.dumps({"data": str(args.data), "task": task, **result, "seconds": time.perf_counter() - start}))
        return 0
    finally:
        est.close()  # let the next writer (a rerun in this process) take the model_dir
