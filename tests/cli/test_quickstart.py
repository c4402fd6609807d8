"""The quickstart example (run in-process, few steps) and the synthetic CTR generator behind it."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import fast_child
import pytest
import torch

import embtables
from embtables.data import CategoricalFeature, SyntheticCTR, SyntheticCTRConfig

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


@pytest.fixture(scope="module")
def quickstart() -> ModuleType:
    """The quick job, ``embtables.cli.quickstart`` (``embtables quickstart``; examples/quickstart.py runs it)."""
    return importlib.import_module("embtables.cli.quickstart")


def test_the_example_script_and_the_cli_run_the_same_job(tmp_path: Path) -> None:
    for cmd in ([sys.executable, str(QUICKSTART)], [sys.executable, "-m", "embtables", "quickstart"]):
        out = fast_child.run([*cmd, "--steps", "30", "--threads", "1"], capture_output=True, text=True, cwd=tmp_path)
        assert "summary: training loss" in out.stdout, out.stderr[-2000:]


def _run(quickstart: ModuleType, *extra: str) -> int:
    # Keep the process's thread count: main() sets it, and later tests share the process.
    argv = ["--steps", "60", "--log-every", "20", "--eval-size", "1024", "--no-progress"]
    rc: int = quickstart.main([*argv, "--threads", str(torch.get_num_threads()), *extra])
    return rc


# ---------------------------------------------------------------------------------------------
# The quickstart
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl", "sgd"])
def test_quickstart_loss_falls(quickstart: ModuleType, capsys: pytest.CaptureFixture[str], optimizer: str) -> None:
    assert _run(quickstart, "--optimizer", optimizer) == 0
    out = capsys.readouterr().out
    assert f"quickstart: optimizer={optimizer} steps=60 batch=256 seed=0" in out
    assert "item 5000x16 <- ['item', 'item_history']" in out  # the shared table is reported
    assert re.search(r"^held-out before training: loss \d\.\d{4}  auc \d\.\d{4}  \(teacher", out, re.M)
    steps = re.findall(
        r"^step +(\d+)  loss (\d\.\d+)  held-out loss (\d\.\d+)  auc (\d\.\d+)  acc .* steps/s$", out, re.M
    )
    assert [int(s[0]) for s in steps] == [20, 40, 60]
    m = re.search(r"mean of first (\d+) steps (\d\.\d+) -> mean of last \1 steps (\d\.\d+)", out)
    assert m is not None, out
    assert float(m.group(3)) < float(m.group(2))
    m = re.search(r"held-out loss (\d\.\d+) -> (\d\.\d+) \(teacher (\d\.\d+)\)", out)
    assert m is not None, out
    before, after, teacher = map(float, m.groups())
    assert teacher < after < before
    assert re.search(r"^summary: 60 steps in [\d.]+ s \([\d.]+ steps/s\)$", out, re.M)
    assert out.rstrip().endswith("PASS: the loss fell.")


def test_quickstart_exits_nonzero_when_nothing_learns(
    quickstart: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quickstart, "make_optimizer", lambda name: embtables.SGD(learning_rate=0.0))
    assert _run(quickstart, "--dense-lr", "0") == 1
    assert "FAIL: the loss did not fall" in capsys.readouterr().out


def test_roc_auc_matches_pair_counting(quickstart: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (200,), generator=gen).float()  # many ties
    labels = (torch.rand(200, generator=gen) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    expected = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert quickstart.roc_auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert quickstart.roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert quickstart.roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])) == 0.5


# ---------------------------------------------------------------------------------------------
# The synthetic generator
# ---------------------------------------------------------------------------------------------
def _equal(
    a: tuple[dict[str, embtables.Ragged], torch.Tensor], b: tuple[dict[str, embtables.Ragged], torch.Tensor]
) -> bool:
    (fa, la), (fb, lb) = a, b
    return (
        fa.keys() == fb.keys()
        and torch.equal(la, lb)
        and all(torch.equal(fa[k].values, fb[k].values) and torch.equal(fa[k].row_splits, fb[k].row_splits) for k in fa)
    )


def test_generator_is_deterministic_for_a_seed() -> None:
    cfg = SyntheticCTRConfig(seed=3)
    first = list(SyntheticCTR(cfg).batches(64, 3))
    again = list(SyntheticCTR(cfg).batches(64, 3))
    assert all(_equal(a, b) for a, b in zip(first, again))
    # Random access gives the same batch as iteration, and each call of batches() starts afresh.
    data = SyntheticCTR(cfg)
    assert _equal(data.batch(64, 2), first[2])
    assert _equal(next(data.batches(64, 1)), first[0])
    assert _equal(next(data.batches(64, 1, start=1)), first[1])
    # Another seed, another batch index or the eval split give different data.
    assert not _equal(SyntheticCTR(SyntheticCTRConfig(seed=4)).batch(64, 0), first[0])
    assert not _equal(first[1], first[0])
    assert not _equal(data.batch(64, 0, split="eval"), first[0])
    # The teacher is part of the seed too.
    feats = first[0][0]
    assert torch.equal(SyntheticCTR(cfg).teacher_logits(feats), data.teacher_logits(feats))


def test_ids_are_ragged_within_vocabulary() -> None:
    data = SyntheticCTR()
    features, labels = data.batch(512, 0)
    assert labels.shape == (512,) and labels.dtype == torch.float32
    assert set(labels.unique().tolist()) <= {0.0, 1.0}
    for f in data.config.features:
        r = features[f.name]
        assert isinstance(r, embtables.Ragged) and r.values.dtype == torch.int64
        assert r.nrows == 512 and int(r.row_splits[0]) == 0 and int(r.row_splits[-1]) == r.values.numel()
        assert int(r.values.min()) >= 0 and int(r.values.max()) < f.vocabulary_size
        lengths = r.lengths()
        assert int(lengths.min()) >= f.min_ids and int(lengths.max()) <= f.max_ids
        if f.is_multi_hot:
            assert lengths.unique().numel() > 1, f"{f.name}: multi-hot lengths should vary"
    assert int(features["tags"].lengths().min()) == 0  # some samples have no tags


def test_ids_are_zipf_like() -> None:
    data = SyntheticCTR()
    features, _ = data.batch(4096, 0)
    counts = torch.bincount(features["item"].values, minlength=5_000).float()
    assert float(counts.max()) > 50 * float(counts.mean())  # a few hot ids
    assert int((counts > 0).sum()) > 500  # and a long tail
    assert int(counts.argmax()) != 0  # hot ids are scattered over the vocabulary


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_label_rate_is_balanced_enough(seed: int) -> None:
    _, labels = SyntheticCTR(SyntheticCTRConfig(seed=seed)).batch(4096, 0)
    assert 0.05 < float(labels.mean()) < 0.95


def test_teacher_beats_a_constant_predictor() -> None:
    data = SyntheticCTR()
    features, labels = data.batch(4096, 0, split="eval")
    logits = data.teacher_logits(features)
    assert logits.shape == (4096,)
    teacher = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    p = labels.mean()
    constant = -(p * p.log() + (1 - p) * (1 - p).log())
    assert float(teacher) < float(constant) - 0.1


def test_feature_configs_match_the_batches() -> None:
    data = SyntheticCTR()
    configs = data.feature_configs(dim=4, optimizer=embtables.SGD(0.1))
    features, _ = data.batch(32, 0)
    assert configs.keys() == features.keys()
    for f in data.config.features:
        table = configs[f.name].table
        assert table.name == f.table_name and table.vocabulary_size == f.vocabulary_size and table.dim == 4
    assert configs["item"].table is configs["item_history"].table  # one shared table
    assert len({id(c.table) for c in configs.values()}) == len(data.config.table_names) == 4

    emb = embtables.DistributedEmbedding(configs)
    assert emb.resolved_config.table_names == ("category", "item", "tags", "user")
    acts = emb(features)
    assert {k: tuple(v.shape) for k, v in acts.items()} == {k: (32, 4) for k in features}
    # Tables are seeded from config.seed: the same config gives the same initial tables.
    again = embtables.DistributedEmbedding(SyntheticCTR().feature_configs(dim=4, optimizer=embtables.SGD(0.1)))
    assert all(torch.equal(emb.embedding_tables[k], t) for k, t in again.embedding_tables.items())


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="sharing table 'x' must have the same vocabulary_size"):
        SyntheticCTRConfig(
            features=(CategoricalFeature("a", 10, table="x"), CategoricalFeature("b", 11, table="x")),
            interactions=(),
        )
    with pytest.raises(ValueError, match="interaction must be a pair of feature names"):
        SyntheticCTRConfig(interactions=(("user", "nope"),))
    with pytest.raises(ValueError, match="min_ids"):
        CategoricalFeature("a", 10, min_ids=3, max_ids=2)
    with pytest.raises(ValueError, match="feature names must be unique"):
        SyntheticCTRConfig(features=(CategoricalFeature("a", 10), CategoricalFeature("a", 10)), interactions=())
    with pytest.raises(ValueError, match="split"):
        SyntheticCTR().batch(4, 0, split="test")
    cfg = SyntheticCTRConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
