"""``embtables train --data FILE --schema SCHEMA`` (issue 39, item 5): numeric and bucketized columns,
a batch size that fits the data, accuracy beside AUC, the best held-out epoch kept and reported, the
curves, a rerun that keeps the history, and ``--seed`` that makes two fresh runs give the same bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embtables.__main__ import main as cli
from embtables.data import sample_path


def _numeric_data(tmp_path: Path) -> tuple[Path, Path]:
    """Clicks decided mostly by two numbers (a price, fed to the MLP, and an age, bucketized)."""
    rng = np.random.default_rng(0)
    n = 4000
    frame = pd.DataFrame(
        {
            "user": rng.integers(0, 50, n),
            "price": np.exp(rng.normal(3.0, 1.0, n)),
            "age": rng.integers(16, 80, n).astype(float),
        }
    )
    frame.loc[rng.choice(n, 40, replace=False), "price"] = np.nan  # missing values read as the mean
    logit = 2.5 * (np.log1p(frame["price"].fillna(20.0)) - 3.0) + 2.0 * (frame["age"] > 45) - 1.0
    frame["clicked"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    data = tmp_path / "numbers.csv"
    frame.to_csv(data, index=False)
    schema = {
        "label": "clicked",
        "dim": 8,
        "features": {
            "user": {"type": "identity", "num_buckets": 50},
            "price": {"type": "numeric", "normalize": "log"},
            "age": {"type": "bucketized", "boundaries": [25, 35, 45, 55, 65]},
        },
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return data, path


def _train(data: Path, schema: Path, model_dir: Path, *extra: str) -> int:
    argv = ["--data", str(data), "--schema", str(schema), "--model-dir", str(model_dir), "--no-progress"]
    return cli(["train", *argv, "--threads", "1", *extra])


def test_numeric_and_bucketized_columns_learn_and_report_the_best_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, schema = _numeric_data(tmp_path)
    assert _train(data, schema, tmp_path / "m", "--epochs", "6") == 0
    out = capsys.readouterr().out
    assert "1 numeric features" in out and "batch size 64" in out  # 3,600 rows: about 40 steps an epoch
    assert "storage: float32 rows, float32 slots: " in out
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    assert all(s["rows"] == "float32" and not s["offload"] for s in results["storage"].values())
    assert [c["epoch"] for c in results["curve"]] == [1, 2, 3, 4, 5, 6]
    best = max(results["curve"], key=lambda c: c["auc"])
    assert results["best_epoch"] == best["epoch"] and results["best"]["auc"] == best["auc"]
    assert best["auc"] > 0.8 and best["accuracy"] > 0.7, best  # the numbers carry the signal
    assert f"best held-out epoch: {results['best_epoch']} of 6" in out
    kept = tmp_path / "m" / "best-epoch"
    assert (kept / f"ckpt-{int(best['step']):08d}").is_dir() and list(kept.glob("dense-*.pt"))
    assert (tmp_path / "m" / "curves.png").stat().st_size > 1000
    assert cli(["inspect", str(kept)]) == 0  # a model directory of its own
    # A rerun of the finished job keeps the history: six epochs, the same best one.
    capsys.readouterr()
    assert _train(data, schema, tmp_path / "m", "--epochs", "6") == 0
    again = json.loads((tmp_path / "m" / "results.json").read_text())
    assert len(again["curve"]) == 6 and again["best_epoch"] == results["best_epoch"]
    assert "evaluating only" in capsys.readouterr().out


def test_the_same_seed_gives_the_same_bits_and_the_sample_learns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, schema = Path(sample_path("clicks.csv")), Path(sample_path("clicks.schema.json"))
    runs = []
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert _train(data, schema, tmp_path / name, "--epochs", "4", "--seed", seed) == 0
        runs.append(json.loads((tmp_path / name / "results.json").read_text())["curve"])
    assert runs[0] == runs[1]  # tables, model, split and shuffle all seeded
    assert runs[0] != runs[2]
    assert max(c["auc"] for c in runs[0]) > 0.7  # the shipped sample learns at the default batch size
    capsys.readouterr()


def test_schema_errors_name_the_schema_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _numeric_data(tmp_path)
    cases = {
        "identity, hash, vocabulary, bucketized, numeric": {"price": {"type": "float"}},
        "bucketized feature 'age': schema": {"age": {"type": "bucketized", "boundaries": [30, 20]}},
        "needs the field 'boundaries'": {"age": {"type": "bucketized"}},
        "`normalize` must be one of": {"price": {"type": "numeric", "normalize": "zscore"}},
        "numeric features alone feed no table": {"price": {"type": "numeric"}},
    }
    for expected, features in cases.items():
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"label": "clicked", "features": features}))
        assert _train(data, path, tmp_path / "bad") == 2
        err = capsys.readouterr().err
        assert expected in err and "column(" not in err, err
