"""``embtables train --dataset adult``: income > 50K on UCI Adult, a wide-and-deep model on feature columns.

The model of TensorFlow's wide-and-deep feature-column tutorial, trained with the ``Estimator``:

    categorical: workclass, education, marital status, relationship, race, gender (vocabulary lists),
                 occupation, native country (hash buckets); bucketized: age, hours per week, capital
                 gain, capital loss (bucketized_column); education years (identity)
    each column -> embedding_column, width D + 1: v_c [B, D] (deep) and w_c [B] (wide, linear)
    logit = bias + sum_c w_c + MLP([v_c..., numeric features])               -> binary cross-entropy

on UCI's split (32,561 training rows, 16,281 test rows). Reports test accuracy and AUC next to
scikit-learn's logistic regression and histogram gradient boosting measured in the same run (when
scikit-learn is installed). Hyper-parameters were chosen on a validation split carved out of the
training rows (``--validation``: the last 20% of a seeded shuffle), never on the test rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.cli.adult_peers import peer_results
from embtables.cli.dlrm import report_offload
from embtables.cli.history import epoch_curve
from embtables.cli.job_runner import storage_line, table_storage
from embtables.cli.plotting import finish, pyplot
from embtables.cli.scoring_recipe import write_recipe
from embtables.config import Offload
from embtables.data.adult import CATEGORICAL, NUMERIC, Adult, load_adult
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
    numeric_column,
)
from embtables.estimator.row_transform import NumericStat, RowTransform
from embtables.tables import TruncatedNormal

# the tutorial's buckets for age; the others cut where the data's mass lies
BOUNDARIES = {
    "age": (18, 25, 30, 35, 40, 45, 50, 55, 60, 65),
    "hours_per_week": (20, 30, 35, 40, 41, 45, 50, 60),
    "capital_gain": (1, 3000, 5000, 7000, 10000, 15000),
    "capital_loss": (1, 1500, 1800, 2000, 2500),
}
HASHED = {"occupation": 100, "native_country": 100}
DENSE = ("age", "education_num", "hours_per_week", "capital_gain", "capital_loss")


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The model's hyper-parameters (the defaults are the reported configuration)."""

    dim: int = 8
    hidden: tuple[int, ...] = (64, 32)
    epochs: int = 8
    batch_size: int = 256
    embedding_lr: float = 0.05
    initial_accumulator: float = 1e-6  # far below the squared per-row gradients: Adagrad then adapts at once
    dense_lr: float = 2e-3
    init_stddev: float = 0.05
    dtype: str = "float32"  # the tables' rows and slots (``--dtype``, ``--slot-dtype``)
    slot_dtype: str = "float32"
    offload: str | None = None  # ``--offload``: every table's rows in files under this directory
    cache_rows: int = 200_000  # ``--cache-rows``: each offloaded table's rows in memory at once


def columns(train: Adult, hp: Hyper) -> list[Any]:
    """One embedding column of width dim + 1 per field; vocabularies from the training rows; with
    ``hp.offload``, every table's rows in files under that directory (docs/offload.md)."""
    init = TruncatedNormal(stddev=hp.init_stddev, seed=0)
    k = hp.dim + 1
    cats: list[Any] = []
    for name in CATEGORICAL:
        if name in HASHED:
            cats.append(categorical_column_with_hash_bucket(name, HASHED[name]))
        else:  # values never seen in training get one shared bucket
            vocab = sorted(set(train.columns[name].tolist()))
            cats.append(categorical_column_with_vocabulary_list(name, vocab, num_oov_buckets=1))
    cats += [bucketized_column(numeric_column(name), bounds) for name, bounds in BOUNDARIES.items()]
    cats.append(categorical_column_with_identity("education_num", 17, default_value=0))
    offload = None if hp.offload is None else Offload(hp.offload, hp.cache_rows)
    return [
        embedding_column(c, k, initializer=init, dtype=hp.dtype, slot_dtype=hp.slot_dtype, offload=offload)
        for c in cats
    ]


class WideDeep(nn.Module):
    """``bias + sum_c w_c + MLP(concat(v_c..., dense))`` over the columns' activations [B, D + 1]."""

    def __init__(self, names: list[str], dim: int, hidden: tuple[int, ...], mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__()
        self.names = names
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))
        layers: list[nn.Module] = []
        width = len(names) * dim + len(DENSE)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, activations: dict[str, Tensor], features: Any) -> Tensor:
        acts = torch.stack([activations[n] for n in self.names], 1)  # [B, C, D + 1]
        dense = (features["dense"] - self.mean) / self.std  # [B, len(DENSE)]
        deep = torch.cat([acts[..., :-1].flatten(1), dense], 1)
        out: Tensor = acts[..., -1].sum(1) + self.mlp(deep).squeeze(1)
        return out


# the raw columns -> the features: every column as it is, and the MLP's numbers [B, len(DENSE)] as float32 (capital
# amounts on a log scale); the model standardises them itself (its mean and std buffers)
TRANSFORM = RowTransform(
    numeric=tuple(NumericStat(n, "log" if n.startswith("capital") else "none") for n in DENSE),
    numeric_key="dense",
    passed=(*CATEGORICAL, *NUMERIC),
)
_NUMBERS = dataclasses.replace(TRANSFORM, passed=())  # the MLP's numbers alone (a batch's dense features)


def dense_features(data: Adult, index: np.ndarray) -> np.ndarray:
    """The numeric inputs of the MLP [n, len(DENSE)] (capital amounts on a log scale)."""
    out: np.ndarray = _NUMBERS.apply({n: data.columns[n][index] for n in DENSE}, "adult")["dense"].numpy()
    return out


def scoring_model(args: dict[str, Any], task: str) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """The job's dense model from its recipe's arguments (``scoring_recipe``; the weights, mean and std buffers
    included, come from a checkpoint), its ``predictions_fn`` and an example of the tensor features it reads."""
    names, dim, hidden = args["names"], args["dim"], args["hidden"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or type(dim) is not int or not (
            isinstance(hidden, list) and all(type(h) is int and h > 0 for h in hidden)) or dim < 1:  # fmt: skip
        raise TypeError("the model's names, dim and hidden widths are malformed")
    zeros, ones = np.zeros(len(DENSE), np.float32), np.ones(len(DENSE), np.float32)
    model = WideDeep(names, dim, tuple(hidden), zeros, ones)
    return model, torch.sigmoid, {"dense": torch.zeros((2, len(DENSE)), dtype=torch.float32)}


def _batches(
    data: Adult, index: np.ndarray, batch: int, seed: int | None
) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    order = index if seed is None else index[np.random.default_rng(seed).permutation(len(index))]
    for s in range(0, len(order), batch):
        rows = order[s : s + batch]
        features: dict[str, Any] = data.rows(rows)
        features["dense"] = torch.from_numpy(dense_features(data, rows))
        yield features, data.label[rows]


def train_and_test(
    train: Adult, test: Adult, train_idx: np.ndarray, test_idx: np.ndarray, hp: Hyper, model_dir: Path, progress: bool
) -> dict[str, Any]:
    """Train on ``train_idx`` rows of ``train`` and evaluate on ``test_idx`` rows of ``test`` after each epoch."""
    torch.manual_seed(0)
    cols = columns(train, hp)
    optimizer = AdagradParameters(hp.embedding_lr, initial_accumulator=hp.initial_accumulator)
    spec = EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=optimizer)
    dense = dense_features(train, train_idx)
    model = WideDeep([c.name for c in cols], hp.dim, hp.hidden, dense.mean(0), dense.std(0) + 1e-6)
    model_args = {"names": [c.name for c in cols], "dim": hp.dim, "hidden": list(hp.hidden)}
    model_dir.mkdir(parents=True, exist_ok=True)
    write_recipe(model_dir, "adult", cols, TRANSFORM, "binary", None, model_args)  # for embtables export --model
    est = Estimator(
        model,
        spec,
        model_dir,
        dense_optimizer=lambda p: torch.optim.Adam(p, lr=hp.dense_lr),
        loss_fn=lambda logits, y: nn.functional.binary_cross_entropy_with_logits(logits, y),
        predictions_fn=torch.sigmoid,
        eval_metrics={"accuracy": accuracy, "auc": auc, "log_loss": log_loss},
        save_checkpoints_steps=None,
        keep_checkpoint_max=1,
        log_step_count_steps=50,
        progress=progress,
    )
    try:
        steps_per_epoch = -(-len(train_idx) // hp.batch_size)
        print(storage_line(table_storage(est.embedding)), flush=True)
        done = est.restore() // steps_per_epoch  # --epochs is a total: resume, never redo
        curve = []
        for epoch in range(done, hp.epochs):
            est.train(functools.partial(_batches, train, train_idx, hp.batch_size, epoch))
            result = est.evaluate(lambda: _batches(test, test_idx, 4096, None))
            curve.append({"epoch": epoch + 1, **{k: result[k] for k in ("accuracy", "auc", "log_loss")}})
            print(f"epoch {epoch + 1}: accuracy {result['accuracy']:.4f}  AUC {result['auc']:.4f}", flush=True)
        if not curve:
            result = est.evaluate(lambda: _batches(test, test_idx, 4096, None))
            curve.append({"epoch": done, **{k: result[k] for k in ("accuracy", "auc", "log_loss")}})
        keys = ("accuracy", "auc", "log_loss")  # every run's evaluations, not only this one's
        curve = epoch_curve(est.model_dir, est.global_step, steps_per_epoch, keys) or curve
        out = {**curve[-1], "curve": curve, "storage": table_storage(est.embedding)}
        if hp.offload is not None:  # each table's row cache over this run
            out["offload"] = est.embedding.offload_statistics()
        return out
    finally:
        est.embedding.close()  # the offloaded tables' files and locks
        est.close()


def plot_curve(curve: list[dict[str, Any]], peers: dict[str, dict[str, Any]], path: Path, title: str) -> bool:
    """Test accuracy per epoch, with the peers' accuracies as lines; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot([c["epoch"] for c in curve], [c["accuracy"] for c in curve], marker="o", ms=3, label="embtables")
    for (name, r), style in zip(peers.items(), ("--", ":")):
        if "accuracy" in r:
            ax.axhline(r["accuracy"], color="gray", ls=style, lw=1, label=f"{name} ({r['accuracy']:.4f})")
    finish(plt, fig, ax, "epoch", "test accuracy", title, path)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--validation", action="store_true",
        help="adult: train on 80%% of the training rows and report the other 20%% (choosing hyper-parameters)",
    )  # fmt: skip
    p.add_argument("--no-peers", dest="peers", action="store_false", help="adult: skip the scikit-learn peers")


def run(args: argparse.Namespace) -> int:
    """The Adult job; prints per-epoch metrics, the peers and a JSON summary; writes results.json and a plot."""
    log = logging.getLogger("embtables")
    hp = dataclasses.replace(
        Hyper(), epochs=args.epochs or Hyper.epochs, dtype=getattr(args, "dtype", "float32"),
        slot_dtype=getattr(args, "slot_dtype", "float32"), offload=getattr(args, "offload", None),
        cache_rows=getattr(args, "cache_rows", Hyper.cache_rows),
    )  # fmt: skip
    train, test = load_adult(args.data_dir)  # a missing or wrong file: one line and exit code 2 (job_runner)
    out_dir = Path(args.model_dir)
    train_idx = np.arange(len(train))
    if args.validation:  # hyper-parameters are chosen here, on training rows only
        order = np.random.default_rng(0).permutation(len(train))
        cut = int(0.8 * len(train))
        train_idx, test_idx, evaluated, split = order[:cut], order[cut:], train, "validation (20% of training rows)"
    else:
        test_idx, evaluated, split = np.arange(len(test)), test, "test"
    print(f"UCI Adult from {train.source}: {len(train)} training rows, {len(test)} test rows; evaluating on {split}")
    print(f"model: wide and deep over {len(CATEGORICAL) + len(BOUNDARIES) + 1} embtables tables, {hp}")
    peers = peer_results(train, evaluated, train_idx, test_idx) if args.peers else {}
    start = time.perf_counter()
    ours = train_and_test(train, evaluated, train_idx, test_idx, hp, out_dir / "model", args.progress)
    seconds = time.perf_counter() - start
    print(f"{'model':<34}{'accuracy':>9}{'AUC':>8}{'seconds':>9}")
    print(f"{'embtables wide & deep':<34}{ours['accuracy']:>9.4f}{ours['auc']:>8.4f}{seconds:>9.1f}")
    for name, r in peers.items():
        if "skipped" in r:
            print(f"{name:<34} skipped: {r['skipped']}")
        else:
            print(f"{name:<34}{r['accuracy']:>9.4f}{r['auc']:>8.4f}{r['seconds']:>9.1f}")
    if "offload" in ours:
        report_offload(ours["offload"])
    summary = {"dataset": "adult", "split": "validation" if args.validation else "test", "accuracy": ours["accuracy"],
               "auc": ours["auc"], "log_loss": ours["log_loss"], "seconds": seconds, "hyper": dataclasses.asdict(hp),
               "curve": ours["curve"], "peers": peers, "storage": ours["storage"]}  # fmt: skip
    if "offload" in ours:
        summary["offload"] = ours["offload"]
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    if plot_curve(ours["curve"], peers, out_dir / "curves.png", f"embtables on UCI Adult ({split})"):
        print(f"curves: {out_dir / 'curves.png'}")
    else:
        print("curves: not drawn (matplotlib is not installed: pip install matplotlib)")
    print(json.dumps({k: summary[k] for k in ("dataset", "split", "accuracy", "auc", "seconds")}))
    log.info("results in %s", out_dir)
    return 0
