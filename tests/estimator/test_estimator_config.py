"""EmbeddingConfigSpec's rules (spec §4.4, 10.4), the v1 ``*Parameters`` classes and the feature
columns with every raw input format."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

import embtables as et
from embtables import estimator as est


def _cols() -> list[Any]:
    return [est.embedding_column(est.categorical_column_with_identity("a", 10), 4)]


# ---------------------------------------------------------------------------------------------- spec rules
def test_spec_needs_columns_or_both_dicts() -> None:
    with pytest.raises(ValueError, match="feature_columns"):
        est.EmbeddingConfigSpec(optimization_parameters=est.AdagradParameters(0.1))
    t = et.TableConfig(10, 4, name="t")
    with pytest.raises(ValueError):
        est.EmbeddingConfigSpec(
            feature_to_config_dict={"f": et.FeatureConfig(t)}, optimization_parameters=est.AdagradParameters(0.1)
        )
    spec = est.EmbeddingConfigSpec(
        feature_to_config_dict={"f": et.FeatureConfig(t)},
        table_to_config_dict={"t": t},
        optimization_parameters=est.AdagradParameters(0.1),
    )
    emb = spec.build(lambda: 0)
    assert set(emb.embedding_tables) == {"t"}


@pytest.mark.parametrize(
    "column",
    [est.categorical_column_with_identity("a", 10), "a", et.FeatureConfig(et.TableConfig(3, 2))],
    ids=["categorical", "str", "FeatureConfig"],
)
def test_spec_rejects_unsupported_column_types(column: Any) -> None:
    with pytest.raises(TypeError, match="embedding_column"):
        est.EmbeddingConfigSpec(feature_columns=[column], optimization_parameters=est.AdagradParameters(0.1))


@pytest.mark.parametrize("opt", [None, "adagrad", torch.optim.SGD, 0.1])
def test_spec_rejects_unsupported_optimization_parameters(opt: Any) -> None:
    with pytest.raises(ValueError, match="optimization_parameters"):
        est.EmbeddingConfigSpec(feature_columns=_cols(), optimization_parameters=opt)


@pytest.mark.parametrize("strategy", ["table", "auto", "DIV", None])
def test_spec_rejects_partition_strategy(strategy: Any) -> None:
    with pytest.raises(ValueError, match="partition_strategy"):
        est.EmbeddingConfigSpec(
            feature_columns=_cols(), optimization_parameters=est.AdagradParameters(0.1), partition_strategy=strategy
        )


def test_spec_defaults_match_tf() -> None:
    spec = est.EmbeddingConfigSpec(feature_columns=_cols(), optimization_parameters=est.AdagradParameters(0.1))
    assert spec.clipping_limit is None
    assert spec.pipeline_execution_with_tensor_core is False
    assert spec.partition_strategy == "div"
    assert spec.profile_data_directory is None
    assert spec.experimental_gradient_multiplier_fn is None


# ---------------------------------------------------------------------------------------------- v1 parameters
def test_parameter_defaults_are_v1s() -> None:
    adam = est.AdamParameters(0.1).to_optimizer()
    assert isinstance(adam, et.Adam) and adam.epsilon == 1e-08 and adam.beta_1 == 0.9 and adam.lazy_adam
    assert est.AdagradParameters(0.1).to_optimizer().initial_accumulator_value == 0.1  # type: ignore[union-attr]
    yogi = est.ProximalYogiParameters().to_optimizer()
    assert isinstance(yogi, et.ProximalYogi) and yogi.learning_rate == 0.01 and yogi.epsilon == 1e-3
    assert yogi.initial_accumulator_value == 1e-6
    ftrl = est.FtrlParameters(0.1).to_optimizer()
    assert isinstance(ftrl, et.FTRL) and ftrl.learning_rate_power == -0.5 and ftrl.initial_accumulator_value == 0.1


def test_sgd_parameters_accumulate_only_with_a_gradient_clip() -> None:
    assert not est.StochasticGradientDescentParameters(0.1).to_optimizer().use_gradient_accumulation
    clipped = est.StochasticGradientDescentParameters(0.1, clip_gradient_min=-1.0).to_optimizer()
    assert clipped.use_gradient_accumulation and clipped.gradient_clip_bounds == (-1.0, None)


@pytest.mark.parametrize(
    "make",
    [
        lambda: est.AdagradParameters(0.1, initial_accumulator=0.0),
        lambda: est.AdamParameters(0.1, beta1=1.0),
        lambda: est.AdamParameters(0.1, lazy_adam=False, use_gradient_accumulation=False),
        lambda: est.FtrlParameters(0.1, learning_rate_power=0.5),
        lambda: est.FtrlParameters(0.1, initial_accumulator_value=-0.1),
        lambda: est.FtrlParameters(0.1, l1_regularization_strength=-1.0),
        lambda: est.ProximalAdagradParameters(0.1, l2_regularization_strength=-1.0),
        lambda: est.RMSPropParameters(0.1, rho=0.9, momentum=0.0, epsilon=0.0),
        lambda: est.ProximalYogiParameters(beta2=1.0),
        lambda: est.AdagradParameters(0.1, use_gradient_accumulation=False, clip_gradient_max=1.0),
    ],
)
def test_parameters_validate_with_their_v1_name(make: Any) -> None:
    with pytest.raises(ValueError, match="Parameters"):
        make()


def test_ftrl_parameters_allow_a_zero_initial_accumulator() -> None:
    opt = est.FtrlParameters(0.1, initial_accumulator_value=0.0, allow_zero_accumulator=True).to_optimizer()
    t = et.TableConfig(5, 2, name="t", optimizer=opt)
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)})
    assert torch.equal(emb.slot_variables["t"]["accumulators"], torch.zeros(5, 2))


def test_every_v1_class_converts_to_the_matching_optimizer() -> None:
    pairs = [
        (est.StochasticGradientDescentParameters(0.1), et.SGD),
        (est.AdagradParameters(0.1), et.Adagrad),
        (est.AdamParameters(0.1), et.Adam),
        (est.FtrlParameters(0.1), et.FTRL),
        (est.ProximalAdagradParameters(0.1), et.ProximalAdagrad),
        (est.MomentumParameters(0.1, 0.9), et.Momentum),
        (est.RMSPropParameters(0.1, 0.9, 0.0, 1e-7), et.RMSProp),
        (est.CenteredRMSPropParameters(0.1, 0.9, 0.0, 1e-7), et.CenteredRMSProp),
        (est.AdadeltaParameters(0.1, 0.95, 1e-7), et.Adadelta),
        (est.ProximalYogiParameters(), et.ProximalYogi),
        (est.FrequencyEstimatorParameters(0.1, 100.0, 5.0, 1.0), et.FrequencyEstimator),
    ]
    for params, cls in pairs:
        assert type(params.to_optimizer()) is cls


# ---------------------------------------------------------------------------------------------- semantics
def _one_step(spec: est.EmbeddingConfigSpec, grad: torch.Tensor, step: int = 0) -> torch.Tensor:
    torch.manual_seed(0)
    emb = spec.build(lambda: step)
    ids, weights = spec.engine_inputs({"a": [[1, 2], [2]]})
    out = emb(ids, weights or None)
    fn = spec.experimental_gradient_multiplier_fn
    emb.apply_gradients({"a_embedding": grad * (fn(step) if fn else 1.0)})
    del out
    return emb.embedding_tables["a_embedding"]


def test_gradient_multiplier_scales_every_embedding_gradient() -> None:
    grad = torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.0, 1.0, -1.0, 0.0]])
    base = est.EmbeddingConfigSpec(feature_columns=_cols(), optimization_parameters=est.AdagradParameters(0.1))
    scaled = dataclasses.replace(base, experimental_gradient_multiplier_fn=lambda step: 0.5 * step)
    manual = _one_step(base, grad * 1.5)
    assert torch.equal(_one_step(scaled, grad, step=3), manual)


def test_clipping_limit_is_a_symmetric_clip_and_the_tighter_bound_wins() -> None:
    spec = est.EmbeddingConfigSpec(
        feature_columns=_cols(),
        optimization_parameters=est.AdagradParameters(0.1, clip_gradient_min=-0.2, clip_gradient_max=5.0),
        clipping_limit=0.3,
    )
    assert spec.optimizer(lambda: 0).gradient_clip_bounds == (-0.2, 0.3)
    grad = torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.0, 1.0, -1.0, 0.0]])
    plain = est.EmbeddingConfigSpec(
        feature_columns=_cols(),
        optimization_parameters=est.AdagradParameters(0.1, clip_gradient_min=-0.2, clip_gradient_max=0.3),
    )
    assert torch.equal(_one_step(spec, grad), _one_step(plain, grad))
    sgd = est.EmbeddingConfigSpec(
        feature_columns=_cols(),
        optimization_parameters=est.StochasticGradientDescentParameters(0.1),
        clipping_limit=1.0,
    )
    assert sgd.optimizer(lambda: 0).use_gradient_accumulation


def test_learning_rate_fn_follows_the_global_step() -> None:
    col = est.embedding_column(
        est.categorical_column_with_identity("a", 10), 4, learning_rate_fn=lambda step: 0.1 * (step + 1)
    )
    spec = est.EmbeddingConfigSpec(feature_columns=[col], optimization_parameters=est.AdagradParameters(0.5))
    step = [4]
    emb = spec.build(lambda: step[0])
    assert emb._engine.learning_rates()["a_embedding"] == pytest.approx(0.5, rel=1e-6)  # type: ignore[union-attr]


def test_a_learning_rate_fn_shared_by_columns_is_evaluated_once_a_step_and_each_table_gets_its_own() -> None:
    calls: list[int] = []

    def shared(step: int) -> float:
        calls.append(step)
        return 0.25

    cols = [
        est.embedding_column(est.categorical_column_with_identity(k, 10), 4, learning_rate_fn=shared)
        for k in ("a", "b", "c")
    ]
    cols.append(est.embedding_column(est.categorical_column_with_identity("d", 10), 4, learning_rate_fn=lambda s: 2.0))
    cols.append(est.embedding_column(est.categorical_column_with_identity("e", 10), 4))
    spec = est.EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=est.AdagradParameters(0.5))
    emb = spec.build(lambda: 3)
    for _ in range(2):  # the second step takes the remembered plan
        calls.clear()
        rates = emb._engine.learning_rates()  # type: ignore[union-attr]
        assert calls == [3]  # once, not once per table (TF evaluates each distinct callable once)
        assert rates == {"a_embedding": 0.25, "b_embedding": 0.25, "c_embedding": 0.25, "d_embedding": 2.0,
                         "e_embedding": 0.5}  # fmt: skip


def test_frequency_estimator_gets_the_global_step_as_learning_rate() -> None:
    col = est.embedding_column(est.categorical_column_with_identity("a", 10), 1, initializer=et.Constant(100.0))
    spec = est.EmbeddingConfigSpec(
        feature_columns=[col], optimization_parameters=est.FrequencyEstimatorParameters(0.5, 100.0, 10.0, 1.0)
    )
    emb = spec.build(lambda: 7)
    ids, _ = spec.engine_inputs({"a": [[3]]})
    out = emb(ids)
    emb.apply_gradients({"a_embedding": torch.zeros_like(out["a_embedding"])})
    assert emb.slot_variables["a_embedding"]["last_hit_step"][3, 0] == 7.0
    assert emb.embedding_tables["a_embedding"][3, 0] == pytest.approx(100 * 0.5 + 7 * 0.5)


# ---------------------------------------------------------------------------------------------- feature columns
def _ids(column: Any, features: dict[str, Any]) -> tuple[list[int], list[int], Any]:
    ids, lengths, weights = column.ids(features)
    return ids.tolist(), lengths.tolist(), None if weights is None else weights.tolist()


@pytest.mark.parametrize(
    "raw",
    [
        [[1, 2], [], [3]],
        pd.Series([[1, 2], [], [3]]),
        pa.array([[1, 2], [], [3]]),
        pa.chunked_array([pa.array([[1, 2]]), pa.array([[], [3]])]),
        np.array([[1, 2], [-1, -1], [3, -1]]),
        torch.tensor([[1, 2], [-1, -1], [3, -1]]),
    ],
    ids=["lists", "pandas", "pyarrow", "pyarrow-chunked", "numpy-padded", "torch-padded"],
)
def test_identity_column_reads_every_format(raw: Any) -> None:
    col = est.categorical_column_with_identity("a", 5)
    assert _ids(col, {"a": raw}) == ([1, 2, 3], [2, 0, 1], None)


def test_scalar_columns() -> None:
    col = est.categorical_column_with_identity("a", 5)
    assert _ids(col, {"a": [4, 0, 2]}) == ([4, 0, 2], [1, 1, 1], None)
    assert _ids(col, {"a": np.array([4, 0])}) == ([4, 0], [1, 1], None)
    assert _ids(col, {"a": pd.Series([4, 0])}) == ([4, 0], [1, 1], None)
    assert _ids(col, {"a": 3}) == ([3], [1], None)


def test_identity_out_of_range_raises_or_uses_default() -> None:
    with pytest.raises(ValueError, match="outside"):
        est.categorical_column_with_identity("a", 5).ids({"a": [[1, 7]]})
    assert _ids(est.categorical_column_with_identity("a", 5, default_value=0), {"a": [[1, 7]]})[0] == [1, 0]
    with pytest.raises(ValueError, match="no feature 'a'"):
        est.categorical_column_with_identity("a", 5).ids({"b": [1]})
    with pytest.raises(ValueError, match="integer ids"):
        est.categorical_column_with_identity("a", 5).ids({"a": ["x"]})


def test_hash_bucket_is_the_documented_stable_hash() -> None:
    col = est.categorical_column_with_hash_bucket("s", 1000)
    ids, lengths, _ = _ids(col, {"s": pd.Series(["apple", None, "pear", 42])})

    def expected(v: str) -> int:
        return int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") % 1000

    assert lengths == [1, 0, 1, 1]
    assert ids == [expected("apple"), expected("pear"), expected("42")]
    assert est.stable_hash(np.array(["apple"]), 1000).tolist() == [318]  # pinned: the same on every machine


def test_vocabulary_list_with_default_and_oov_buckets() -> None:
    col = est.categorical_column_with_vocabulary_list("c", ["red", "green", "blue"])
    assert _ids(col, {"c": [["blue", "pink"], ["red"]]}) == ([2, -1, 0], [2, 1], None)
    oov = est.categorical_column_with_vocabulary_list("c", ["red", "green", "blue"], num_oov_buckets=4)
    ids, _, _ = _ids(oov, {"c": [["blue", "pink"]]})
    assert ids[0] == 2 and 3 <= ids[1] < 7 and oov.num_buckets == 7
    ints = est.categorical_column_with_vocabulary_list("n", [10, 20, 30], default_value=0)
    assert _ids(ints, {"n": [30, 99, 10]})[0] == [2, 0, 0]


def test_weighted_column_needs_one_weight_per_id() -> None:
    col = est.weighted_categorical_column(est.categorical_column_with_identity("a", 5), "w")
    assert _ids(col, {"a": [[1, 2], [3]], "w": [[0.5, 2.0], [1.0]]}) == ([1, 2, 3], [2, 1], [0.5, 2.0, 1.0])
    with pytest.raises(ValueError, match="one weight per id"):
        col.ids({"a": [[1, 2], [3]], "w": [[0.5], [1.0]]})


def test_shared_columns_use_one_table_and_weighted_sequence_columns_shape() -> None:
    a = est.categorical_column_with_identity("a", 20)
    b = est.categorical_column_with_identity("b", 20)
    seq = est.sequence_categorical_column_with_identity("s", 20)
    cols = [
        *est.shared_embedding_columns([a, b], 3),
        est.embedding_column(est.weighted_categorical_column(a, "w"), 2, combiner="sum"),
        est.embedding_column(seq, 2, max_sequence_length=4),
    ]
    spec = est.EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=est.AdagradParameters(0.1))
    emb = spec.build(lambda: 0)
    assert sorted(emb.embedding_tables) == ["a_b_shared_embedding", "a_weighted_by_w_embedding", "s_embedding"]
    feats = {"a": [[1], [2, 3]], "b": [4, 5], "w": [[2.0], [1.0, 0.5]], "s": [[1, 2, 3], [4]]}
    ids, weights = spec.engine_inputs(feats)
    out = emb(ids, weights)
    assert out["a_shared_embedding"].shape == (2, 3) and out["b_shared_embedding"].shape == (2, 3)
    assert out["s_embedding"].shape == (2, 4, 2)
    table = emb.embedding_tables["a_weighted_by_w_embedding"]
    torch.testing.assert_close(out["a_weighted_by_w_embedding"][1], table[2] + 0.5 * table[3])
    with pytest.raises(ValueError, match="same num_buckets"):
        est.shared_embedding_columns([a, est.categorical_column_with_identity("c", 7)], 3)
    with pytest.raises(ValueError, match="max_sequence_length"):
        est.embedding_column(seq, 2)


def test_an_integer_column_that_arrives_as_float_hashes_like_its_integers() -> None:
    """A pandas/Arrow integer column with one null arrives as float64: id 12345 must land in the same
    bucket as in a batch without nulls (issue 22); a non-integral float is refused by name."""
    col = est.categorical_column_with_hash_bucket("s", 1000)
    ints, _, _ = _ids(col, {"s": pd.Series([12345, 7])})
    with_null, lengths, _ = _ids(col, {"s": pd.Series([12345, None, 7])})
    assert pd.Series([12345, None, 7]).dtype == np.float64
    assert with_null == ints and lengths == [1, 0, 1]
    assert _ids(col, {"s": np.array([12345.0, 7.0])})[0] == ints
    assert _ids(col, {"s": [[12345.0], [7]]})[0] == ints
    with pytest.raises(ValueError, match=r"column 's': the value 1.5 is not an integer"):
        _ids(col, {"s": np.array([1.5, 2.0])})
    vocab = est.categorical_column_with_vocabulary_list("v", [1, 2], num_oov_buckets=5)
    assert _ids(vocab, {"v": np.array([12345.0, 2.0])})[0] == _ids(vocab, {"v": np.array([12345, 2])})[0]


def test_the_fast_hash_is_the_stable_hash_also_when_fingerprints_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings and integers are found by a vectorised fingerprint; a collision of two texts' fingerprints
    must fall back to hashing text by text, never give one text the other's bucket."""
    from embtables.estimator import hashing as fc

    def expected(values: list[object], buckets: int) -> list[int]:
        return [fc._digest(str(v)) % buckets for v in values]

    rng = np.random.default_rng(4)
    for _ in range(30):
        words = [f"w{rng.integers(0, 50)}" + "é" * int(rng.integers(0, 3)) for _ in range(rng.integers(1, 200))]
        assert fc.stable_hash(np.array(words), 997).tolist() == expected(words, 997)
        ints = rng.integers(-(10**12), 10**12, rng.integers(1, 100))
        assert fc.stable_hash(ints, 31).tolist() == expected(ints.tolist(), 31)
    long = ["x" * 300 + str(i % 7) for i in range(40)] + ["y" * 299]  # wider than the multipliers: FNV-1a
    assert fc.stable_hash(np.array(long), 997).tolist() == expected(long, 997)
    monkeypatch.setattr(fc, "_fingerprints", lambda s: np.zeros(len(s), dtype=np.uint64))  # every text collides
    monkeypatch.setattr(fc, "_KNOWN", (np.zeros(0, np.uint64), np.zeros(0, str), np.zeros(0, np.uint64)))
    words = ["apple", "pear", "apple", "fig"]
    assert fc.stable_hash(np.array(words), 1000).tolist() == expected(words, 1000)
    assert fc.stable_hash(np.array(["kiwi"]), 1000).tolist() == expected(["kiwi"], 1000)
    assert fc.stable_hash(np.array(["apple", "kiwi"]), 1000).tolist() == expected(["apple", "kiwi"], 1000)


def test_single_valued_columns_are_dense_ids_and_train_the_same_bits() -> None:
    """A 1-D integer column of ids in range is converted without a pass per step over its lengths and given to
    the engine as dense ids [B] (B bags of one id); the same ids as one-element lists take the general path
    (row splits). Both train the same bits; a missing (-1) or out-of-range id still goes the general way."""
    columns = [
        est.embedding_column(est.categorical_column_with_identity("a", 50), 4, combiner=c, initializer=None)
        for c in ("mean",)
    ] + [est.embedding_column(est.categorical_column_with_identity("b", 30), 3, combiner="sqrtn")]
    spec = est.EmbeddingConfigSpec(feature_columns=columns, optimization_parameters=est.AdagradParameters(0.1))
    rng = np.random.default_rng(0)
    tables = []
    for form in ("array", "lists"):
        torch.manual_seed(0)
        emb = spec.build(lambda: 0)
        for _ in range(3):
            a, b = rng.integers(0, 50, 16).astype(np.int16), rng.integers(0, 30, 16)
            feats = {"a": a, "b": b} if form == "array" else {"a": [[int(v)] for v in a], "b": [[int(v)] for v in b]}
            ids, weights = spec.engine_inputs(feats)
            kinds = {type(v).__name__ for v in ids.values()}
            assert kinds == ({"Tensor"} if form == "array" else {"Ragged"}), kinds
            acts = emb(ids, weights or None)
            sum((v * (1 + torch.arange(v.numel()).reshape(v.shape))).sum() for v in acts.values()).backward()
            emb.apply_gradients()
        tables.append({k: v.clone() for k, v in emb.state_dict().items()})
        rng = np.random.default_rng(0)
    for k in tables[0]:
        assert torch.equal(tables[0][k], tables[1][k]), k
    ids, _ = spec.engine_inputs({"a": np.array([3, -1, 4]), "b": np.array([1, 2, 3])})
    assert isinstance(ids["a_embedding"], et.Ragged) and ids["a_embedding"].row_splits.tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="outside"):
        spec.engine_inputs({"a": np.array([3, 50]), "b": np.array([1, 2])})
