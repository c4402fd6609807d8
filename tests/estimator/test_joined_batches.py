"""Batches converted together (``estimator/batches.py``): the same engine inputs and labels as one batch
at a time, the same trained bits, errors at their own step, and the column fast paths (padded integer
arrays, 1- and 2-character strings) equal to the general conversion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from statecheck import assert_same
from torch import nn

import embtables as et
from embtables import estimator as est
from embtables.estimator import batches as batches_mod
from embtables.estimator.batches import END, BatchReader, as_labels
from embtables.estimator.raw_inputs import flatten_values

SIZES = [37, 37, 37, 20, 37, 37, 37, 37, 37, 37, 5]  # uneven, over one join group (8)


def _columns() -> list[Any]:
    return [
        est.embedding_column(est.categorical_column_with_identity("user", 50), 4),
        est.embedding_column(est.categorical_column_with_vocabulary_list("g", ["M", "F", "X"]), 3),
        est.embedding_column(est.categorical_column_with_vocabulary_list("cc", ["us", "fr", "de", "x"]), 3),
        est.embedding_column(est.categorical_column_with_hash_bucket("city", 40), 3, combiner="sum"),
        est.embedding_column(est.categorical_column_with_identity("tags", 12), 5, combiner="sqrtn"),
        est.embedding_column(
            est.weighted_categorical_column(est.categorical_column_with_identity("seen", 30), "seen_w"), 2
        ),
        est.embedding_column(est.bucketized_column(est.numeric_column("age"), [18.0, 30.0, 50.0]), 2),
    ]


def _spec() -> est.EmbeddingConfigSpec:
    return est.EmbeddingConfigSpec(feature_columns=_columns(), optimization_parameters=est.AdagradParameters(0.2))


def _batches(seed: int = 0, sizes: list[int] = SIZES) -> list[tuple[dict[str, Any], np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        tags = rng.integers(0, 12, (n, 4)).astype(np.int16)
        tags[rng.random((n, 4)) < 0.4] = -1  # padding anywhere in a row, some rows empty
        features = {
            "user": rng.integers(0, 50, n).astype(np.int32),
            "g": rng.choice(np.array(["M", "F", "X"]), n),
            "cc": rng.choice(np.array(["us", "fr", "de", "x"]), n),
            "city": rng.choice(np.array(["paris", "rome", "oslo", "lima"]), n),
            "tags": tags,
            "seen": rng.integers(0, 30, (n, 2)),
            "seen_w": rng.random((n, 2)).astype(np.float32),
            "age": rng.uniform(10, 70, n),
            "unused": rng.normal(size=(n, 3)),  # read by the dense model only
        }
        out.append((features, rng.normal(size=n).astype(np.float32)))
    return out


def _bags(x: Any) -> tuple[list[Any], list[int]]:
    """(values, row splits) of dense ids [B] or a Ragged, to compare either form."""
    if isinstance(x, et.Ragged):
        return x.values.tolist(), x.row_splits.tolist()
    return x.tolist(), list(range(x.numel() + 1))


def _read_all(reader: BatchReader) -> list[Any]:
    out = []
    while True:
        item, prepared, error = reader.next()
        if item is END:
            return out
        out.append((item, prepared, error))


def test_joined_conversion_gives_each_batch_what_it_gets_alone() -> None:
    spec = _spec()
    data = _batches()
    joined = _read_all(BatchReader(iter(data), spec.engine_inputs, torch.device("cpu"), True, spec.raw_keys()))
    alone = _read_all(BatchReader(iter(data), spec.engine_inputs, torch.device("cpu"), True, None))
    assert len(joined) == len(alone) == len(data)
    for (item_j, got, err_j), (item_a, want, err_a), (features, y) in zip(joined, alone, data):
        assert item_j is item_a and err_j is None and err_a is None and got is not None and want is not None
        assert got.features is features
        assert torch.equal(got.labels, want.labels) and got.labels.numel() == len(y)
        assert got.ids.keys() == want.ids.keys() and got.weights.keys() == want.weights.keys()
        for name in want.ids:
            assert _bags(got.ids[name]) == _bags(want.ids[name]), name
        for name, w in want.weights.items():
            if w is None:
                assert got.weights[name] is None
            else:
                assert _bags(got.weights[name]) == _bags(w), name


def _estimator(model_dir: Path, **kw: Any) -> est.Estimator:
    torch.manual_seed(0)
    width = 4 + 3 + 3 + 3 + 5 + 2 + 2

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(width + 3, 1)

        def forward(self, acts: dict[str, torch.Tensor], features: Any) -> torch.Tensor:
            dense = torch.as_tensor(features["unused"], dtype=torch.float32)
            return self.out(torch.cat([acts[k] for k in sorted(acts)] + [dense], 1)).squeeze(1)

    return est.Estimator(
        Model(),
        _spec(),
        model_dir,
        dense_optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        loss_fn=nn.functional.mse_loss,
        progress=False,
        **kw,
    )


def _state(e: est.Estimator) -> dict[str, torch.Tensor]:
    out = {f"dense/{k}": v.clone() for k, v in e.model.state_dict().items()}
    out.update({k: v.clone() for k, v in e.embedding.state_dict().items()})
    return out


@pytest.mark.parametrize("prefetch", [0, 1])
def test_joined_batches_train_the_same_bits_as_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    data = _batches()
    states = []
    for joint in (1, batches_mod.JOINT_BATCHES):
        monkeypatch.setattr(batches_mod, "JOINT_BATCHES", joint)
        e = _estimator(tmp_path / f"j{joint}", input_prefetch=prefetch)
        e.train(lambda: iter(data))
        assert e.global_step == len(data)
        states.append(_state(e))
        e.close()
    assert_same(states[0], states[1])


def test_a_bad_batch_in_a_joined_group_is_refused_at_its_own_step(tmp_path: Path) -> None:
    data = _batches()
    bad = ({**data[4][0], "user": np.full(len(data[4][1]), 99, dtype=np.int32)}, data[4][1])
    reference = _estimator(tmp_path / "ref")
    reference.train(lambda: iter(data[:4]))
    e = _estimator(tmp_path / "bad")
    with pytest.raises(ValueError, match="outside"):
        e.train(lambda: iter([*data[:4], bad, *data[5:]]))
    assert e.global_step == 4
    assert_same(_state(reference), _state(e))
    nan_labels = (data[2][0], np.full(len(data[2][1]), np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        e.train(lambda: iter([*data[:2], nan_labels, *data[3:]]))
    assert e.global_step == 6

    def broken() -> Any:
        yield from data[:3]
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="disk went away"):
        e.train(broken)
    assert e.global_step == 9
    e.close()


def test_inputs_that_cannot_be_joined_are_read_one_batch_at_a_time() -> None:
    spec = _spec()
    read = []

    def lists() -> Any:
        for i, (features, y) in enumerate(_batches(sizes=[4, 4, 4])):
            read.append(i)
            yield {**features, "tags": [list(r[r >= 0]) for r in features["tags"]]}, y

    reader = BatchReader(lists(), spec.engine_inputs, torch.device("cpu"), True, spec.raw_keys())
    for step in range(3):
        _, prepared, error = reader.next()
        assert prepared is not None and error is None
        assert read == list(range(step + 1))  # nothing read ahead
    assert reader.next()[0] is END and reader.next()[0] is END
    # a feature the columns read that is missing: refused at its batch, with the usual message
    data = _batches(sizes=[4, 4])
    missing = ({k: v for k, v in data[1][0].items() if k != "g"}, data[1][1])
    reader = BatchReader(iter([data[0], missing]), spec.engine_inputs, torch.device("cpu"), True, spec.raw_keys())
    assert reader.next()[2] is None
    _, prepared, error = reader.next()
    assert prepared is None and isinstance(error, ValueError) and "no feature 'g'" in str(error)


def test_padded_integer_ids_equal_the_general_conversion() -> None:
    rng = np.random.default_rng(1)
    col = est.categorical_column_with_identity("t", 9)
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16):
        for shape in ((6,), (6, 1), (6, 3), (5, 40), (1, 1)):
            x = rng.integers(0, 9, shape).astype(dtype)
            if np.dtype(dtype).kind == "i" and len(shape) == 2:
                x[rng.random(shape) < 0.5] = -1
            ids, lengths, _ = col.ids({"t": x})
            values, want_lengths = flatten_values(x, "t")
            keep = values != -1 if values.dtype.kind == "i" else np.ones(len(values), bool)
            assert ids.dtype == np.int64 and lengths.dtype == np.int64
            assert ids.tolist() == values[keep].astype(np.int64).tolist(), (dtype, shape)
            split = np.repeat(np.arange(len(want_lengths)), want_lengths)
            assert lengths.tolist() == np.bincount(split[keep], minlength=len(want_lengths)).tolist()
    with pytest.raises(ValueError, match="outside"):
        col.ids({"t": np.array([[1, 9], [2, -1]])})
    with pytest.raises(ValueError, match="outside"):
        col.ids({"t": np.array([[1, -2]])})
    mapped = est.categorical_column_with_identity("t", 9, default_value=0)
    assert mapped.ids({"t": np.array([[1, 12]])})[0].tolist() == [1, 0]


@pytest.mark.parametrize("width", [1, 2])
def test_short_strings_look_up_as_their_codes_like_the_general_path(width: int) -> None:
    vocab = ["M", "F", "Zz", "é", "ab", "longer"]  # entries longer than the array's width never match
    col = est.categorical_column_with_vocabulary_list("s", vocab)
    rng = np.random.default_rng(width)
    present = [v for v in vocab if len(v) <= width]
    x = rng.choice(np.array(present, dtype=f"<U{width}"), 50)
    ids, lengths, _ = col.ids({"s": x})
    assert ids.tolist() == [vocab.index(v) for v in x.tolist()] and lengths.tolist() == [1] * 50
    # out of vocabulary, missing (''), big-endian and non-contiguous arrays take the general path
    for odd in (np.array(["M", "q", "F"], dtype=f"<U{width}"), np.array(["M", "", "F"], dtype=f"<U{width}")):
        got = col.ids({"s": odd})
        general = col.ids({"s": list(odd.tolist())})
        assert got[0].tolist() == general[0].tolist() and got[1].tolist() == general[1].tolist()
    assert col.ids({"s": x.astype(f">U{width}")})[0].tolist() == ids.tolist()
    assert col.ids({"s": np.repeat(x, 2)[::2]})[0].tolist() == ids.tolist()
    ints = est.categorical_column_with_vocabulary_list("n", [10, 20])
    assert ints.ids({"n": np.array(["10"], dtype="<U2")})[0].tolist() == [-1]  # strings are not the int 10


def test_labels_are_checked_with_one_sum_and_exactly_when_it_overflows() -> None:
    big = np.full(4, 3e38, dtype=np.float32)  # finite, but the float32 sum overflows
    assert as_labels(big, torch.device("cpu")).tolist() == big.tolist()
    assert as_labels(torch.from_numpy(big), torch.device("cpu")).tolist() == big.tolist()
    for bad in (np.array([1.0, np.nan], np.float32), np.array([np.inf, -np.inf], np.float32)):
        with pytest.raises(ValueError, match="NaN or Inf"):
            as_labels(bad, torch.device("cpu"))
        with pytest.raises(ValueError, match="NaN or Inf"):
            as_labels(torch.from_numpy(bad), torch.device("cpu"))
