"""Model artifacts (issue 60, items 1-2): ``embtables export --model``, ``embtables.load_model``, ``embtables
predict`` and ``Estimator.export_model`` score raw rows bit for bit as the Estimator's ``predict`` does, for the
``--data`` job (every schema type, missing values, multi-valued cells, numeric normalisation) and for an Estimator
of one's own; an incremental export adds a step that ``update()`` takes in; mistakes are one-line errors."""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fast_child
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import embtables as et
from embtables import estimator as est
from embtables.__main__ import main as cli
from embtables.checkpoint import CheckpointError
from embtables.cli.model_files import parts_of
from embtables.estimator.row_transform import RowTransform
from embtables.estimator.scoring_model import as_columns

N = 1500


def _table(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Rows with every schema type: ids, hashed strings with a multi-valued cell, a vocabulary with unknown
    values, a bucketized age and two numbers (log and standard), some of them missing."""
    frame = pd.DataFrame(
        {
            "user": rng.integers(0, 60, n),
            "tags": ["|".join(f"t{v}" for v in rng.integers(0, 30, rng.integers(0, 4))) for _ in range(n)],
            "country": rng.choice(["US", "FR", "IN", "XX", ""], n),
            "age": rng.integers(16, 80, n).astype(float),
            "price": np.exp(rng.normal(3.0, 1.0, n)),
            "score": rng.normal(5.0, 2.0, n),
        }
    )
    frame.loc[rng.choice(n, 30, replace=False), "price"] = np.nan
    frame.loc[rng.choice(n, 20, replace=False), "country"] = None
    logit = 0.8 * (np.log1p(frame["price"].fillna(20.0)) - 3.0) + 1.5 * (frame["age"] > 45) - 0.7 + 0.1 * frame["score"]
    frame["clicked"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return frame


SCHEMA = {
    "label": "clicked",
    "dim": 8,
    "features": {
        "user": {"type": "identity", "num_buckets": 60},
        "tags": {"type": "hash", "hash_bucket_size": 100, "separator": "|"},
        "country": {"type": "vocabulary", "vocabulary": ["US", "FR", "IN"], "num_oov_buckets": 1},
        "age": {"type": "bucketized", "boundaries": [25, 35, 45, 55, 65]},
        "price": {"type": "numeric", "normalize": "log"},
        "score": {"type": "numeric"},
    },
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, pd.DataFrame]:
    """A ``--data`` model directory (3 epochs), its model artifact, and new rows it never saw."""
    root = tmp_path_factory.mktemp("data_job")
    _table(np.random.default_rng(0), N).to_csv(root / "train.csv", index=False)
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    argv = ["--data", str(root / "train.csv"), "--schema", str(root / "schema.json"), "--model-dir", str(root / "m")]
    assert cli(["train", *argv, "--epochs", "3", "--no-progress", "--threads", "1"]) == 0
    assert cli(["export", str(root / "m"), str(root / "artifact"), "--model"]) == 0
    new = _table(np.random.default_rng(1), 700).drop(columns=["clicked"])
    return root / "m", root / "artifact", new


def _estimator_predictions(model_dir: Path, rows: pd.DataFrame, batch: int) -> np.ndarray:
    """What the Estimator's own ``predict`` gives for ``rows``, with the job's model and transform."""
    parts = parts_of(model_dir)
    spec = est.EmbeddingConfigSpec(feature_columns=parts.columns, optimization_parameters=est.AdagradParameters(0.1))
    e = est.Estimator(parts.model, spec, model_dir, predictions_fn=parts.predictions_fn, progress=False)
    assert parts.transform is not None
    features = parts.transform.apply(as_columns(rows))
    n = len(rows)

    def input_fn() -> Iterator[dict[str, Any]]:
        for s in range(0, n, batch):
            r = np.arange(s, min(n, s + batch))
            f: dict[str, Any] = {k: v[r] for k, v in features.items() if k != "numeric"}
            f["numeric"] = features["numeric"][torch.from_numpy(r)]
            yield f

    try:
        return np.concatenate(list(e.predict(input_fn, yield_single_examples=False)))
    finally:
        e.embedding.close()


def test_load_model_and_predict_score_new_rows_as_the_estimator_does(
    trained: tuple[Path, Path, pd.DataFrame], tmp_path: Path
) -> None:
    model_dir, artifact, new = trained
    expected = _estimator_predictions(model_dir, new, 256)
    assert expected.shape == (len(new),) and ((expected > 0) & (expected < 1)).all()
    model = et.load_model(artifact)
    assert model.task == "binary" and model.step > 0
    np.testing.assert_array_equal(model.predict(new, batch_size=256), expected)  # a DataFrame
    as_dict = {c: new[c].tolist() for c in new.columns}  # plain lists, as a JSON client sends them
    np.testing.assert_array_equal(model.predict(as_dict, batch_size=256), expected)
    # the CLI, from a CSV and from a Parquet file, into a CSV (and from the model directory itself)
    new.to_csv(tmp_path / "new.csv", index=False)
    new.to_parquet(tmp_path / "new.parquet")
    for source, model_path in (("new.csv", artifact), ("new.parquet", artifact), ("new.csv", model_dir)):
        out = tmp_path / f"{source}.{model_path.name}.out.csv"
        argv = ["predict", str(model_path), "--input", str(tmp_path / source), "--output", str(out)]
        assert cli([*argv, "--batch-size", "256", "--no-progress"]) == 0
        got = pd.read_csv(out, dtype={"prediction": str})["prediction"].map(float).to_numpy(np.float32)
        np.testing.assert_array_equal(got, expected)


def test_a_rows_score_depends_on_its_batch_only_through_float32_rounding(
    trained: tuple[Path, Path, pd.DataFrame],
) -> None:
    """Bit for bit holds for the same batches (above). A row scored alone (as a one-row ``serve`` request) or in
    a batch of another size differs at most by the rounding of the dense part's float32 sums, whose order the CPU's
    matrix kernels choose by the batch's size and the row's place in it (docs/serving.md); nothing of another row
    reaches it."""
    _, artifact, new = trained
    model = et.load_model(artifact)
    reference = model.predict(new, batch_size=256)
    rows = new.iloc[:60]
    for size in (1, 2, 3, 7, 64):
        got = np.concatenate([model(rows.iloc[s : s + size]).numpy() for s in range(0, len(rows), size)])
        np.testing.assert_allclose(got, reference[: len(rows)], rtol=1e-5, atol=1e-6, err_msg=f"batches of {size}")
        # the same batches give the same bits, whichever rows surround them
        again = np.concatenate([model.predict(rows.iloc[s : s + size], batch_size=size) for s in range(0, 60, size)])
        np.testing.assert_array_equal(again, got)
    shuffled = rows.iloc[::-1]
    np.testing.assert_allclose(model.predict(shuffled)[::-1], reference[:60], rtol=1e-5, atol=1e-6)


def test_a_multi_valued_cell_reads_the_same_as_a_string_a_list_or_one_number(
    trained: tuple[Path, Path, pd.DataFrame],
) -> None:
    """A JSON client sends a multi-valued cell as a list; a CSV whose multi-valued column holds one number a row
    reads as numbers (with missing cells: floats). Each gives the values the joined string gives (they were read
    as no value at all before); a dict or a nested list is refused naming the column and the row."""
    _, artifact, new = trained
    model = et.load_model(artifact)
    rows = {c: new[c].tolist()[:3] for c in new.columns}
    rows["tags"] = ["t1|t7", "t3", ""]
    expected = model.predict(rows)
    as_lists = {**rows, "tags": [["t1", "t7"], ["t3"], []]}
    np.testing.assert_array_equal(model.predict(as_lists), expected)
    transform = RowTransform(separators=(("tags", "|"),))
    read = transform.apply({"tags": np.array([7.0, np.nan, 12.0, 2.5])})["tags"]  # integers with a missing cell
    assert read.tolist() == [["7"], [], ["12"], ["2.5"]]
    assert transform.apply({"tags": np.array([7, 12])})["tags"].tolist() == [["7"], ["12"]]
    assert transform.apply({"tags": np.array(["7|8", "12"])})["tags"].tolist() == [["7", "8"], ["12"]]
    for bad in ({"a": 1}, ["t1", ["t2"]]):
        with pytest.raises(ValueError, match=r"rows 0-2: the column .tags. of the input: row 1 holds"):
            model.predict({**rows, "tags": ["t1", bad, ""]})
    with pytest.raises(ValueError, match=r"feature 'country': row 1 holds \{'a': 1\}"):  # a single-valued column
        model.predict({**rows, "country": ["US", {"a": 1}, "FR"]})


def test_predict_never_replaces_a_file_it_did_not_write(
    trained: tuple[Path, Path, pd.DataFrame], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output``: a new file, or a predictions CSV of an earlier run, is written whole; the input, a folder or
    another existing file is refused before anything is scored (``--overwrite`` replaces the last, never the
    input), and the refused file keeps its bytes."""
    _, artifact, new = trained
    new.iloc[:5].to_csv(tmp_path / "rows.csv", index=False)
    mine = tmp_path / "notes.csv"
    mine.write_text("my,own\n1,2\n")

    def predict(output: Path, *extra: str) -> int:
        argv = ["predict", str(artifact), "--input", str(tmp_path / "rows.csv"), "--output", str(output)]
        return cli([*argv, "--no-progress", *extra])

    out = tmp_path / "preds.csv"
    assert predict(out) == 0 and predict(out) == 0  # a predictions CSV is replaced: reruns just work
    assert out.read_text().splitlines()[0] == "prediction" and len(out.read_text().splitlines()) == 6
    capsys.readouterr()
    for target, reason in (
        (mine, "exists and is not a predictions CSV"),
        (tmp_path / "rows.csv", "is an input of this command"),
        (artifact / "model.json", "is inside"),
        (tmp_path, "is a folder"),
        (tmp_path / "no" / "p.csv", "does not exist"),
    ):
        before = (tmp_path / "rows.csv").read_bytes()
        assert predict(target) == 2
        err = capsys.readouterr().err.strip()
        assert reason in err and len(err.splitlines()) == 1, err
        assert mine.read_text() == "my,own\n1,2\n" and (tmp_path / "rows.csv").read_bytes() == before
    assert predict(tmp_path / "rows.csv", "--overwrite") == 2  # never the input
    assert predict(mine, "--overwrite") == 0 and mine.read_text().startswith("prediction\n")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".embtables-tmp")]


def test_a_damaged_dense_program_is_one_line(trained: tuple[Path, Path, pd.DataFrame], tmp_path: Path) -> None:
    """A ``dense.pt2`` cut short: ``predict`` exits 2 with one line on the process's stderr (torch's own warning
    with a traceback, which it logs before raising, is kept quiet)."""
    import shutil

    _, artifact, new = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(artifact, damaged)
    program = (damaged / "dense.pt2").read_bytes()
    (damaged / "dense.pt2").write_bytes(program[: len(program) // 2])
    new.iloc[:3].to_csv(tmp_path / "rows.csv", index=False)
    # a process of its own: in this one pytest captures torch's log records instead of printing them
    argv = ["predict", str(damaged), "--input", str(tmp_path / "rows.csv")]
    cmd = [sys.executable, "-c", f"import sys; from embtables.__main__ import main; sys.exit(main({argv!r}))"]
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=120)
    err = out.stderr.strip()
    assert out.returncode == 2 and "dense.pt2 is missing or unreadable" in err and len(err.splitlines()) == 1, err


def test_serves_update_failures_are_logged_once_a_reason_and_their_end_too(
    trained: tuple[Path, Path, pd.DataFrame], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``embtables serve``'s update thread, polling every 20 ms while the artifact's tables are gone: one warning
    for the reason (not one a poll), health's ``last_update_error`` says it; tables back: one line saying updates
    work again, and the reason cleared. The served step answers throughout."""
    import shutil

    from embtables.cli.serve import Service

    _, artifact, new = trained
    served = tmp_path / "served"
    shutil.copytree(artifact, served)
    service = Service(et.load_model(served), poll=0.02)
    caplog.set_level("INFO", logger="embtables")
    service.start()
    try:
        (served / "tables").rename(tmp_path / "aside")
        deadline = time.monotonic() + 30
        while service.update_errors < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.update_errors >= 10 and "unreadable" in (service.health()["last_update_error"] or "")
        assert len(service.predict({"rows": {c: new[c].tolist()[:2] for c in new.columns}})["predictions"]) == 2
        (tmp_path / "aside").rename(served / "tables")
        while service.health()["last_update_error"] is not None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        service.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "embtables.serve"]
    assert sum("update failed" in m for m in lines) == 1, lines
    assert any("updates work again after" in m for m in lines), lines
    assert service.health()["last_update_error"] is None


def test_an_artifact_in_half_precision_scores_close_to_float32(trained: tuple[Path, Path, pd.DataFrame]) -> None:
    model_dir, artifact, new = trained
    half = artifact.parent / "artifact-bf16"
    assert cli(["export", str(model_dir), str(half), "--model", "--dtype", "bfloat16"]) == 0
    full = et.load_model(artifact).predict(new)
    got = et.load_model(half).predict(new)
    assert not np.array_equal(got, full)  # the tables really are bf16
    np.testing.assert_allclose(got, full, atol=2e-2)


def test_mistakes_are_one_line_errors_and_change_nothing(
    trained: tuple[Path, Path, pd.DataFrame], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir, artifact, new = trained
    new.drop(columns=["price"]).to_csv(tmp_path / "no_price.csv", index=False)
    assert cli(["predict", str(artifact), "--input", str(tmp_path / "no_price.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no column 'price'" in err and len(err.splitlines()) == 1
    bad = new.copy()
    bad["score"] = "many"
    bad.to_csv(tmp_path / "bad.csv", index=False)
    assert cli(["predict", str(artifact), "--input", str(tmp_path / "bad.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "numeric feature 'score'" in err and "not numeric" in err and len(err.splitlines()) == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert cli(["export", str(model_dir), str(foreign), "--model"]) == 2
    assert "not written by export_model" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["keep.txt"]
    (tmp_path / "plain").mkdir()
    assert cli(["export", str(tmp_path / "plain"), str(tmp_path / "out"), "--model"]) == 2
    assert "no scoring.json" in capsys.readouterr().err
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(artifact, broken)
    doc = json.loads((broken / "model.json").read_text())
    doc["columns"][0]["categorical_column"]["type"] = "mystery"
    (broken / "model.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="column 0 is malformed"):
        et.load_model(broken)


class _Own(nn.Module):
    """A dense model of one's own that reads a tensor feature beside the activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(16 + 2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, activations: dict[str, torch.Tensor], features: Any) -> torch.Tensor:
        x = torch.cat([activations["user_embedding"], activations["item_embedding"], features["dense"]], 1)
        return self.mlp(x).squeeze(1)


def _own_data(seed: int, n: int = 800) -> tuple[dict[str, Any], np.ndarray]:
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 40, n), rng.integers(0, 50, n)
    dense = torch.from_numpy(rng.normal(size=(n, 2)).astype(np.float32))
    y = ((users % 3 == 0) ^ (items % 2 == 0)).astype(np.float32)
    return {"user": users, "item": [f"i{v}" for v in items], "dense": dense}, y


class _Branching(nn.Module):
    """A dense model whose path depends on its input's values: no program can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 1)

    def forward(self, activations: dict[str, torch.Tensor], features: Any) -> torch.Tensor:
        x = activations["user_embedding"]
        if x.sum() > 0:
            x = x * 2
        return self.out(x).squeeze(1)


def test_a_model_that_cannot_be_a_program_is_one_error_and_nothing_printed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """torch prints the graph of a failed export (several times) and logs a warning per guard before it raises:
    ``export_model`` keeps that quiet and raises one ValueError that says why, writing nothing."""
    cols = [est.embedding_column(est.categorical_column_with_identity("user", 40), 8)]
    spec = est.EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=est.AdagradParameters(0.3))
    e = est.Estimator(
        _Branching(), spec, tmp_path / "m", loss_fn=nn.functional.binary_cross_entropy_with_logits,
        predictions_fn=torch.sigmoid, progress=False,
    )  # fmt: skip
    users = np.arange(40)
    e.train(lambda: iter([({"user": users}, (users % 2).astype(np.float32))]), steps=1)
    capfd.readouterr()
    with pytest.raises(ValueError, match="cannot be exported as a program"):
        e.export_model(tmp_path / "artifact", {"user": users[:4]}, task="binary")
    assert capfd.readouterr().err == "" and not (tmp_path / "artifact").exists()
    e.embedding.close()


def test_an_estimator_of_ones_own_exports_and_an_incremental_step_is_taken_in(tmp_path: Path) -> None:
    cols = [
        est.embedding_column(est.categorical_column_with_identity("user", 4000), 8),  # few rows change: deltas
        est.embedding_column(est.categorical_column_with_hash_bucket("item", 4096), 8, combiner="sum"),
    ]
    spec = est.EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=est.AdagradParameters(0.3))
    e = est.Estimator(
        _Own(), spec, tmp_path / "m", loss_fn=nn.functional.binary_cross_entropy_with_logits,
        predictions_fn=torch.sigmoid, progress=False, incremental_checkpoints=True,
    )  # fmt: skip
    features, y = _own_data(0)

    def input_fn() -> Iterator[tuple[dict[str, Any], np.ndarray]]:
        for s in range(0, len(y), 100):
            yield {k: v[s : s + 100] for k, v in features.items()}, y[s : s + 100]

    new, _ = _own_data(1, 300)

    def predicted() -> np.ndarray:
        return np.concatenate(list(e.predict(lambda: iter([new]), yield_single_examples=False)))

    e.train(input_fn, steps=5)
    done = e.export_model(tmp_path / "artifact", new, task="binary")
    assert not done.incremental and done.step == 5
    served = et.load_model(tmp_path / "artifact")
    np.testing.assert_array_equal(served.predict(new, batch_size=300), predicted())
    before = served.predict(new, batch_size=300)
    as_json = {"user": new["user"].tolist(), "item": new["item"], "dense": new["dense"].tolist()}  # lists a row
    np.testing.assert_array_equal(served.predict(as_json, batch_size=300), before)
    e.train(input_fn, steps=3)
    done = e.export_model(tmp_path / "artifact", new, task="binary", incremental=True)
    assert done.incremental and done.step == 8
    assert sorted(p.name for p in (tmp_path / "artifact" / "tables").iterdir() if p.name.startswith("delta-"))
    np.testing.assert_array_equal(served.predict(new, batch_size=300), before)  # not taken in yet
    weights = tmp_path / "artifact" / "weights" / "step-0000000008.pt"
    kept = weights.read_bytes()
    weights.unlink()  # the step's dense weights missing: nothing is taken in, not even the tables' delta
    with pytest.raises(CheckpointError, match="weights of step 8 are missing"):
        served.update()
    assert served.step == 5
    np.testing.assert_array_equal(served.predict(new, batch_size=300), before)
    weights.write_bytes(kept)
    assert served.update() == 8
    np.testing.assert_array_equal(served.predict(new, batch_size=300), predicted())
    assert served.update() == 8  # nothing newer
    # a full export replacing it (not incremental) is taken in as well
    e.train(input_fn, steps=2)
    e.export_model(tmp_path / "artifact", new, task="binary")
    assert served.update() == 10
    np.testing.assert_array_equal(served.predict(new, batch_size=300), predicted())
    e.close()


def test_a_csvs_empty_string_cells_are_missing_values_not_the_string_nan() -> None:
    """pandas reads an empty cell of a string column as float NaN: the column must drop it (a missing value), as
    it drops '' and None, not hash the string 'nan' (a value of its own: still a value when written out)."""
    vocab = est.categorical_column_with_vocabulary_list("c", ["US", "FR"], num_oov_buckets=1)
    hashed = est.categorical_column_with_hash_bucket("c", 10)
    for column in (vocab, hashed):
        with_nan = column.ids({"c": np.array([np.nan, "FR", None, "XX"], dtype=object)})
        with_empty = column.ids({"c": np.array(["", "FR", "", "XX"], dtype=object)})
        np.testing.assert_array_equal(with_nan[0], with_empty[0])
        np.testing.assert_array_equal(with_nan[1], [0, 1, 0, 1])
        literal = column.ids({"c": np.array(["nan", "FR"], dtype=object)})
        np.testing.assert_array_equal(literal[1], [1, 1])


def _predict_with_estimator(model_dir: Path, batches: list[dict[str, Any]]) -> np.ndarray:
    """The Estimator's own ``predict`` over ``batches`` of prepared features, with the job's rebuilt model."""
    parts = parts_of(model_dir)
    spec = est.EmbeddingConfigSpec(feature_columns=parts.columns, optimization_parameters=est.AdagradParameters(0.1))
    e = est.Estimator(parts.model, spec, model_dir, predictions_fn=parts.predictions_fn, progress=False)
    try:
        return np.concatenate(list(e.predict(lambda: iter(batches), yield_single_examples=False)))
    finally:
        e.embedding.close()


def test_the_adult_job_exports_and_scores_raw_census_rows_as_it_evaluates_them(tmp_path: Path) -> None:
    from embtables.cli import adult
    from embtables.data.adult import load_adult

    argv = ["train", "--dataset", "adult", "--epochs", "1", "--no-peers", "--no-progress", "--model-dir"]
    assert cli([*argv, str(tmp_path / "m")]) == 0
    assert cli(["export", str(tmp_path / "m"), str(tmp_path / "artifact"), "--model"]) == 0  # finds m/model
    _, test = load_adult(None)
    rows = np.arange(0, 3000)
    raw = test.rows(rows)  # the census columns as the job reads them
    expected = _predict_with_estimator(
        tmp_path / "m" / "model",
        [next(adult._batches(test, rows[s : s + 1000], 1000, None))[0] for s in (0, 1000, 2000)],
    )
    model = et.load_model(tmp_path / "artifact")
    assert model.task == "binary"
    np.testing.assert_array_equal(model.predict(pd.DataFrame(raw), batch_size=1000), expected)


def test_the_movielens_job_exports_a_fold_and_scores_raw_ratings_as_it_evaluates_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from embtables.cli import movielens
    from embtables.data.movielens import load_movielens_100k

    argv = ["train", "--dataset", "movielens-100k", "--max-ratings", "3000", "--folds", "2", "--epochs", "1"]
    assert cli([*argv, "--no-progress", "--model-dir", str(tmp_path / "m")]) == 0
    assert cli(["export", str(tmp_path / "m"), str(tmp_path / "a"), "--model"]) == 2  # two folds: which one?
    assert "holds 2 models (fold0, fold1)" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "m" / "fold1"), str(tmp_path / "a"), "--model"]) == 0
    data = load_movielens_100k(None)
    rows = np.arange(500, 1500)
    prepared = {k: v[rows] for k, v in movielens.prepare(data).items() if k in movielens.DEFAULT_FIELDS}
    expected = _predict_with_estimator(tmp_path / "m" / "fold1", [prepared])
    raw = data.rows(rows)  # ages in years, release years, genres as tuples of names
    raw["genres"] = np.array(["|".join(g) for g in raw["genres"]], dtype=object)  # as a CSV holds them
    model = et.load_model(tmp_path / "a")
    assert model.task == "regression"
    got = model.predict(raw)
    np.testing.assert_array_equal(got, expected)
    assert ((got >= 1) & (got <= 5)).all()
    raw["genres"][0] = "Action|Space opera"
    with pytest.raises(ValueError, match="'genres' of the input: row 0 names 'Space opera'"):
        model.predict(raw)


def test_the_synthetic_dlrm_job_exports_and_scores_rows_of_ids_as_it_evaluates_them(tmp_path: Path) -> None:
    """The main job's model (a spec of dicts: the rows hold each feature's ids; the sequence feature's lengths
    reach the program as a tensor) scores as the Estimator's ``predict``, from lists and from "|"-joined strings."""
    import argparse

    from embtables.cli import dlrm

    argv = ["train", "--small", "--steps", "20", "--eval-every", "20", "--eval-size", "512", "--batch-size", "128"]
    assert cli([*argv, "--no-progress", "--threads", "1", "--model-dir", str(tmp_path / "m")]) == 0
    assert cli(["export", str(tmp_path / "m"), str(tmp_path / "a"), "--model"]) == 0
    data = dlrm._dataset(argparse.Namespace(small=True, seed=0))
    features, _ = data.batch(300, 3, split="eval")
    parts = parts_of(tmp_path / "m")
    e = est.Estimator(parts.model, dlrm.spec_for(data, 16, lambda: 0, None), tmp_path / "m",
                      predictions_fn=torch.sigmoid, progress=False)  # fmt: skip
    try:
        expected = np.concatenate(list(e.predict(lambda: iter([features]), yield_single_examples=False)))
    finally:
        e.embedding.close()
    lists = {}
    for name, ragged in features.items():
        splits = ragged.row_splits.tolist()
        lists[name] = [ragged.values[a:b].tolist() for a, b in itertools.pairwise(splits)]
    model = et.load_model(tmp_path / "a")
    np.testing.assert_array_equal(model.predict(lists), expected)
    joined = {name: ["|".join(map(str, row)) for row in rows] for name, rows in lists.items()}  # as a CSV holds them
    np.testing.assert_array_equal(model.predict(pd.DataFrame(joined)), expected)
