"""MovieLens-100k, 5-fold: embtables' rating model (``embtables train --dataset movielens-100k``) next
to Surprise's SVD, the usual baseline, on the same folds in the same run.

    python3 benchmarks/bench_movielens.py              # both; JSON lines on stdout, progress on stderr
    python3 benchmarks/bench_movielens.py --peers-only

Surprise is optional (``pip install scikit-surprise``; a skip line otherwise). Its SVD runs with its
defaults (100 factors, 20 epochs, lr 0.005, reg 0.02), as its own benchmark table reports it.
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args(argv)
    emit({"bench": "env", "cpus": os.cpu_count(), "python": sys.version.split()[0]})
    runs = [("surprise-svd", surprise_svd)] + ([] if args.peers_only else [("embtables", embtables_job)])
    for name, fn in runs:
        print(f"running {name} ...", file=sys.stderr)
        emit({"bench": "movielens_100k_kfold", "impl": name, "folds": args.folds, **fn(args.folds)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
