"""Bad inputs, gradients, call orders and checkpoints (spec §2.2, 4.3, 10.5, 10.6).

Every bad case must: raise the documented exception type; name the feature or table and the
offending value in the message; leave every table and slot bit-for-bit unchanged; and leave the
module usable (a valid step afterwards works).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from embtables import (
    Adagrad,
    DistributedEmbedding,
    FeatureConfig,
    Ragged,
    TableConfig,
    TruncatedNormal,
)

Batch = tuple[dict[str, Any], dict[str, Any] | None]


# ---------------------------------------------------------------------------------------------
# The module under test: table "ta" (V=10, D=4) shared by a pooled feature with weights and a
# sequence feature (M=3); table "tb" (V=6, D=3) for a dense-input feature with
# validate_weights_and_indices=False. Adagrad everywhere.
# ---------------------------------------------------------------------------------------------
def make_emb(learning_rate: float | Callable[[], float] = 0.1) -> DistributedEmbedding:
    ta = TableConfig(10, 4, name="ta", initializer=TruncatedNormal(stddev=0.1, seed=0))
    tb = TableConfig(6, 3, name="tb", initializer=TruncatedNormal(stddev=0.1, seed=1))
    config = {
        "pooled": FeatureConfig(ta),
        "seq": FeatureConfig(ta, max_sequence_length=3),
        "dense": FeatureConfig(tb, validate_weights_and_indices=False),
    }
    return DistributedEmbedding(config, optimizer=Adagrad(learning_rate))


def ragged_f32(rows: Sequence[Sequence[float]]) -> Ragged:
    return Ragged.from_lists(rows, dtype=torch.float32)


def valid_batch() -> Batch:
    features = {
        "pooled": Ragged.from_lists([[1, 2], [3]]),
        "seq": Ragged.from_lists([[4, 5, 6, 7], [8]]),
        "dense": torch.tensor([0, 1]),
    }
    weights = {"pooled": ragged_f32([[1.0, 2.0], [0.5]]), "seq": None, "dense": None}
    return features, weights


def sparse(indices: list[list[int]], values: list[Any], shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor(indices).T, torch.tensor(values, dtype=dtype), shape, check_invariants=True
    )


def ones_like_all(acts: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.ones_like(v) for k, v in acts.items()}


def snapshot(emb: DistributedEmbedding) -> dict[str, Tensor]:
    """Clones of every table and slot, keyed "<table>" and "<table>/<slot>"."""
    out = {name: t.detach().clone() for name, t in emb.embedding_tables.items()}
    for name, slots in emb.slot_variables.items():
        out.update({f"{name}/{slot}": t.detach().clone() for slot, t in slots.items()})
    return out


def assert_unchanged(emb: DistributedEmbedding, before: dict[str, Tensor]) -> None:
    after = snapshot(emb)
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} changed after a rejected call"


def assert_valid_step_works(emb: DistributedEmbedding) -> None:
    """A valid training step still runs and updates both tables and the shared table's slot."""
    before = snapshot(emb)
    features, weights = valid_batch()
    acts = emb(features, weights)
    assert tuple(acts["pooled"].shape) == (2, 4)
    assert tuple(acts["seq"].shape) == (2, 3, 4)
    assert tuple(acts["dense"].shape) == (2, 3)
    emb.apply_gradients(ones_like_all(acts))
    after = snapshot(emb)
    for key in ("ta", "tb", "ta/accumulators", "tb/accumulators"):
        assert not torch.equal(after[key], before[key]), f"{key} did not change in a valid step"


class FakeKJT:
    """Minimal duck-typed TorchRec KeyedJaggedTensor: key-major values with per-key lengths [stride]."""

    def __init__(self, rows_per_key: dict[str, list[list[int]]], weights: dict[str, list[list[float]]] | None = None):
        self._keys = list(rows_per_key)
        strides = {len(rows) for rows in rows_per_key.values()}
        assert len(strides) == 1, "every key needs the same batch size"
        self._stride = strides.pop()
        self._values = torch.tensor([v for rows in rows_per_key.values() for r in rows for v in r], dtype=torch.int64)
        self._lengths = torch.tensor([len(r) for rows in rows_per_key.values() for r in rows], dtype=torch.int64)
        self._weights = (
            None
            if weights is None
            else torch.tensor([v for k in self._keys for r in weights[k] for v in r], dtype=torch.float32)
        )

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def stride(self) -> int:
        return self._stride


# ---------------------------------------------------------------------------------------------
# Forward-time (enqueue) errors.
# ---------------------------------------------------------------------------------------------
def _with(feature: str, x: Any, w: Any = "keep") -> Callable[[], Batch]:
    """A valid batch with feature ``feature`` replaced by ids ``x`` (and weights ``w`` unless 'keep')."""

    def build() -> Batch:
        features, weights = valid_batch()
        features[feature] = x
        assert weights is not None
        if w != "keep":
            weights[feature] = w
        return features, weights

    return build


def _weights_none(build: Callable[[], Batch]) -> Callable[[], Batch]:
    def wrapped() -> Batch:
        features, _ = build()
        return features, None

    return wrapped


def _drop_key(key: str) -> Callable[[], Batch]:
    def build() -> Batch:
        features, _ = valid_batch()
        del features[key]
        return features, None

    return build


def _extra_key() -> Batch:
    features, _ = valid_batch()
    features["extra"] = torch.tensor([1, 2])
    return features, None


def _list_instead_of_dict() -> Batch:
    features, _ = valid_batch()
    return [features["dense"], features["pooled"], features["seq"]], None  # type: ignore[return-value]


def _weights_missing_key() -> Batch:
    features, weights = valid_batch()
    assert weights is not None
    del weights["seq"]
    return features, weights


FORWARD_CASES: list[tuple[str, Callable[[], Batch], type[Exception] | tuple[type[Exception], ...], str]] = [
    (
        "id-too-big-ragged",
        _with("pooled", Ragged.from_lists([[1, 12], [3]])),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*\b12\b.*\[0, 10\)",
    ),
    (
        "id-too-big-sparse",
        _weights_none(_with("pooled", sparse([[0, 0], [0, 1], [1, 0]], [1, 2, 11], (2, 3), torch.int64))),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*\b11\b.*\[0, 10\)",
    ),
    (
        "id-too-big-dense",
        _with("dense", torch.tensor([0, 6])),
        ValueError,
        r"feature 'dense'.*table 'tb'.*\b6\b.*\[0, 6\)",
    ),
    (
        "id-too-big-2d-dense",
        _with("dense", torch.tensor([[0, 1], [2, 100]])),
        ValueError,
        r"feature 'dense'.*table 'tb'.*\b100\b.*\[0, 6\)",
    ),
    (
        "id-too-big-in-truncated-sequence-position",
        _with("seq", Ragged.from_lists([[4, 5, 6, 10], [8]])),
        ValueError,
        r"feature 'seq'.*table 'ta'.*\b10\b.*\[0, 10\)",
    ),
    (
        "negative-id-without-validation",
        _with("dense", torch.tensor([-1, 0])),
        ValueError,
        r"feature 'dense'.*table 'tb'.*-1\b.*validate_weights_and_indices",
    ),
    (
        "negative-id-without-validation-ragged",
        _with("dense", Ragged.from_lists([[0, -3], [1]])),
        ValueError,
        r"feature 'dense'.*table 'tb'.*-3\b",
    ),
    (
        "float-ids-ragged",
        _with("pooled", Ragged(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 3]))),
        TypeError,
        r"feature 'pooled'.*float32",
    ),
    (
        "float-ids-dense",
        _with("dense", torch.tensor([0.0, 1.0])),
        TypeError,
        r"feature 'dense'.*float32",
    ),
    (
        "float-ids-sparse",
        _weights_none(_with("pooled", sparse([[0, 0], [1, 0]], [1.0, 2.0], (2, 3), torch.float64))),
        TypeError,
        r"feature 'pooled'.*float64",
    ),
    (
        "nan-weight",
        _with("pooled", Ragged.from_lists([[1, 2], [3]]), ragged_f32([[1.0, math.nan], [0.5]])),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*finite.*nan",
    ),
    (
        "inf-weight",
        _with("pooled", Ragged.from_lists([[1, 2], [3]]), ragged_f32([[1.0, 2.0], [math.inf]])),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*finite.*inf",
    ),
    (
        "minus-inf-weight",
        _with("pooled", Ragged.from_lists([[1, 2], [3]]), ragged_f32([[-math.inf, 2.0], [1.0]])),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*finite.*-inf",
    ),
    (
        "integer-weights",
        _with("pooled", Ragged.from_lists([[1, 2], [3]]), Ragged.from_lists([[1, 2], [1]])),
        TypeError,
        r"feature 'pooled'.*table 'ta'.*weights.*int64",
    ),
    (
        "weights-for-dense-feature",
        _with("dense", torch.tensor([0, 1]), torch.tensor([1.0, 2.0])),
        ValueError,
        r"feature 'dense'.*table 'tb'.*weights.*dense",
    ),
    (
        "weights-for-sequence-feature",
        _with("seq", Ragged.from_lists([[4, 5], [8]]), ragged_f32([[1.0, 1.0], [1.0]])),
        ValueError,
        r"feature 'seq'.*table 'ta'.*weights.*sequence.*max_sequence_length=3",
    ),
    (
        "dense-input-for-sequence-feature",
        _with("seq", torch.tensor([[4, 5, 6], [7, 8, 9]])),
        ValueError,
        r"feature 'seq'.*table 'ta'.*dense.*max_sequence_length=3",
    ),
    (
        "ragged-weights-other-row-splits",
        _with("pooled", Ragged.from_lists([[1, 2], [3]]), ragged_f32([[1.0], [2.0, 0.5]])),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*row_splits",
    ),
    (
        "sparse-weights-for-ragged-ids",
        _with(
            "pooled",
            Ragged.from_lists([[1, 2], [3]]),
            sparse([[0, 0], [0, 1], [1, 0]], [1.0, 1.0, 1.0], (2, 2), torch.float32),
        ),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*weights",
    ),
    (
        "sparse-weights-other-indices",
        _with(
            "pooled",
            sparse([[0, 0], [0, 1], [1, 0]], [1, 2, 3], (2, 3), torch.int64),
            sparse([[0, 0], [0, 2], [1, 0]], [1.0, 2.0, 0.5], (2, 3), torch.float32),
        ),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*indices",
    ),
    (
        "sparse-duplicate-indices",
        _weights_none(_with("pooled", sparse([[0, 0], [0, 0], [1, 0]], [1, 2, 3], (2, 3), torch.int64))),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*duplicate",
    ),
    ("nest-missing-key", _drop_key("dense"), ValueError, r"features.*'dense'"),
    ("nest-extra-key", _extra_key, ValueError, r"features.*'extra'"),
    ("nest-list-instead-of-dict", _list_instead_of_dict, (TypeError, ValueError), r"features.*dict.*list"),
    ("weights-nest-missing-key", _weights_missing_key, ValueError, r"weights.*'seq'"),
    (
        "kjt-with-two-keys-for-one-feature",
        _with("pooled", FakeKJT({"a": [[1], [2]], "b": [[3], []]}), None),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*\['a', 'b'\]",
    ),
    (
        "unsupported-input-type",
        _with("pooled", np.array([1, 2, 3]), None),
        TypeError,
        r"feature 'pooled'.*table 'ta'.*ndarray",
    ),
    (
        # A container where feature_config has a leaf must not be flattened into the next features' slots.
        "list-of-inputs-for-one-feature",
        _with("pooled", [Ragged.from_lists([[1, 2], [3]]), Ragged.from_lists([[4, 5], [6]])], None),
        (TypeError, ValueError),
        r"'pooled'.*list",
    ),
]


@pytest.mark.parametrize("build, exc, match", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_bad_forward_input(
    build: Callable[[], Batch], exc: type[Exception] | tuple[type[Exception], ...], match: str
) -> None:
    emb = make_emb()
    assert_valid_step_works(emb)  # a real step first, so slots are not at their initial constants
    before = snapshot(emb)
    features, weights = build()
    with pytest.raises(exc, match=match):
        emb(features, weights)
    assert_unchanged(emb, before)
    with pytest.raises(exc, match=match):
        emb.enqueue(features, weights)
    with pytest.raises(RuntimeError, match="enqueue"):
        emb.dequeue()  # the rejected enqueue staged nothing
    assert_unchanged(emb, before)
    assert_valid_step_works(emb)


def test_output_shape_product_mismatch() -> None:
    table = TableConfig(10, 4, name="t", initializer=TruncatedNormal(stddev=0.1, seed=0))
    emb = DistributedEmbedding({"shaped": FeatureConfig(table, output_shape=(3,))}, optimizer=Adagrad(0.1))
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"feature 'shaped'.*table 't'.*output_shape \[3\].*\b2\b"):
        emb({"shaped": Ragged.from_lists([[1, 2], [3]])})
    assert_unchanged(emb, before)
    acts = emb({"shaped": Ragged.from_lists([[1, 2], [3], [4]])})
    assert tuple(acts["shaped"].shape) == (3, 4)
    emb.apply_gradients({"shaped": torch.ones(3, 4)})
    assert not torch.equal(emb.embedding_tables["t"], before["t"])


# ---------------------------------------------------------------------------------------------
# Negative ids and weights <= 0 are dropped when validate_weights_and_indices=True (spec §10.5).
# ---------------------------------------------------------------------------------------------
def test_negative_ids_and_nonpositive_weights_dropped_when_validating() -> None:
    dirty_emb, clean_emb = make_emb(), make_emb()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(dirty_emb).values(), snapshot(clean_emb).values()))
    features, weights = valid_batch()
    assert weights is not None
    dirty_features = {
        **features,
        "pooled": Ragged.from_lists([[1, -1, 2], [3, 0, 9], [-2, 5]]),
        "seq": Ragged.from_lists([[4, 5, 6, 7], [8]]),
    }
    dirty_weights = {**weights, "pooled": ragged_f32([[1.0, 5.0, 2.0], [0.5, 0.0, -2.0], [1.0, -0.5]])}
    clean_features = {**features, "pooled": Ragged.from_lists([[1, 2], [3], []])}
    clean_weights = {**weights, "pooled": ragged_f32([[1.0, 2.0], [0.5], []])}

    dirty = dirty_emb(dirty_features, dirty_weights)
    clean = clean_emb(clean_features, clean_weights)
    for key in ("pooled", "seq", "dense"):
        assert torch.equal(dirty[key], clean[key]), key
    # The third sample is left empty: a zero vector.
    assert torch.equal(dirty["pooled"][2], torch.zeros(4))

    grads = ones_like_all(clean)
    dirty_emb.apply_gradients(grads)
    clean_emb.apply_gradients(grads)
    after_dirty, after_clean = snapshot(dirty_emb), snapshot(clean_emb)
    for key, value in after_clean.items():
        assert torch.equal(after_dirty[key], value), key
    # Rows 0 and 9 appear only in the dirty batch, with weights <= 0: untouched, slots included.
    start = snapshot(make_emb())
    for row in (0, 9):
        assert torch.equal(after_dirty["ta"][row], start["ta"][row])
        assert torch.equal(after_dirty["ta/accumulators"][row], start["ta/accumulators"][row])
    assert not torch.equal(after_dirty["ta"][1], start["ta"][1])


def test_negative_ids_dropped_in_sparse_input_when_validating() -> None:
    dirty_emb, clean_emb = make_emb(), make_emb()
    features, _ = valid_batch()
    dirty = dirty_emb(
        {**features, "pooled": sparse([[0, 0], [0, 1], [1, 0], [1, 1]], [1, -4, 3, -1], (2, 3), torch.int64)}
    )
    clean = clean_emb({**features, "pooled": sparse([[0, 0], [1, 0]], [1, 3], (2, 3), torch.int64)})
    assert torch.equal(dirty["pooled"], clean["pooled"])


# ---------------------------------------------------------------------------------------------
# KeyedJaggedTensor inputs.
# ---------------------------------------------------------------------------------------------
def test_single_key_kjt_equals_ragged() -> None:
    emb = make_emb()
    features, weights = valid_batch()
    assert weights is not None
    expected = emb(features, weights)
    kjt = FakeKJT({"pooled": [[1, 2], [3]]}, weights={"pooled": [[1.0, 2.0], [0.5]]})
    got = emb({**features, "pooled": kjt}, {**weights, "pooled": None})
    assert torch.equal(got["pooled"], expected["pooled"])


def test_kjt_with_separate_weights_rejected() -> None:
    emb = make_emb()
    before = snapshot(emb)
    features, weights = valid_batch()
    assert weights is not None
    with pytest.raises(ValueError, match=r"feature 'pooled'.*KeyedJaggedTensor"):
        emb({**features, "pooled": FakeKJT({"pooled": [[1, 2], [3]]})}, weights)
    assert_unchanged(emb, before)
    assert_valid_step_works(emb)


# ---------------------------------------------------------------------------------------------
# apply_gradients errors (spec §4.3, 10.6): phase 1 rejects, nothing changes, a retry works.
# ---------------------------------------------------------------------------------------------
def _grads_with(feature: str, value: Any) -> Callable[[dict[str, Tensor]], Any]:
    def build(acts: dict[str, Tensor]) -> Any:
        grads: dict[str, Any] = ones_like_all(acts)
        grads[feature] = value(acts[feature]) if callable(value) else value
        return grads

    return build


def _grads_drop(feature: str) -> Callable[[dict[str, Tensor]], Any]:
    def build(acts: dict[str, Tensor]) -> Any:
        grads = ones_like_all(acts)
        del grads[feature]
        return grads

    return build


def _grads_as_list(acts: dict[str, Tensor]) -> Any:
    return [torch.ones_like(acts[k]) for k in ("dense", "pooled", "seq")]


def _filled(value: float) -> Callable[[Tensor], Tensor]:
    return lambda a: torch.full_like(a, value)


def _one_bad_element(value: float) -> Callable[[Tensor], Tensor]:
    def build(a: Tensor) -> Tensor:
        g = torch.ones_like(a)
        g.reshape(-1)[0] = value
        return g

    return build


GRADIENT_CASES: list[tuple[str, Callable[[dict[str, Tensor]], Any], type[Exception], str]] = [
    (
        "wrong-shape",
        _grads_with("pooled", torch.ones(2, 5)),
        ValueError,
        r"feature 'pooled'.*table 'ta'.*\[2, 5\].*\[2, 4\]",
    ),
    (
        "wrong-shape-sequence",
        _grads_with("seq", torch.ones(2, 4)),
        ValueError,
        r"feature 'seq'.*table 'ta'.*\[2, 4\].*\[2, 3, 4\]",
    ),
    ("not-a-tensor", _grads_with("pooled", 1.0), TypeError, r"feature 'pooled'.*float"),
    # A nested list where feature_config has a leaf must be rejected for that feature, not flattened
    # into the next features' slots.
    ("nested-list", _grads_with("pooled", [[1.0] * 4] * 2), TypeError, r"feature 'pooled'.*list"),
    ("numpy-array", _grads_with("dense", lambda a: a.detach().numpy()), TypeError, r"feature 'dense'.*ndarray"),
    (
        "integer-gradient",
        _grads_with("dense", lambda a: torch.ones(a.shape, dtype=torch.int64)),
        TypeError,
        r"feature 'dense'.*int64",
    ),
    ("nan-in-shared-table", _grads_with("pooled", _filled(math.nan)), ValueError, r"table 'ta'.*NaN or Inf"),
    ("inf-in-shared-table", _grads_with("seq", _one_bad_element(math.inf)), ValueError, r"table 'ta'.*NaN or Inf"),
    ("nan-in-first-table", _grads_with("dense", _one_bad_element(math.nan)), ValueError, r"table 'tb'.*NaN or Inf"),
    ("minus-inf-in-first-table", _grads_with("dense", _filled(-math.inf)), ValueError, r"table 'tb'.*NaN or Inf"),
    ("nest-missing-key", _grads_drop("seq"), ValueError, r"gradients.*'seq'"),
    ("nest-list-instead-of-dict", _grads_as_list, TypeError, r"gradients.*dict.*list"),
]


@pytest.mark.parametrize("build, exc, match", [c[1:] for c in GRADIENT_CASES], ids=[c[0] for c in GRADIENT_CASES])
def test_bad_gradients(build: Callable[[dict[str, Tensor]], Any], exc: type[Exception], match: str) -> None:
    emb = make_emb()
    assert_valid_step_works(emb)
    features, weights = valid_batch()
    acts = emb(features, weights)
    before = snapshot(emb)
    with pytest.raises(exc, match=match):
        emb.apply_gradients(build(acts))
    # Nothing changed, in either table, although the other table's gradients were valid.
    assert_unchanged(emb, before)
    # The lookup is still pending: a corrected call applies it.
    emb.apply_gradients(ones_like_all(acts))
    after = snapshot(emb)
    assert not torch.equal(after["ta"], before["ta"]) and not torch.equal(after["tb"], before["tb"])


def test_nan_gradient_from_backward() -> None:
    emb = make_emb()
    features, weights = valid_batch()
    acts = emb(features, weights)
    before = snapshot(emb)
    loss = (acts["pooled"] * math.inf).sum() + acts["seq"].sum() + acts["dense"].sum()
    loss.backward()
    with pytest.raises(ValueError, match=r"table 'ta'.*NaN or Inf"):
        emb.apply_gradients()
    assert_unchanged(emb, before)


def test_apply_gradients_twice_after_one_lookup() -> None:
    emb = make_emb()
    features, weights = valid_batch()
    acts = emb(features, weights)
    emb.apply_gradients(ones_like_all(acts))
    before = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"apply_gradients.*lookup"):
        emb.apply_gradients(ones_like_all(acts))
    assert_unchanged(emb, before)
    assert_valid_step_works(emb)


def test_apply_gradients_before_any_lookup() -> None:
    emb = make_emb()
    before = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"apply_gradients.*lookup"):
        emb.apply_gradients()
    assert_unchanged(emb, before)
    assert_valid_step_works(emb)


def test_apply_gradients_after_eval_lookup() -> None:
    emb = make_emb()
    features, weights = valid_batch()
    emb.eval()
    acts = emb(features, weights)
    assert not acts["pooled"].requires_grad
    before = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"apply_gradients.*lookup"):
        emb.apply_gradients(ones_like_all(acts))
    assert_unchanged(emb, before)
    emb.train()
    assert_valid_step_works(emb)


def test_apply_gradients_after_inference_enqueue() -> None:
    emb = make_emb()
    assert_valid_step_works(emb)
    features, weights = valid_batch()
    emb.enqueue(features, weights, training=False)
    acts = emb.dequeue()
    before = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"apply_gradients.*lookup"):
        emb.apply_gradients(ones_like_all(acts))
    assert_unchanged(emb, before)


def test_dequeue_without_enqueue() -> None:
    emb = make_emb()
    before = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"dequeue.*enqueue"):
        emb.dequeue()
    features, weights = valid_batch()
    emb.enqueue(features, weights)
    emb.dequeue()
    with pytest.raises(RuntimeError, match=r"dequeue.*enqueue"):
        emb.dequeue()  # one enqueue gives one dequeue
    assert_unchanged(emb, before)


def test_learning_rate_callable_returning_nan() -> None:
    rate = [math.nan]
    emb = make_emb(learning_rate=lambda: rate[0])
    features, weights = valid_batch()
    acts = emb(features, weights)
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"table '(ta|tb)'.*nan|nan.*table '(ta|tb)'"):
        emb.apply_gradients(ones_like_all(acts))
    assert_unchanged(emb, before)
    rate[0] = 0.1
    emb.apply_gradients(ones_like_all(acts))
    assert not torch.equal(emb.embedding_tables["ta"], before["ta"])


# ---------------------------------------------------------------------------------------------
# load_state_dict: all-or-nothing.
# ---------------------------------------------------------------------------------------------
def _donor_state() -> dict[str, Tensor]:
    """A valid state dict whose every tensor differs from a fresh ``make_emb()``'s."""
    donor = make_emb()
    for _ in range(2):
        assert_valid_step_works(donor)
    state = {k: v.clone() for k, v in donor.state_dict().items()}
    fresh = snapshot(make_emb())
    # Make sure every entry would be visible if it were (wrongly) copied.
    for key in state:
        state[key] = state[key] + 1.0
        assert not torch.equal(state[key], fresh[key])
    return state


def _sd_wrong_shape(sd: dict[str, Tensor]) -> None:
    sd["tb"] = torch.zeros(7, 3)


def _sd_missing(sd: dict[str, Tensor]) -> None:
    del sd["ta/accumulators"]


def _sd_extra(sd: dict[str, Tensor]) -> None:
    sd["tc"] = torch.zeros(2, 2)


def _sd_nan(sd: dict[str, Tensor]) -> None:
    sd["ta"][3, 1] = math.nan


def _sd_not_tensor(sd: dict[str, Tensor]) -> None:
    sd["tb/accumulators"] = [[0.0] * 3] * 6  # type: ignore[assignment]


def _sd_integer(sd: dict[str, Tensor]) -> None:
    sd["tb"] = torch.ones(6, 3, dtype=torch.int64)


LOAD_CASES: list[tuple[str, Callable[[dict[str, Tensor]], None], str]] = [
    ("wrong-shape", _sd_wrong_shape, r"'tb'.*\[7, 3\].*\[6, 3\]"),
    ("missing-key", _sd_missing, r"ta/accumulators"),
    ("extra-key", _sd_extra, r"\btc\b"),
    ("nan", _sd_nan, r"'ta'.*finite"),
    ("not-a-tensor", _sd_not_tensor, r"'tb/accumulators'.*list"),
    ("integer", _sd_integer, r"'tb'.*floating"),
]


@pytest.mark.parametrize("corrupt, match", [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_bad_load_state_dict(corrupt: Callable[[dict[str, Tensor]], None], match: str) -> None:
    emb = make_emb()
    state = _donor_state()
    corrupt(state)
    before = snapshot(emb)
    with pytest.raises((RuntimeError, ValueError), match=rf"(?s){match}"):
        emb.load_state_dict(state)
    assert_unchanged(emb, before)
    assert_valid_step_works(emb)


def test_good_load_state_dict_roundtrip() -> None:
    emb = make_emb()
    state = _donor_state()
    emb.load_state_dict(state)
    after = snapshot(emb)
    assert sorted(after) == sorted(state)
    for key, value in state.items():
        assert torch.equal(after[key], value), key
