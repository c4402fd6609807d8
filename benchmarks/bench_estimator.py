"""What the ``Estimator`` adds to the bare engine + dense step (issue 16), on the MovieLens-100k model.

    python -m embtables bench estimator                  # batch 512 and 4096, JSON lines on stdout
    python -m embtables bench estimator --batches 1024 --repeats 9

The same factorization machine and the same batches of fold 1, four ways in one process (one thread):

* ``bare``: engine inputs converted before timing; per step ``emb(ids)``, the model, the loss,
  ``backward()``, ``emb.apply_gradients()``, the dense optimizer step (what a hand-written loop does);
* ``estimator`` with ``input_prefetch=0``, ``=1`` and ``="auto"`` (the default: the faster of the two,
  found by timing the first steps of the first call): ``Estimator.train`` over the raw batches (feature
  columns converted as they are read, up to 8 batches in one pass; labels checked, the agreement round,
  metrics rows, the checkpoint at the end of each ``train`` call).

Each way runs one ``train`` call over ``--epochs-per-call`` epochs (default 4: the MovieLens job's
``eval_every``, one call and one checkpoint per period) or the same batches bare, timed ``--repeats``
times (the first is dropped); one ``estimator_overhead`` line per model
(``--models``: the job's six fields, all eight) and batch size gives the medians, the overhead over
``bare``, and where the Estimator's extra time goes: converting a batch (``prepare_ms`` as ``train`` reads
them, up to 8 joined; ``prepare_alone_ms`` one at a time), one step on
converted batches (``step_ms``), and the end-of-call checkpoint (``save_ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import emit, env_record
from embtables.cli import movielens as ml
from embtables.data.movielens import kfold
from embtables.estimator import AdagradParameters, EmbeddingConfigSpec, Estimator


def _estimator(hp: ml.Hyper, prefetch: int | str) -> tuple[Estimator, ml.FactorizationMachine, EmbeddingConfigSpec]:
    spec = EmbeddingConfigSpec(
        feature_columns=ml.columns(hp),
        optimization_parameters=AdagradParameters(hp.learning_rate, initial_accumulator=hp.initial_accumulator),
    )
    model = ml.FactorizationMachine(3.5, hp.l2, hp.fields)
    est = Estimator(
        model,
        spec,
        tempfile.mkdtemp(prefix="embtables-bench-estimator-"),
        dense_optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        loss_fn=lambda pred, y: nn.functional.mse_loss(pred, y) + model.penalty,
        save_checkpoints_steps=None,
        progress=False,
        input_prefetch=prefetch,
    )
    return est, model, spec


def measure(batch_size: int, repeats: int, fields: tuple[str, ...] = ml.FIELDS, epochs: int = 4) -> dict[str, Any]:
    data = ml._load(None, None)
    prepared = ml.prepare(data)
    train, _ = kfold(len(data))[0]
    hp = dataclasses.replace(ml.Hyper(), batch_size=batch_size, fields=fields)
    batches = list(ml._batches(data, prepared, train, batch_size, 0)) * epochs  # one train call: the job's period
    est, model, spec = _estimator(hp, 0)
    emb, opt = est.embedding, est.dense_optimizer
    converted = [(spec.engine_inputs(f), torch.from_numpy(y)) for f, y in batches]

    def bare() -> None:
        for ((ids, weights), y), (features, _) in zip(converted, batches):
            acts = emb(ids, weights or None)
            loss = nn.functional.mse_loss(model(acts, features), y) + model.penalty
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            emb.apply_gradients({k: a.grad for k, a in acts.items()})
            opt.step()

    runs: dict[str, Any] = {"bare": bare}
    estimators = {p: _estimator(hp, p)[0] for p in (0, 1, "auto")}
    for p, e in estimators.items():
        runs[f"estimator_prefetch{p}"] = lambda e=e: e.train(lambda: iter(batches))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    n = len(batches)
    ms = {k: 1e3 * statistics.median(v[1:] if len(v) > 1 else v) / n for k, v in times.items()}
    e0 = estimators[0]
    start = time.perf_counter()
    alone = [e0._prepare(b, True) for b in batches]
    alone_ms = 1e3 * (time.perf_counter() - start) / n
    reader = e0._reader(batches, True)
    start = time.perf_counter()
    items = [reader.next()[1] for _ in batches]  # as train reads them: up to 8 batches joined
    prepare_ms = 1e3 * (time.perf_counter() - start) / n
    assert all(item is not None for item in items) and len(alone) == len(items)
    start = time.perf_counter()
    for item in items:
        assert item is not None
        e0._train_step(item)
    step_ms = 1e3 * (time.perf_counter() - start) / n
    start = time.perf_counter()
    e0.save()
    save_ms = 1e3 * (time.perf_counter() - start)
    return {
        "bench": "estimator_overhead",
        "model": f"movielens-100k factorization machine ({len(fields)} tables: {', '.join(fields)})",
        "fields": "job" if fields == ml.DEFAULT_FIELDS else "all" if fields == ml.FIELDS else "custom",
        "batch": batch_size,
        "steps_per_call": n,
        "epochs_per_call": epochs,
        "threads": torch.get_num_threads(),
        "bare_ms_per_step": round(ms["bare"], 3),
        "estimator_ms_per_step": {k.removeprefix("estimator_"): round(v, 3) for k, v in ms.items() if k != "bare"},
        "overhead": {k.removeprefix("estimator_"): round(v / ms["bare"] - 1, 3) for k, v in ms.items() if k != "bare"},
        "prepare_ms": round(prepare_ms, 3),
        "prepare_alone_ms": round(alone_ms, 3),
        "step_ms": round(step_ms, 3),
        "save_ms_per_train_call": round(save_ms, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embtables bench estimator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="512,4096", help="comma list of batch sizes")
    ap.add_argument("--repeats", type=int, default=7, help="train calls timed per way (the first is dropped)")
    ap.add_argument(
        "--epochs-per-call", type=int, default=ml.Hyper().eval_every, help="epochs per train call (the job's period)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--models", default="job,all",
        help="job: the MovieLens job's model (6 fields); all: every field, the hashed occupation and zip "
        "prefix too (8 fields); comma list (default both)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    emit(env_record())
    models = {"job": ml.DEFAULT_FIELDS, "all": ml.FIELDS}
    for name in args.models.split(","):
        if name not in models:
            ap.error(f"--models: unknown model {name!r} (job, all)")
    for name in args.models.split(","):
        for b in (int(x) for x in args.batches.split(",") if x):
            record = measure(b, args.repeats, models[name], args.epochs_per_call)
            emit(record)
            ways = record["estimator_ms_per_step"].items()
            parts = ", ".join(f"{k} {v:.3f} ({record['overhead'][k]:+.0%})" for k, v in ways)
            print(
                f"{name} model, batch {b}: bare {record['bare_ms_per_step']:.3f} ms/step, Estimator {parts}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
