"""``embtables train`` (default): a DLRM-style click-through model on the built-in synthetic data.

The data (``embtables.data.SyntheticCTR``) come from a planted teacher, so the job reports the best
achievable held-out AUC and log-loss next to the model's. Six features over five tables from 1e3 to
1e6 rows, Zipf-distributed ids, one-hot, multi-hot and sequence features, and a different fused
optimizer per table, trained with the ``Estimator``:

    user (1e6 rows, Adagrad)  item (2e5, Adam) <- item_history (sequence of 10, same table)
    city (5e4, Adagrad)  tags (1e4, FTRL, multi-hot)  category (1e3, SGD)
        -> activations [B, D] (item_history [B, 10, D], mean over its ids)
        -> DLRM interaction: every pairwise dot product of the F = 6 vectors, concatenated with them
        -> MLP -> logit [B] -> BCE

Writes into ``--model-dir``: checkpoints, ``train_metrics.csv`` / ``eval_metrics.csv``, lookup
statistics (``lookup_stats/``, see ``embtables stats``) and ``training_curves.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import embtables
from embtables.cli.history import earlier_runs, metrics_rows
from embtables.cli.job_runner import storage_line, table_storage
from embtables.cli.plotting import pyplot
from embtables.cli.scoring_recipe import write_recipe
from embtables.data import SyntheticCTR, SyntheticCTRConfig
from embtables.data.synthetic import CategoricalFeature
from embtables.estimator import EmbeddingConfigSpec, Estimator, auc, log_loss
from embtables.estimator.row_transform import RowTransform
from embtables.sharding import comm
from embtables.tables import Ragged, TruncatedNormal

HISTORY = 10  # max_sequence_length of item_history

FEATURES = (
    CategoricalFeature("user", vocabulary_size=1_000_000),
    CategoricalFeature("item", vocabulary_size=200_000),
    CategoricalFeature("item_history", vocabulary_size=200_000, min_ids=1, max_ids=HISTORY, table="item"),
    CategoricalFeature("city", vocabulary_size=50_000),
    CategoricalFeature("tags", vocabulary_size=10_000, min_ids=0, max_ids=5),
    CategoricalFeature("category", vocabulary_size=1_000),
)


class BiasCorrectedAdamLR:
    """``lr * sqrt(1 - b2^t) / (1 - b1^t)`` at global step t: textbook Adam on top of TPU Adam."""

    def __init__(self, lr: float, step: Callable[[], int]) -> None:
        self.lr, self.step = lr, step

    def __call__(self) -> float:
        t = int(self.step()) + 1
        return float(self.lr * math.sqrt(1.0 - 0.999**t) / (1.0 - 0.9**t))


def table_optimizers(step: Any) -> dict[str, Any]:
    """A different fused optimizer per table. Per-row gradients are sums of 1/B-scaled terms, so SGD
    needs a large rate and Adagrad and FTRL initial accumulators far below the squared gradients (~1e-10
    at 8192 per step; TF's 0.1 would freeze them): its first steps then move a row by about the learning
    rate whatever the batch size, which is what the rows of
    rare ids, updated a few times in a run, need. Chosen on held-out batches (docs/estimator.md)."""
    return {
        "user": embtables.Adagrad(1.0, initial_accumulator_value=1e-10),
        "item": embtables.Adam(BiasCorrectedAdamLR(0.03, step)),
        "city": embtables.Adagrad(1.0, initial_accumulator_value=1e-10),
        "tags": embtables.FTRL(3.0, initial_accumulator_value=1e-10),
        "category": embtables.SGD(30.0),
    }


INIT_STDDEV = 0.01  # rows start near 0: a row its id never trained adds almost nothing to the logit


def user_keys(ids: Tensor) -> Tensor:
    """User ids [N] in [0, V) as 64-bit keys spread over the whole int64 range (a bijection), what a
    dynamic user table sees (``--dynamic-user``)."""
    with np.errstate(over="ignore"):
        z = (ids.numpy().astype(np.uint64) + np.uint64(0x5DEECE66D)) * np.uint64(0x9E3779B97F4A7C15)
    return torch.from_numpy(z.view(np.int64))


def _with_user_keys(features: dict[str, Ragged]) -> dict[str, Ragged]:
    user = features["user"]
    return {**features, "user": Ragged(user_keys(user.values), user.row_splits)}


def spec_for(
    data: SyntheticCTR,
    dim: int,
    step: Any,
    profile_dir: str | None,
    dynamic_user: int | None = None,
    stored: tuple[str, str] = ("float32", "float32"),
    offload: embtables.Offload | None = None,
) -> EmbeddingConfigSpec:
    """The ``EmbeddingConfigSpec`` (dicts form: per-table optimizers) of the job; ``dynamic_user`` makes the
    user table dynamic with that many rows (admitted at a key's second lookup, LRU eviction); ``stored``: the
    tables' (row, slot) storage types; ``offload``: every fixed table's rows in files (docs/offload.md)."""
    features = data.feature_configs(dim=dim)
    optimizers = table_optimizers(step)
    tables = {}
    for f in features.values():
        t = f.table
        assert t.name is not None
        assert isinstance(t.initializer, TruncatedNormal)
        init = TruncatedNormal(stddev=INIT_STDDEV, seed=t.initializer.seed)  # the data set's seed per table
        dynamic = None
        rows = t.vocabulary_size
        if t.name == "user" and dynamic_user is not None:
            dynamic, rows = embtables.DynamicVocabulary(admit_after=2, eviction="lru"), dynamic_user
        tables[t.name] = embtables.TableConfig(
            rows, t.dim, initializer=init, optimizer=optimizers[t.name], name=t.name, dynamic=dynamic,
            dtype=stored[0], slot_dtype=stored[1], offload=offload if dynamic is None else None,
        )  # fmt: skip
    feature_dict = {
        name: embtables.FeatureConfig(
            tables[f.table.name or name], max_sequence_length=HISTORY if name == "item_history" else 0, name=name
        )
        for name, f in features.items()
    }
    return EmbeddingConfigSpec(
        feature_to_config_dict=feature_dict,
        table_to_config_dict=tables,
        optimization_parameters=embtables.Adagrad(0.1),  # every table above has its own optimizer
        profile_data_directory=profile_dir,
    )


def mlp_head(width: int, hidden: Sequence[int]) -> nn.Sequential:
    """``Linear + ReLU`` layers of the ``hidden`` widths from ``width`` inputs, then one logit."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def interaction(vectors: list[Tensor], pairs: Tensor) -> Tensor:
    """DLRM's interaction of F vectors [B, D]: every pairwise dot product (``pairs``: the upper triangle's
    [2, F(F-1)/2] indices) and the vectors themselves, [B, F(F-1)/2 + F*D]."""
    x = torch.stack(vectors, 1)  # [B, F, D]
    dots = torch.bmm(x, x.transpose(1, 2))[:, pairs[0], pairs[1]]  # [B, F(F-1)/2]
    return torch.cat([dots, x.flatten(1)], 1)


class DLRM(nn.Module):
    """Pairwise dot products of the feature vectors plus the vectors themselves -> MLP -> logit."""

    def __init__(self, names: list[str], dim: int, hidden: tuple[int, ...] = (128, 64)) -> None:
        super().__init__()
        self.names = names
        f = len(names)
        self.mlp = mlp_head(f * (f - 1) // 2 + f * dim, hidden)
        self.pairs = torch.triu_indices(f, f, offset=1)

    def forward(self, activations: dict[str, Tensor], features: dict[str, Ragged | Tensor]) -> Tensor:
        vectors = []
        for name in self.names:
            a = activations[name]
            if a.dim() == 3:  # the sequence: mean over its (zero-padded) positions
                f = features[name]  # its ids; a model artifact gives their lengths [B] (tensors only)
                lengths = f.lengths() if isinstance(f, Ragged) else f
                n = lengths.clamp(1, a.shape[1]).to(a.dtype).unsqueeze(1)
                a = a.sum(1) / n
            vectors.append(a)
        out: Tensor = self.mlp(interaction(vectors, self.pairs)).squeeze(1)
        return out


def scoring_model(args: dict[str, Any], task: str) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """The job's DLRM from its recipe's arguments (``scoring_recipe``; the weights come from a checkpoint), its
    ``predictions_fn`` and an example of the tensor features it reads: each sequence feature's lengths [B]."""
    names, dim, sequences = args["names"], args["dim"], args["sequences"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or type(dim) is not int or not (
            isinstance(sequences, list) and set(sequences) <= set(names)) or dim < 1:  # fmt: skip
        raise TypeError("the model's names, dim and sequence features are malformed")
    example = {name: torch.zeros(2, dtype=torch.int64) for name in sequences}
    return DLRM(names, dim), torch.sigmoid, example


def _write_recipe(data: SyntheticCTR, dim: int, model_dir: Path) -> None:
    """``MODEL_DIR/scoring.json``: the DLRM rebuilt for ``embtables export --model``; a row holds each feature's
    ids (one, a list, or a "|"-joined string)."""
    names = sorted(f.name for f in data.config.features)
    sequences = [n for n in names if n == "item_history"]
    shapes = {n: [HISTORY, dim] if n in sequences else [dim] for n in names}
    transform = RowTransform(id_lists=tuple((n, "|") for n in names))
    extra = {"engine_features": names, "activation_shapes": shapes,
             "tensor_sources": {n: f"{n}#lengths" for n in sequences}}  # fmt: skip
    write_recipe(model_dir, "synthetic", [], transform, "binary", None,
                 {"names": names, "dim": dim, "sequences": sequences}, extra)  # fmt: skip


def plot(history: list[dict[str, float]], evals: list[dict[str, float]], teacher: dict[str, float], path: Path) -> bool:
    """Training loss and held-out AUC / log-loss against the step, with the teacher's as lines."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    ax = axes[0]
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1, label="training loss")
    ax.plot([e["step"] for e in evals], [e["log_loss"] for e in evals], marker="o", ms=3, label="held-out log-loss")
    ax.axhline(teacher["log_loss"], color="gray", ls="--", lw=1, label="teacher log-loss")
    ax.set_xlabel("step")
    ax.set_ylabel("log-loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    ax.plot([e["step"] for e in evals], [e["auc"] for e in evals], marker="o", ms=3, label="held-out AUC")
    ax.axhline(teacher["auc"], color="gray", ls="--", lw=1, label="teacher AUC")
    ax.set_xlabel("step")
    ax.set_ylabel("AUC")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("embtables DLRM on synthetic CTR data")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2400; --small 60)")
    p.add_argument(
        "--batch-size", type=int, default=None,
        help="samples per step (default 8192; --small 512; --data: what gives an epoch about 40 steps)",
    )  # fmt: skip
    p.add_argument("--dim", type=int, default=16, help="embedding width D (default 16)")
    p.add_argument(
        "--eval-every", type=int, default=None, help="steps between held-out evaluations (default 600; --small 20)"
    )
    p.add_argument("--eval-size", type=int, default=None, help="held-out samples (default 16384; --small 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, tables and model (default 0)")
    p.add_argument("--small", action="store_true", help="a smoke test in seconds: 1000x smaller tables, fewer steps")
    p.add_argument(
        "--dynamic-user", type=int, metavar="ROWS", default=None,
        help="make the user table dynamic (docs/dynamic_vocabularies.md): users as 64-bit keys, ROWS rows, a key "
        "admitted at its second lookup, LRU eviction; the summary reports admissions and evictions",
    )  # fmt: skip


# (--steps, --batch-size, --eval-every, --eval-size) when not given: the real job and the smoke test.
DEFAULTS = {False: (2400, 8192, 600, 16384), True: (60, 512, 20, 2048)}


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the DLRM options the command line left out (``--small`` picks the smoke test's)."""
    for name, value in zip(("steps", "batch_size", "eval_every", "eval_size"), DEFAULTS[bool(args.small)]):
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    """Train, evaluate against the teacher, write the artefacts; 0 when the model learned."""
    resolve_defaults(args)
    torch.manual_seed(args.seed)
    data = _dataset(args)
    rank, world = (comm.get_rank(), comm.get_world_size()) if comm.is_distributed() else (0, 1)
    model_dir = Path(args.model_dir)  # checked (or made) by the job runner
    estimator = _estimator(args, data, model_dir)
    if rank == 0 and args.dynamic_user is None:  # a dynamic user table's keys are not rows' ids: not exported
        model_dir.mkdir(parents=True, exist_ok=True)
        _write_recipe(data, args.dim, model_dir)
    try:
        say = print if rank == 0 else (lambda *a, **k: None)
        _announce(say, args, estimator, model_dir, world)
        say(storage_line(table_storage(estimator.embedding)))
        held_out = _HeldOut(data, args.eval_size, rank, world, keyed=args.dynamic_user is not None)
        start = time.perf_counter()
        first = estimator.restore()  # an earlier run's checkpoint in model_dir: continue from it (--steps is a total)
        if first:
            say(f"resumed from step {first} in {model_dir}")
        if first >= args.steps:
            say(f"finished: step {first} already reaches --steps {args.steps}; nothing to train (evaluating only)")
        evals = _train(estimator, data, args, held_out, rank, world, say)
        seconds = time.perf_counter() - start
        final = evals[-1]
        learned = final["auc"] > 0.6 if estimator.global_step - first >= 50 else True
        # a collective when sharded: every rank asks, rank 0 reports
        vocabulary = estimator.embedding.vocabulary_statistics() if args.dynamic_user is not None else None
        offloaded = estimator.embedding.offload_statistics() if getattr(args, "offload", None) else None
        if rank == 0:
            if offloaded:
                report_offload(offloaded)
            _report(estimator, args, evals, held_out.teacher, first, seconds, world, model_dir, vocabulary, offloaded)
            if estimator.global_step == first:
                print(f"finished: no step trained in this run (the model in {model_dir} is at step {first}).")
                return 0
            print("PASS: the model learned." if learned else "FAIL: held-out AUC stayed at chance.")
        return 0 if learned else 1
    finally:
        estimator.embedding.close()  # the offloaded tables' files and locks
        estimator.close()  # let the next writer (a rerun in this process) take the model_dir


def _dataset(args: argparse.Namespace) -> SyntheticCTR:
    """The synthetic CTR data with its planted teacher (``--small``: vocabularies / 1000, at least 50)."""
    features: tuple[CategoricalFeature, ...] = FEATURES
    if args.small:
        features = tuple(
            CategoricalFeature(f.name, max(50, f.vocabulary_size // 1000), f.min_ids, f.max_ids, f.table)
            for f in FEATURES
        )
    interactions = (("user", "item"), ("city", "tags"))
    return SyntheticCTR(SyntheticCTRConfig(seed=args.seed, features=features, interactions=interactions))


def _estimator(args: argparse.Namespace, data: SyntheticCTR, model_dir: Path) -> Estimator:
    """The DLRM ``Estimator``: embedding tables from ``spec_for``, a dense Adam, AUC and log-loss."""
    estimator: Estimator | None = None

    def step() -> int:
        return estimator.global_step if estimator is not None else 0

    stored = (getattr(args, "dtype", "float32"), getattr(args, "slot_dtype", "float32"))
    offload = None
    if getattr(args, "offload", None) is not None:
        offload = embtables.Offload(args.offload, args.cache_rows)
    spec = spec_for(data, args.dim, step, str(model_dir / "lookup_stats"), args.dynamic_user, stored, offload)
    estimator = Estimator(
        DLRM(sorted(f.name for f in data.config.features), args.dim),
        spec,
        model_dir,
        dense_optimizer=lambda p: torch.optim.Adam(p, lr=2e-3),
        loss_fn=nn.functional.binary_cross_entropy_with_logits,
        predictions_fn=torch.sigmoid,
        eval_metrics={"auc": auc, "log_loss": log_loss},
        save_checkpoints_steps=args.save_every,
        incremental_checkpoints=args.incremental,
        log_step_count_steps=max(1, min(100, args.steps // 10)),
        progress=args.progress,
    )
    return estimator


def _announce(
    say: Callable[..., None], args: argparse.Namespace, estimator: Estimator, model_dir: Path, world: int
) -> None:
    tables = ", ".join(
        f"{t.name} {t.vocabulary_size}x{t.dim} {type(t.optimizer).__name__}"
        for t in estimator.embedding.resolved_config.tables
    )
    say(f"embtables {embtables.__version__} DLRM on synthetic CTR data: {args.steps} steps x {args.batch_size}")
    sharded = f"  ({world} processes, tables sharded: {estimator.embedding.sharding_plan})" if world > 1 else ""
    say(f"model_dir: {model_dir}{sharded}")
    say(f"tables: {tables}")


class _HeldOut:
    """The held-out set: the same batches for the teacher and the model, split evenly over the ranks,
    and the teacher's AUC and log-loss on it (the best achievable)."""

    def __init__(self, data: SyntheticCTR, eval_size: int, rank: int, world: int, keyed: bool = False) -> None:
        n_eval = world * max(1, math.ceil(eval_size / (4096 * world)))
        self.batches = [data.batch(max(1, eval_size // n_eval), i, split="eval") for i in range(n_eval)]
        logits = np.concatenate([data.teacher_logits(f).numpy() for f, _ in self.batches])
        if keyed:  # the model sees users as keys (the teacher above saw their ids)
            self.batches = [(_with_user_keys(f), y) for f, y in self.batches]
        labels = np.concatenate([y.numpy() for _, y in self.batches])
        self.teacher = {"auc": auc(logits, labels), "log_loss": log_loss(1 / (1 + np.exp(-logits)), labels)}
        self.rank, self.world = rank, world

    def input_fn(self) -> Iterator[tuple[dict[str, Ragged], Tensor]]:
        yield from self.batches[self.rank :: self.world]  # every rank its share; evaluate gathers the metrics


def _train(
    estimator: Estimator,
    data: SyntheticCTR,
    args: argparse.Namespace,
    held_out: _HeldOut,
    rank: int,
    world: int,
    say: Callable[..., None],
) -> list[dict[str, float]]:
    """Train up to ``--steps`` (in total), evaluating every ``--eval-every`` steps; the evaluations
    (at least one, also when nothing was left to train)."""

    def train_fn(start: int, count: int) -> Iterator[tuple[dict[str, Ragged], Tensor]]:
        for step in range(start, start + count):  # rank r reads batches r, r + W, ...: a global batch of W x B
            features, labels = data.batch(args.batch_size, step * world + rank)
            yield (_with_user_keys(features) if args.dynamic_user is not None else features), labels

    start = time.perf_counter()
    teacher = held_out.teacher
    evals: list[dict[str, float]] = []
    # offloaded tables: each line also says what their row caches did since the last (a collective when sharded)
    offload = estimator.embedding.offload_statistics if getattr(args, "offload", None) else None
    counters = offload() if offload is not None else {}
    while estimator.global_step < args.steps:
        chunk = min(args.eval_every, args.steps - estimator.global_step)
        estimator.train(functools.partial(train_fn, estimator.global_step, chunk), steps=chunk)
        result = estimator.evaluate(held_out.input_fn)
        evals.append({"step": float(estimator.global_step), "auc": result["auc"], "log_loss": result["log_loss"]})
        cache = ""
        if offload is not None:
            now = offload()
            cache = "  " + _offload_interval(counters, now)
            counters = now
        say(
            f"step {estimator.global_step:6d}  held-out AUC {result['auc']:.4f}  "
            f"log-loss {result['log_loss']:.4f}  (teacher {teacher['auc']:.4f} / {teacher['log_loss']:.4f})  "
            f"{time.perf_counter() - start:6.1f} s{cache}",
            flush=True,
        )
    if not evals:
        result = estimator.evaluate(held_out.input_fn)
        evals.append({"step": float(estimator.global_step), **{k: v for k, v in result.items() if k != "global_step"}})
    return evals


def _offload_interval(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> str:
    """The offloaded tables' row caches between two ``offload_statistics``, summed over the tables: the share
    of looked-up rows found in memory, what was read from and written to disk, the time spent waiting for it."""

    def delta(key: str) -> float:
        return sum(after[t][key] - before.get(t, {}).get(key, 0.0) for t in after)

    looked = delta("rows_looked_up")
    hits = f"{delta('hits') / looked:.1%}" if looked else "-"
    return (
        f"offload: hits {hits}, {delta('bytes_read') / 2**20:.0f} MiB read, "
        f"{delta('bytes_written') / 2**20:.0f} MiB written, {delta('disk_wait_s'):.2f} s disk wait"
    )


def report_offload(stats: dict[str, dict[str, float]]) -> None:
    """One line a table: the row cache's hit rate, what it read and wrote, and the time it waited for the disk."""
    for name, s in stats.items():
        looked = max(1.0, s["rows_looked_up"])
        print(
            f"offload {name}: hits {s['hits'] / looked:.1%} of {s['rows_looked_up']:.0f} rows looked up, "
            f"{s['bytes_read'] / 2**20:.0f} MiB read, {s['bytes_written'] / 2**20:.0f} MiB written, "
            f"{s['disk_wait_s']:.2f} s waiting for the disk, {s['resident_rows']:.0f} of {s['cache_rows']:.0f} "
            "cache rows in use"
        )


def _report(
    estimator: Estimator,
    args: argparse.Namespace,
    evals: list[dict[str, float]],
    teacher: dict[str, float],
    first: int,
    seconds: float,
    world: int,
    model_dir: Path,
    vocabulary: dict[str, dict[str, int]] | None,
    offloaded: dict[str, dict[str, float]] | None = None,
) -> None:
    """Rank 0's artefacts: the curves (PNG) and summary.json of every run into ``model_dir`` so far
    (a rerun keeps the history), and the summary line."""
    step = estimator.global_step
    history = metrics_rows(model_dir / "train_metrics.csv", step) or estimator.history
    every_eval = [e for e in metrics_rows(model_dir / "eval_metrics.csv", step) if "auc" in e and "log_loss" in e]
    png = model_dir / "training_curves.png"
    if plot(history, every_eval or evals, teacher, png):
        print(f"curves: {png}")
    else:
        print("curves: not drawn (matplotlib is not installed: pip install matplotlib)")
    print(f"checkpoint: {estimator.latest_checkpoint()}   lookup statistics: {model_dir / 'lookup_stats'}")
    final = evals[-1]
    summary = {
        "job": "dlrm-synthetic",
        "steps": estimator.global_step,
        "steps_trained": estimator.global_step - first,  # by this run; "runs" has every run's
        "batch_size": args.batch_size,
        "auc": final["auc"],
        "log_loss": final["log_loss"],
        "teacher_auc": teacher["auc"],
        "teacher_log_loss": teacher["log_loss"],
        "seconds": seconds,
        "processes": world,
        "storage": table_storage(estimator.embedding),
    }
    if vocabulary is not None:
        summary["vocabulary"] = vocabulary
    if offloaded:
        summary["offload"] = offloaded
    runs = earlier_runs(model_dir / "summary.json")
    if step > first:
        runs.append({"from_step": first, "to_step": step, "seconds": round(seconds, 3), "processes": world})
    summary["runs"] = runs
    (model_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
