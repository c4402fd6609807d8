"""What the command line shows (issue 39, item 10): ``inspect`` in aligned columns with slots, placement
and a dynamic table's policy; ``repr(ServingEmbedding)``; ``embtables bench --help`` with its own usage
and the list of the other benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import fast_child
import pytest
import torch

import embtables as et
from embtables.__main__ import main as cli


def _checkpoint(tmp_path: Path) -> Path:
    plain = et.TableConfig(40, 4, name="category", optimizer=et.SGD(0.1))
    users = et.TableConfig(
        1000,
        8,
        name="user_table_with_a_long_name",
        optimizer=et.Adam(0.01),
        dynamic=et.DynamicVocabulary(admit_after=2),
    )
    emb = et.DistributedEmbedding({"c": et.FeatureConfig(plain), "u": et.FeatureConfig(users)})
    out = emb({"c": torch.tensor([1, 2]), "u": torch.tensor([10**12, 7])})
    emb.apply_gradients({k: torch.ones_like(v) for k, v in out.items()})
    return Path(emb.save(tmp_path / "ckpt"))


def test_inspect_aligns_its_columns_and_shows_a_dynamic_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _checkpoint(tmp_path)
    assert cli(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["table"])
    rows = [line for line in lines if line.split()[:1] in (["category"], ["user_table_with_a_long_name"])]
    assert len(rows) == 2
    for word in ("optimizer", "slots", "placement", "dynamic"):  # every row's cell starts under its heading
        at = header.index(word)
        assert all(row[at - 1] == " " and row[at] != " " for row in rows), (word, header, rows)
    category, user = rows
    assert "SGD" in category and "[]" not in category and category.rstrip().endswith("-")
    assert "momenta, velocities" in user and "admit_after=2" in user and "eviction=lru" in user


def test_serving_embedding_says_what_it_serves(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    et.export(path, tmp_path / "serving", dtype="int8")
    served = et.ServingEmbedding.load(tmp_path / "serving")
    text = repr(served)
    assert text.startswith("ServingEmbedding(") and "dtype=int8" in text and "mmap=False" in text
    assert "category: 40 x 4" in text and "user_table_with_a_long_name: 1000 x 8 dynamic" in text
    assert "features=[c, u]" in text


def test_bench_help_has_its_own_usage_and_lists_the_other_benchmarks() -> None:
    out = fast_child.run([sys.executable, "-m", "embtables", "bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: embtables bench")
    assert "python3 benchmarks/run.py --" not in out.stdout and "will be added" not in out.stdout
    for name in ("latency", "sharded", "estimator", "checkpoint", "movielens", "extra-optimizers", "noacc",
                 "dynamic", "gpu"):  # fmt: skip
        assert f"embtables bench {name}" in out.stdout, name


def test_make_demo_keeps_what_it_prints_paths_to() -> None:
    """`make demo` trains into a model directory of its own (not a temporary one removed at exit), which git
    ignores, so the curves and checkpoint it names stay; the job's `--model-dir` path is what it prints."""
    root = Path(__file__).resolve().parents[2]
    recipe = (root / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "-m embtables train --model-dir demo_out" in recipe, recipe
    assert "demo_out/" in (root / ".gitignore").read_text().splitlines()
