"""MovieLens-100k, 5-fold: embtables' rating model (``embtables train --dataset movielens-100k``) next
to Surprise's SVD, the usual baseline, on the same folds in the same run.

    python3 benchmarks/bench_movielens.py              # both; JSON lines on stdout, progress on stderr
    python3 benchmarks/bench_movielens.py --peers-only
    python3 benchmarks/bench_movielens.py --rounds 5     # interleaved rounds (default 5)

Our time is the job's own clock (``train_seconds``: data preparation and the 5 folds, after the
imports), as Surprise's is (building its trainsets, fitting and predicting, after its imports); the
process's wall time with start-up is ``seconds``. ``surprise-svd-process`` runs Surprise as a whole
process too (Python's start-up and its imports included), so ``movielens_100k_process_ratio`` compares
what a user waits for: the embtables command against a Surprise script, end to end.

Surprise is optional (``pip install scikit-surprise``; a skip line otherwise). Its SVD runs with its
defaults (100 factors, 20 epochs, lr 0.005, reg 0.02), as its own benchmark table reports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import emit
from embtables.data.movielens import kfold, load_movielens_100k


def surprise_svd(folds: int) -> dict[str, Any]:
    """Surprise's SVD on our k-fold split: mean RMSE / MAE and the wall time."""
    try:
        import pandas as pd
        from surprise import SVD, Dataset, Reader
    except ImportError as exc:
        return {"skipped": f"surprise unavailable ({exc}); pip install scikit-surprise pandas"}
    data = load_movielens_100k()
    frame = pd.DataFrame({"user": data.user, "item": data.item, "rating": data.rating.astype(np.float64)})
    reader = Reader(rating_scale=(1, 5))
    start = time.perf_counter()
    rmses, maes = [], []
    for f, (train, test) in enumerate(kfold(len(data))[:folds]):
        trainset = Dataset.load_from_df(frame.iloc[train], reader).build_full_trainset()
        algo = SVD(random_state=f)
        algo.fit(trainset)
        pred = np.array([algo.predict(u, i).est for u, i in zip(data.user[test], data.item[test])])
        err = pred - data.rating[test]
        rmses.append(float(np.sqrt(np.mean(err**2))))
        maes.append(float(np.mean(np.abs(err))))
        print(f"surprise SVD fold {f + 1}: RMSE {rmses[-1]:.4f}", file=sys.stderr)
    return {"rmse": float(np.mean(rmses)), "mae": float(np.mean(maes)), "seconds": time.perf_counter() - start}


_SURPRISE_PROCESS = """
import sys, time, json
import numpy as np
import pandas as pd
from surprise import SVD, Dataset, Reader
start = time.perf_counter()
d = np.load(sys.argv[1])
frame = pd.DataFrame({"user": d["user"], "item": d["item"], "rating": d["rating"].astype(np.float64)})
rmses = []
for f in range(int(sys.argv[2])):
    test = d[f"test{f}"]
    keep = np.ones(len(frame), dtype=bool)
    keep[test] = False
    trainset = Dataset.load_from_df(frame[keep], Reader(rating_scale=(1, 5))).build_full_trainset()
    algo = SVD(random_state=f)
    algo.fit(trainset)
    pred = np.array([algo.predict(u, i).est for u, i in zip(d["user"][test], d["item"][test])])
    rmses.append(float(np.sqrt(np.mean((pred - d["rating"][test]) ** 2))))
print(json.dumps({"rmse": float(np.mean(rmses)), "fit_seconds": time.perf_counter() - start}))
"""


def surprise_process(folds: int) -> dict[str, Any]:
    """Surprise's SVD as a whole process, start-up and imports included (the ratings and our folds are
    handed over in an .npz, so it reads no text file; embtables' process parses the data set itself)."""
    if importlib.util.find_spec("surprise") is None:
        return {"skipped": "surprise unavailable; pip install scikit-surprise pandas"}
    data = load_movielens_100k()
    with tempfile.TemporaryDirectory() as tmp:
        tests = {f"test{f}": test for f, (_, test) in enumerate(kfold(len(data))[:folds])}
        npz = Path(tmp) / "ratings.npz"
        np.savez(npz, user=data.user, item=data.item, rating=data.rating, **tests)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _SURPRISE_PROCESS, str(npz), str(folds)], capture_output=True,
                             text=True, check=False)  # fmt: skip
        wall = time.perf_counter() - start
    if out.returncode != 0:
        return {"skipped": f"surprise failed: {out.stderr[-500:]}"}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rmse": got["rmse"], "seconds": wall, "train_seconds": got["fit_seconds"]}


def embtables_job(folds: int) -> dict[str, Any]:
    """``embtables train --dataset movielens-100k`` in a fresh process, as a user runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "embtables", "train", "--dataset", "movielens-100k", "--folds", str(folds),
               "--model-dir", tmp, "--no-progress"]  # fmt: skip
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        if out.returncode != 0:
            return {"skipped": f"embtables train failed: {out.stderr[-500:]}"}
        summary = json.loads((Path(tmp) / "results.json").read_text())
    return {"rmse": summary["rmse"], "mae": summary["mae"], "seconds": wall, "train_seconds": summary["seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--peers-only", action="store_true")
    p.add_argument(
        "--rounds", type=int, default=5,
        help="rounds of every impl, interleaved (this VM's speed drifts by 20-30%% within minutes); the last "
        "record of each impl is its median over the rounds (default 5)",
    )  # fmt: skip
    args = p.parse_args(argv)
    emit({"bench": "env", "cpus": os.cpu_count(), "python": sys.version.split()[0], "rounds": args.rounds})
    runs = [("surprise-svd", surprise_svd), ("surprise-svd-process", surprise_process)]
    runs += [] if args.peers_only else [("embtables", embtables_job)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runs}
    for r in range(args.rounds):
        for name, fn in runs:
            print(f"round {r + 1}/{args.rounds}: running {name} ...", file=sys.stderr)
            got = fn(args.folds)
            results[name].append(got)
            emit({"bench": "movielens_100k_kfold", "impl": name, "folds": args.folds, "round": r + 1, **got})
    for name, rows in results.items():
        if any("skipped" in row for row in rows):
            continue
        median = {k: float(np.median([row[k] for row in rows])) for k in rows[0] if k.endswith("seconds")}
        emit({"bench": "movielens_100k_kfold", "impl": name, "folds": args.folds, "round": "median",
              **rows[0], **median, "seconds_per_round": [row["seconds"] for row in rows]})  # fmt: skip
    if all(rows and "skipped" not in rows[0] for rows in results.values()) and "embtables" in results:
        ratios = [e["train_seconds"] / sv["seconds"] for e, sv in zip(results["embtables"], results["surprise-svd"])]
        emit({"bench": "movielens_100k_ratio", "train_seconds_over_surprise": ratios,
              "median": float(np.median(ratios))})  # fmt: skip
        if all("skipped" not in r for r in results["surprise-svd-process"]):  # whole processes, start-up included
            whole = [
                e["seconds"] / sv["seconds"] for e, sv in zip(results["embtables"], results["surprise-svd-process"])
            ]
            emit({"bench": "movielens_100k_process_ratio", "process_seconds_over_surprise_process": whole,
                  "median": float(np.median(whole))})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
