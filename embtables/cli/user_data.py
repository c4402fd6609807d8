"""``embtables train --data FILE --schema SCHEMA``: a model on the user's own CSV or Parquet file.

The schema is a JSON file::

    {
      "label": "clicked",                  # the target column
      "task": "binary",                    # "binary" (BCE; accuracy, AUC, log-loss) or "regression" (MSE; RMSE, MAE)
      "dim": 16,                           # embedding width (optional, default 16)
      "features": {                        # one entry per feature column
        "user_id": {"type": "identity", "num_buckets": 100000},
        "country": {"type": "vocabulary", "vocabulary": ["US", "FR", "IN"]},
        "url":     {"type": "hash", "hash_bucket_size": 50000},
        "tags":    {"type": "hash", "hash_bucket_size": 1000, "separator": "|"},   # multi-valued cell
        "age":     {"type": "bucketized", "boundaries": [18, 25, 35, 50, 65]},      # buckets -> a table
        "price":   {"type": "numeric", "normalize": "log"}                         # a number -> the MLP
      }
    }

Categorical and bucketized features get an embedding table each; numeric features (normalised with the
training rows' mean and standard deviation, after ``log1p`` with ``"normalize": "log"``, or as they are
with ``"none"``; a missing value reads as the mean) feed a bottom MLP whose output joins the embeddings.
The rows are shuffled with ``--seed`` (which also seeds the tables and the model: the same command gives
the same bits) and the last ``--eval-fraction`` held out. The model is the DLRM of the synthetic job
(pairwise dot products of the vectors, then an MLP), trained with the ``Estimator`` for ``--epochs``
epochs (default 12) of ``--batch-size`` rows (default: the power of two that gives an epoch about 40
steps, 32 to 8192), evaluated after each. The job reports every epoch, the best held-out epoch
(highest AUC, lowest RMSE) and keeps that epoch's checkpoint in ``MODEL_DIR/best-epoch``; it writes
``results.json`` and ``curves.png`` (the held-out metrics per epoch, every run into the directory).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.checkpoint.store import read_manifest
from embtables.cli.dlrm import interaction, mlp_head, report_offload
from embtables.cli.history import epoch_curve
from embtables.cli.job_runner import storage_line, table_storage
from embtables.cli.plotting import finish, pyplot
from embtables.cli.scoring_recipe import SCORING_FILE, write_recipe
from embtables.config import Offload
from embtables.estimator import (
    AdagradParameters,
    EmbeddingConfigSpec,
    Estimator,
    accuracy,
    auc,
    bucketized_column,
    categorical_column_with_hash_bucket,
    categorical_column_with_identity,
    categorical_column_with_vocabulary_list,
    embedding_column,
    log_loss,
    mae,
    numeric_column,
    rmse,
)
from embtables.estimator.model_artifact import ModelParts, check_target, export_model
from embtables.estimator.row_transform import NORMALIZE, NumericStat, RowTransform, fit_numeric, labels_of
from embtables.tables import TruncatedNormal

logger = logging.getLogger("embtables")
TASKS = ("binary", "regression")
TYPES = ("identity", "hash", "vocabulary", "bucketized", "numeric")
BEST_DIR = "best-epoch"  # the best held-out epoch's checkpoint, inside the model directory
_BEST_MARK = ".embtables-best-epoch"  # written into it, so a rerun replaces only what the job wrote
EPOCHS = 12


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


def _column(name: str, kind: str, f: dict[str, Any]) -> Any:
    """The categorical column of a feature of type ``kind`` (identity, hash, vocabulary, bucketized)."""
    if kind == "identity":
        return categorical_column_with_identity(name, int(f["num_buckets"]), f.get("default_value"))
    if kind == "hash":
        return categorical_column_with_hash_bucket(name, int(f["hash_bucket_size"]))
    if kind == "vocabulary":
        return categorical_column_with_vocabulary_list(
            name, list(f["vocabulary"]), num_oov_buckets=int(f.get("num_oov_buckets", 0))
        )
    bounds = f["boundaries"]
    if not isinstance(bounds, list):
        raise TypeError(f"`boundaries` must be a list of numbers, got {bounds!r}")
    return bucketized_column(numeric_column(name), bounds)


def columns_from_schema(
    schema: dict[str, Any],
    available: set[str],
    stored: tuple[str, str] = ("float32", "float32"),
    offload: Offload | None = None,
) -> tuple[list[Any], dict[str, str]]:
    """The embedding columns the schema describes, and its numeric features ``{column: normalize}``,
    checked against the file's columns; ``stored``: the tables' (row, slot) storage types; ``offload``: every
    table's rows in files (docs/offload.md). Errors name the feature, its schema type and the field."""
    if not isinstance(schema.get("features"), dict) or not schema["features"]:
        raise SchemaError("schema: `features` must be a non-empty object {column: {type: ...}}.")
    dim = schema.get("dim", 16)
    init = TruncatedNormal(stddev=0.05, seed=0)  # the rows start the same in every run (--seed moves the rest)
    cols, numeric = [], {}
    for name, f in schema["features"].items():
        if name not in available:
            raise SchemaError(f"schema: feature {name!r} is not a column of the data (it has {sorted(available)}).")
        kind = f.get("type") if isinstance(f, dict) else None
        if kind not in TYPES:
            raise SchemaError(f"schema: feature {name!r} needs a type: one of {', '.join(TYPES)}; got {kind!r}.")
        assert isinstance(f, dict)
        if kind == "numeric":
            normalize = f.get("normalize", "standard")
            if normalize not in NORMALIZE:
                raise SchemaError(f"schema: numeric feature {name!r}: `normalize` must be one of {NORMALIZE}, got "
                                  f"{normalize!r}.")  # fmt: skip
            numeric[name] = str(normalize)
            continue
        try:
            cat = _column(name, kind, f)
            cols.append(
                embedding_column(
                    cat,
                    int(f.get("dim", dim)),
                    combiner=f.get("combiner", "mean"),
                    initializer=init,
                    dtype=stored[0],
                    slot_dtype=stored[1],
                    offload=offload,
                )
            )
        except KeyError as exc:
            raise SchemaError(f"schema: {kind} feature {name!r} needs the field {exc}.") from None
        except (TypeError, ValueError) as exc:
            message = str(exc)
            for function in (
                "categorical_column_with_identity",
                "categorical_column_with_hash_bucket",
                "categorical_column_with_vocabulary_list",
                "bucketized_column",
                "embedding_column",
            ):
                message = message.replace(function, "schema")  # fmt: skip
            raise SchemaError(f"schema: {kind} feature {name!r}: {message}") from None
    if not cols:
        raise SchemaError("schema: at least one feature must have an embedding table (identity, hash, vocabulary or "
                          "bucketized); numeric features alone feed no table.")  # fmt: skip
    return cols, numeric


class TabularDLRM(nn.Module):
    """The DLRM of the synthetic job over the embeddings [B, D] of ``names`` and, when there are numeric
    features, one more vector: a bottom MLP of the normalised numbers [B, N] -> [B, D]."""

    def __init__(self, names: list[str], dim: int, numeric: int, hidden: tuple[int, ...] = (128, 64)) -> None:
        super().__init__()
        self.names, self.numeric = names, numeric
        self.bottom = nn.Sequential(nn.Linear(numeric, 32), nn.ReLU(), nn.Linear(32, dim)) if numeric else None
        f = len(names) + (1 if numeric else 0)
        self.mlp = mlp_head(f * (f - 1) // 2 + f * dim, hidden)
        self.pairs = torch.triu_indices(f, f, offset=1)

    def forward(self, activations: dict[str, Tensor], features: dict[str, Any]) -> Tensor:
        vectors = [activations[n] for n in self.names]
        if self.bottom is not None:
            vectors.append(self.bottom(features["numeric"]))
        out: Tensor = self.mlp(interaction(vectors, self.pairs)).squeeze(1)
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of rows held out (default 0.1)")
    p.add_argument(
        "--export-to", metavar="OUT", default=None,
        help="after every checkpoint, export the model to OUT for embtables serve / predict (a model artifact; with "
        "--incremental each save after the first adds a delta of the changed rows and the dense weights)",
    )  # fmt: skip


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


def default_batch_size(train_rows: int) -> int:
    """The power of two that gives an epoch about 40 steps, 32 to 8192."""
    return int(min(8192, max(32, 2 ** math.floor(math.log2(max(1, train_rows) / 40)))))


def row_transform(schema: dict[str, Any], numeric: dict[str, str], stats: tuple[NumericStat, ...]) -> RowTransform:
    """The schema's raw columns -> the model's features: multi-valued cells split at their separator, a bucketized
    column's values read as numbers, the numeric features normalised with ``stats`` into ``features["numeric"]``."""
    separators, numbers, passed = [], [], []
    for name, f in schema["features"].items():
        if name in numeric:
            continue
        if f.get("separator"):  # a multi-valued cell, e.g. "a|b|c"
            separators.append((name, str(f["separator"])))
        elif f.get("type") == "bucketized":
            numbers.append(name)
        else:
            passed.append(name)
    return RowTransform(tuple(separators), tuple(numbers), stats, "numeric", tuple(passed))


def scoring_model(args: dict[str, Any], task: str) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """The job's dense model from its recipe's arguments (``scoring_recipe``), its ``predictions_fn`` and an
    example of the tensor features it reads (the weights come from a checkpoint)."""
    names, dim, numeric = args["names"], args["dim"], args["numeric"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or type(dim) is not int or type(
            numeric) is not int or dim < 1 or numeric < 0:  # fmt: skip
        raise TypeError("the model's names, dim and numeric count are malformed")
    example = {"numeric": torch.zeros((2, numeric), dtype=torch.float32)}
    return TabularDLRM(names, dim, numeric), torch.sigmoid if task == "binary" else None, example


def _exporter(out: str, parts: ModelParts) -> Callable[[int, str], None]:
    """``Estimator(after_save=)`` for ``--export-to``: each checkpoint into the model artifact at ``out`` (a step
    added to it when it is an artifact of this model, else written whole)."""

    def after_save(step: int, checkpoint: str) -> None:
        done = export_model(checkpoint, out, parts, incremental=True)
        how = "added to" if done.incremental else "exported whole to"
        logger.info("step %d %s %s", step, how, out)

    return after_save


def _keep_best(est: Estimator, model_dir: Path) -> Path | None:
    """Copy the estimator's latest checkpoint (and its dense file) into ``model_dir/best-epoch``, a model
    directory of its own (``embtables inspect/export`` and ``Estimator`` read it). An earlier copy is
    replaced only when this job wrote it; None when the name is taken by something else."""
    latest = est.latest_checkpoint()
    if latest is None:
        return None
    best = model_dir / BEST_DIR
    if best.exists():
        if not (best / _BEST_MARK).is_file():
            return None  # not ours: never replaced
        shutil.rmtree(best)
    staging = model_dir / f".{BEST_DIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    shutil.copytree(latest, staging / Path(latest).name)
    dense = (read_manifest(Path(latest))[1].get("extra") or {}).get("dense")
    if isinstance(dense, str) and (model_dir / dense).is_file():
        shutil.copy2(model_dir / dense, staging / dense)
    if (model_dir / SCORING_FILE).is_file():
        shutil.copy2(model_dir / SCORING_FILE, staging / SCORING_FILE)
    (staging / _BEST_MARK).write_text("the best held-out epoch of embtables train --data; replaced by a rerun\n")
    staging.rename(best)
    return best


def plot_epochs(curve: list[dict[str, float]], metric: str, path: Path, title: str) -> bool:
    """The held-out ``metric`` per epoch; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot([c["epoch"] for c in curve], [c[metric] for c in curve], marker="o", ms=3, label=f"held-out {metric}")
    finish(plt, fig, ax, "epoch", metric, title, path)
    return True


def run(args: argparse.Namespace) -> int:
    epochs = args.epochs or EPOCHS
    schema = read_schema(Path(args.schema))
    data = read_table(Path(args.data))
    label = schema.get("label")
    task = schema.get("task", "binary")
    if not isinstance(label, str) or label not in data:
        raise SchemaError(f"schema label {label!r} is not a column of {args.data} (it has {sorted(data)[:10]})")
    if task not in TASKS:
        raise SchemaError(f"schema task must be one of {TASKS}, got {task!r}")
    try:
        stored = (getattr(args, "dtype", "float32"), getattr(args, "slot_dtype", "float32"))
        directory = getattr(args, "offload", None)
        offload = None if directory is None else Offload(directory, args.cache_rows)
        cols, numeric = columns_from_schema(schema, set(data) - {label}, stored, offload)
    except (KeyError, TypeError) as exc:
        raise SchemaError(f"schema: a feature entry is incomplete ({type(exc).__name__}: {exc})") from None
    y = labels_of(data[label], label, args.data)
    n = len(data[label])
    order = np.random.default_rng(args.seed).permutation(n)
    n_eval = max(1, int(n * args.eval_fraction))
    train_idx, eval_idx = order[: n - n_eval], order[n - n_eval :]
    transform = row_transform(schema, numeric, fit_numeric(data, numeric, train_idx, args.data))
    inputs = transform.apply(data, args.data)
    numbers = inputs.pop(transform.numeric_key)
    batch_size = args.batch_size or default_batch_size(len(train_idx))
    feature_names = [name for name in schema["features"] if name not in numeric]
    dims = {c.dimension for c in cols}
    if len(dims) != 1:
        raise SchemaError("the DLRM model needs one `dim` for every feature")
    binary = task == "binary"
    torch.manual_seed(args.seed)  # the MLP's initial weights (the tables' come from their initializer)
    dense_args = {"names": [c.name for c in cols], "dim": dims.pop(), "numeric": len(numeric)}
    model = scoring_model(dense_args, task)[0]
    model_dir = Path(args.model_dir)  # checked (or made) by the job runner
    if args.export_to is not None:
        check_target(Path(args.export_to))  # refused now, not after the first epoch
    write_recipe(model_dir, "data", cols, transform, task, label, dense_args)
    parts = None
    if args.export_to is not None:
        with torch.random.fork_rng():  # the job's random numbers stay those of a run without --export-to
            scorer, predictions_fn, example = scoring_model(dense_args, task)  # weights: from each checkpoint
        parts = ModelParts(scorer, cols, transform, predictions_fn, task, label, example)
    metrics: dict[str, Any] = {"accuracy": accuracy, "auc": auc, "log_loss": log_loss} if binary else {
        "rmse": rmse, "mae": mae}  # fmt: skip
    key = "auc" if binary else "rmse"  # the best epoch: the highest AUC, the lowest RMSE
    est = Estimator(
        model,
        EmbeddingConfigSpec(
            feature_columns=cols, optimization_parameters=AdagradParameters(0.1, initial_accumulator=1e-4)
        ),
        model_dir,
        dense_optimizer=lambda p: torch.optim.Adam(p, lr=2e-3),
        loss_fn=nn.functional.binary_cross_entropy_with_logits if binary else nn.functional.mse_loss,
        predictions_fn=torch.sigmoid if binary else None,
        eval_metrics=metrics,
        save_checkpoints_steps=args.save_every,
        after_save=None if parts is None else _exporter(args.export_to, parts),
        incremental_checkpoints=args.incremental,
        keep_checkpoint_max=1,
        progress=args.progress,
    )
    try:

        def batches(index: np.ndarray, shuffle_seed: int | None) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
            rows = index if shuffle_seed is None else index[np.random.default_rng(shuffle_seed).permutation(len(index))]
            for s in range(0, len(rows), batch_size):
                r = rows[s : s + batch_size]
                features: dict[str, Any] = {k: inputs[k][r] for k in feature_names}
                features["numeric"] = numbers[torch.from_numpy(r)]
                yield features, y[r]

        kinds = f"{len(cols)} embedding tables" + (f", {len(numeric)} numeric features" if numeric else "")
        print(f"{args.data}: {n} rows ({len(train_idx)} train, {len(eval_idx)} held out), task {task}, {kinds}, "
              f"batch size {batch_size}, model_dir {model_dir}")  # fmt: skip
        storage = table_storage(est.embedding)
        print(storage_line(storage))
        start = time.perf_counter()
        steps_per_epoch = max(1, math.ceil(len(train_idx) / batch_size))
        done = est.restore() // steps_per_epoch  # --epochs is a total
        if est.global_step:
            print(f"resumed from step {est.global_step} in {model_dir} ({done} of {epochs} epochs done)")
        if done >= epochs:
            print(f"finished: {done} epochs already trained; evaluating only")
            est.evaluate(lambda: batches(eval_idx, None))
        curve = epoch_curve(model_dir, est.global_step, steps_per_epoch, ("step", *metrics))  # every run's
        pick = max if binary else min
        best = pick(curve, key=lambda c: c[key]) if curve else None
        for epoch in range(done, epochs):
            est.train(functools.partial(batches, train_idx, args.seed * 1000 + epoch))
            result = est.evaluate(lambda: batches(eval_idx, None))
            point = {"epoch": epoch + 1, "step": float(est.global_step), **{k: result[k] for k in metrics}}
            curve = [c for c in curve if c["step"] != point["step"]] + [point]
            if best is None or (point[key] > best[key] if binary else point[key] < best[key]):
                best = point
                _keep_best(est, model_dir)
            shown = "  ".join(f"{k} {result[k]:.4f}" for k in metrics)
            print(f"epoch {epoch + 1:3d}  step {est.global_step:6d}  {shown}  {time.perf_counter() - start:6.1f} s",
                  flush=True)  # fmt: skip
        if best is None:  # nothing trained and no earlier evaluation on record
            result = est.evaluate(lambda: batches(eval_idx, None))
            best = {"epoch": float(done), "step": float(est.global_step), **{k: result[k] for k in metrics}}
            curve = [best]
        last = curve[-1]
        shown = "  ".join(f"{k} {best[k]:.4f}" for k in metrics)
        kept = f"; its checkpoint: {model_dir / BEST_DIR}" if (model_dir / BEST_DIR / _BEST_MARK).is_file() else ""
        print(f"best held-out epoch: {int(best['epoch'])} of {int(last['epoch'])} ({shown}){kept}")
        results = {"data": str(args.data), "task": task, "epochs": int(last["epoch"]), "batch_size": batch_size,
                   "seed": args.seed, "last": last, "best_epoch": int(best["epoch"]), "best": best, "curve": curve,
                   "seconds": time.perf_counter() - start, "storage": storage}  # fmt: skip
        if offload is not None:  # each table's row cache: hit rate, disk traffic (also in results.json)
            results["offload"] = est.embedding.offload_statistics()
            report_offload(results["offload"])
        (model_dir / "results.json").write_text(json.dumps(results, indent=1))
        title = f"embtables on {Path(args.data).name} (held out)"
        if plot_epochs(curve, key, model_dir / "curves.png", title):
            print(f"curves: {model_dir / 'curves.png'}")
        else:
            print("curves: not drawn (matplotlib is not installed: pip install matplotlib)")
        line = {"data": str(args.data), "task": task, "steps": est.global_step, "best_epoch": results["best_epoch"]}
        print(json.dumps({**line, **{k: best[k] for k in metrics}, "seconds": results["seconds"]}))
        return 0
    finally:
        est.embedding.close()  # the offloaded tables' files and locks
        est.close()  # let the next writer (a rerun in this process) take the model_dir
