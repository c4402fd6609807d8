"""Config values (spec §1.2, 1.3, 4.1-4.3): TF's signatures, slot names, validation messages,
equality/hash/frozen/replace, and how ``DistributedEmbedding`` resolves a feature config."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from embtables import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    Combiner,
    DistributedEmbedding,
    FeatureConfig,
    QuantizationConfig,
    TableConfig,
)

OPTIMIZER_CLASSES: list[type[Any]] = [SGD, Adagrad, AdagradMomentum, Adam, FTRL]

# ---------------------------------------------------------------------------------------------
# Signatures: names, order and defaults exactly as TF v2 tf.tpu.experimental.embedding.* (spec §1.3).
# Written out literally; never derived from the package.
# ---------------------------------------------------------------------------------------------
_TAIL_WITH_SLOT_FN: list[tuple[str, object]] = [
    ("use_gradient_accumulation", True),
    ("clip_weight_min", None),
    ("clip_weight_max", None),
    ("weight_decay_factor", None),
    ("multiply_weight_decay_factor_by_learning_rate", None),
    ("slot_variable_creation_fn", None),
    ("clipvalue", None),
]

EXPECTED_SIGNATURES: dict[type[Any], list[tuple[str, object]]] = {
    SGD: [
        ("learning_rate", 0.01),
        ("use_gradient_accumulation", True),
        ("clip_weight_min", None),
        ("clip_weight_max", None),
        ("weight_decay_factor", None),
        ("multiply_weight_decay_factor_by_learning_rate", None),
        ("clipvalue", None),
        ("low_dimensional_packing_status", False),
    ],
    Adagrad: [
        ("learning_rate", 0.001),
        ("initial_accumulator_value", 0.1),
        *_TAIL_WITH_SLOT_FN,
        ("low_dimensional_packing_status", False),
    ],
    AdagradMomentum: [
        ("learning_rate", 0.001),
        ("momentum", 0.0),
        ("use_nesterov", False),
        ("exponent", 2),
        ("beta2", 1),
        ("epsilon", 1e-10),
        *_TAIL_WITH_SLOT_FN,
        ("low_dimensional_packing_status", False),
    ],
    Adam: [
        ("learning_rate", 0.001),
        ("beta_1", 0.9),
        ("beta_2", 0.999),
        ("epsilon", 1e-07),
        ("lazy_adam", True),
        ("sum_inside_sqrt", True),
        *_TAIL_WITH_SLOT_FN,
        ("low_dimensional_packing_status", False),
    ],
    FTRL: [
        ("learning_rate", 0.001),
        ("learning_rate_power", -0.5),
        ("l1_regularization_strength", 0.0),
        ("l2_regularization_strength", 0.0),
        ("beta", 0.0),
        ("initial_accumulator_value", 0.1),
        *_TAIL_WITH_SLOT_FN,
        ("multiply_linear_by_learning_rate", False),
        ("allow_zero_accumulator", False),
        ("low_dimensional_packing_status", False),
    ],
}

EXPECTED_SLOT_NAMES: dict[type[Any], tuple[str, ...]] = {
    SGD: (),
    Adagrad: ("accumulators",),
    AdagradMomentum: ("accumulators", "momenta"),
    Adam: ("momenta", "velocities"),
    FTRL: ("accumulators", "linears"),
}


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_signature_names_order_defaults_match_tf(cls: type[Any]) -> None:
    params = list(inspect.signature(cls).parameters.values())
    got = [(p.name, p.default) for p in params]
    expected = EXPECTED_SIGNATURES[cls]
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, default), (_, want) in zip(got, expected):
        assert default == want and type(default) is type(want), (name, default, want)
    # TF takes every argument positionally or by keyword.
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_positional_learning_rate(cls: type[Any]) -> None:
    opt = cls(0.1)
    assert opt.learning_rate == 0.1
    default = cls()
    # The second TF argument, given positionally, lands in the right field.
    second_name, second_default = EXPECTED_SIGNATURES[cls][1]
    assert getattr(default, second_name) == second_default


def test_positional_arguments_follow_tf_order() -> None:
    adam = Adam(0.1, 0.5, 0.6, 1e-3, False)
    assert (adam.beta_1, adam.beta_2, adam.epsilon, adam.lazy_adam) == (0.5, 0.6, 1e-3, False)
    ftrl = FTRL(0.1, -0.25, 0.01, 0.02, 0.03, 0.5)
    assert (ftrl.learning_rate_power, ftrl.l1_regularization_strength, ftrl.l2_regularization_strength) == (
        -0.25,
        0.01,
        0.02,
    )
    assert (ftrl.beta, ftrl.initial_accumulator_value) == (0.03, 0.5)
    sgd = SGD(0.5, False)
    assert sgd.use_gradient_accumulation is False


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_slot_names_are_tf_names(cls: type[Any]) -> None:
    assert tuple(cls().slot_names) == EXPECTED_SLOT_NAMES[cls]


def test_slot_initial_values() -> None:
    assert Adagrad(initial_accumulator_value=0.25).slot_initial_values() == (0.25,)
    assert FTRL(initial_accumulator_value=0.5).slot_initial_values() == (0.5, 0.0)
    assert Adam().slot_initial_values() == (0.0, 0.0)
    # AdagradMomentum: epsilon is not the initial accumulator (spec §1.3).
    assert AdagradMomentum(epsilon=0.5).slot_initial_values() == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# Equality, hash, frozen, replace.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_equality_and_hash(cls: type[Any]) -> None:
    a, b, c = cls(0.1), cls(0.1), cls(0.2)
    assert a == b and hash(a) == hash(b)
    assert a != c
    table = {a: "x"}
    assert table[b] == "x"
    assert c not in table


def test_different_optimizer_types_are_unequal() -> None:
    assert SGD(0.1) != Adagrad(0.1)
    assert len({SGD(0.1), Adagrad(0.1), SGD(0.1)}) == 2


def test_callable_learning_rate_equality_is_identity() -> None:
    def lr1() -> float:
        return 0.1

    def lr2() -> float:
        return 0.1

    assert Adam(lr1) == Adam(lr1)
    assert Adam(lr1) != Adam(lr2)
    assert hash(Adam(lr1)) == hash(Adam(lr1))


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_frozen(cls: type[Any]) -> None:
    opt = cls(0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.learning_rate = 0.5
    assert opt.learning_rate == 0.1


def test_table_and_feature_configs_are_frozen() -> None:
    table = TableConfig(10, 4)
    feature = FeatureConfig(table)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.name = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        feature.max_sequence_length = 3  # type: ignore[misc]
    assert table.name is None and feature.max_sequence_length == 0


def test_replace_works_and_revalidates() -> None:
    base = Adagrad(0.1, initial_accumulator_value=0.2)
    new = dataclasses.replace(base, learning_rate=0.5)
    assert new.learning_rate == 0.5 and new.initial_accumulator_value == 0.2
    assert base.learning_rate == 0.1
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        dataclasses.replace(base, initial_accumulator_value=0.0)
    with pytest.raises(ValueError, match="beta_2"):
        dataclasses.replace(Adam(), beta_2=1.0)
    with pytest.raises(ValueError, match="clipvalue"):
        dataclasses.replace(SGD(clipvalue=1.0), use_gradient_accumulation=False)
    table = TableConfig(10, 4, combiner="SUM")
    assert dataclasses.replace(table, dim=8).combiner == "sum"
    with pytest.raises(ValueError, match="vocabulary_size"):
        dataclasses.replace(table, vocabulary_size=0)


# ---------------------------------------------------------------------------------------------
# Optimizer validation (spec §1.2, 1.3): right exception type, message names the argument.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Adagrad, FTRL], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [0.0, -0.1])
def test_initial_accumulator_value_must_be_positive(cls: type[Any], value: float) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}.*initial_accumulator_value.*{value}"):
        cls(initial_accumulator_value=value)


@pytest.mark.parametrize("value", [0.0, -1e-10])
def test_adagrad_momentum_epsilon_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match=r"AdagradMomentum.*`epsilon`"):
        AdagradMomentum(epsilon=value)


@pytest.mark.parametrize("value", [0, -2.0])
def test_adagrad_momentum_exponent_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match=r"AdagradMomentum.*`exponent`"):
        AdagradMomentum(exponent=value)


@pytest.mark.parametrize("arg", ["beta_1", "beta_2"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_adam_betas_in_unit_interval(arg: str, value: float) -> None:
    # The message must name the offending argument (TF's beta_2 message wrongly says beta_1).
    other = "beta_2" if arg == "beta_1" else "beta_1"
    with pytest.raises(ValueError, match=rf"`{arg}`") as info:
        Adam(**{arg: value})
    assert other not in str(info.value)
    assert str(value) in str(info.value)


def test_adam_betas_edges_valid() -> None:
    assert Adam(beta_1=0.0, beta_2=0.0).beta_1 == 0.0


@pytest.mark.parametrize("value", [0.0, -1e-7])
def test_adam_epsilon_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match=r"Adam.*`epsilon`"):
        Adam(epsilon=value)


def test_non_lazy_adam_needs_accumulation() -> None:
    with pytest.raises(ValueError, match=r"lazy_adam.*use_gradient_accumulation|use_gradient_accumulation.*lazy"):
        Adam(lazy_adam=False, use_gradient_accumulation=False)
    assert Adam(lazy_adam=False).lazy is False
    assert Adam(use_gradient_accumulation=False).lazy is True


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("clipvalue", [1.0, (None, 2.0), (-1.0, 1.0)])
def test_clipvalue_needs_accumulation(cls: type[Any], clipvalue: object) -> None:
    with pytest.raises(ValueError, match=r"clipvalue.*use_gradient_accumulation"):
        cls(use_gradient_accumulation=False, clipvalue=clipvalue)


@pytest.mark.parametrize("cls", [Adagrad, AdagradMomentum, Adam, FTRL], ids=lambda c: c.__name__)
@pytest.mark.parametrize("fn", [1, "make_slots", [lambda: None]])
def test_slot_variable_creation_fn_must_be_callable(cls: type[Any], fn: object) -> None:
    with pytest.raises(ValueError, match=r"slot_variable_creation_fn.*must be either None or a callable"):
        cls(slot_variable_creation_fn=fn)


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("lr", ["0.1", None, [0.1], True])
def test_learning_rate_must_be_float_or_callable(cls: type[Any], lr: object) -> None:
    with pytest.raises(TypeError, match=r"learning_rate"):
        cls(learning_rate=lr)


@pytest.mark.parametrize("lr", [math.nan, math.inf])
def test_non_finite_learning_rate_is_a_value_error(lr: float) -> None:
    # A NaN/Inf float has the right type and a bad value: STYLE R2 says ValueError.
    with pytest.raises(ValueError, match=r"learning_rate"):
        Adagrad(learning_rate=lr)


def test_callable_learning_rate_accepted() -> None:
    def lr() -> float:
        return 0.5

    assert Adam(lr).learning_rate is lr


def test_clipvalue_normalisation() -> None:
    assert SGD().gradient_clip_bounds == (None, None)
    assert SGD(clipvalue=2.0).gradient_clip_bounds == (-2.0, 2.0)
    assert SGD(clipvalue=(None, 3.0)).gradient_clip_bounds == (None, 3.0)
    assert SGD(clipvalue=(-1.0, None)).gradient_clip_bounds == (-1.0, None)
    assert SGD(clipvalue=(None, None)).gradient_clip_bounds == (None, None)
    listed = SGD(clipvalue=[-1.0, 2.0])  # type: ignore[arg-type]
    assert listed.clipvalue == (-1.0, 2.0) and isinstance(listed.clipvalue, tuple)
    assert listed == SGD(clipvalue=(-1.0, 2.0))
    hash(listed)  # a list would make the frozen dataclass unhashable


@pytest.mark.parametrize(
    "clipvalue, match",
    [
        (-1.0, r"clipvalue.*-1.0"),
        ((2.0, 1.0), r"clipvalue.*2.0.*1.0"),
        ((1.0, 2.0, 3.0), r"clipvalue"),
    ],
)
def test_bad_clipvalue(clipvalue: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SGD(clipvalue=clipvalue)  # type: ignore[arg-type]


def test_clipvalue_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"clipvalue"):
        SGD(clipvalue="1.0")  # type: ignore[arg-type]


def test_clip_weight_bounds_ordered() -> None:
    with pytest.raises(ValueError, match=r"clip_weight_min.*clip_weight_max"):
        SGD(clip_weight_min=1.0, clip_weight_max=0.0)


# ---------------------------------------------------------------------------------------------
# TableConfig, QuantizationConfig, FeatureConfig (spec §4.1, 4.2, 2.1).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["vocabulary_size", "dim"])
@pytest.mark.parametrize("value", [0, -3, 2.0, "4", True, None])
def test_table_sizes_must_be_positive_ints(arg: str, value: object) -> None:
    kwargs: dict[str, Any] = {"vocabulary_size": 10, "dim": 4, "name": "my_table"}
    kwargs[arg] = value
    with pytest.raises(ValueError, match=rf"'my_table'.*`{arg}`.*{re.escape(repr(value))}"):
        TableConfig(**kwargs)


def test_table_initializer_must_be_callable() -> None:
    with pytest.raises(ValueError, match=r"'t'.*`initializer`"):
        TableConfig(10, 4, initializer="truncated_normal", name="t")  # type: ignore[arg-type]


@pytest.mark.parametrize("combiner", ["max", "", "avg", 1])
def test_bad_combiner(combiner: object) -> None:
    with pytest.raises(ValueError, match=rf"'t'.*`combiner`.*{re.escape(repr(combiner))}"):
        TableConfig(10, 4, combiner=combiner, name="t")  # type: ignore[arg-type]


def test_combiner_default_and_case_insensitive() -> None:
    assert TableConfig(10, 4).combiner == "mean"
    assert TableConfig(10, 4).combiner is Combiner.MEAN
    for spelling in ("MEAN", "Mean", "mean", Combiner.MEAN):
        table = TableConfig(10, 4, combiner=spelling)
        assert table.combiner == "mean"
        assert table == TableConfig(10, 4)
    assert TableConfig(10, 4, combiner="SqrtN").combiner == Combiner.SQRTN
    assert TableConfig(10, 4, combiner="Sum").combiner == "sum"


def test_table_optimizer_must_be_embedding_optimizer() -> None:
    param = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match=r"'t'.*`optimizer`.*SGD, Adagrad, AdagradMomentum, Adam, FTRL"):
        TableConfig(10, 4, optimizer=torch.optim.SGD([param], lr=0.1), name="t")  # type: ignore[arg-type]


def test_table_equality_is_by_value() -> None:
    assert TableConfig(10, 4) == TableConfig(10, 4)
    assert hash(TableConfig(10, 4)) == hash(TableConfig(10, 4))
    assert TableConfig(10, 4) != TableConfig(10, 5)


@pytest.mark.parametrize("num_buckets", [1, 0, -2, 2.5])
def test_quantization_num_buckets(num_buckets: object) -> None:
    with pytest.raises(ValueError, match=rf"`num_buckets`.*{re.escape(repr(num_buckets))}"):
        QuantizationConfig(num_buckets=num_buckets, lower=-1.0, upper=1.0)  # type: ignore[arg-type]
    assert QuantizationConfig(num_buckets=2, lower=-1.0, upper=1.0).num_buckets == 2


def test_feature_table_must_be_table_config() -> None:
    with pytest.raises(ValueError, match=r"'f'.*`table`.*dict"):
        FeatureConfig({"vocabulary_size": 10}, name="f")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 1.5, "3", None])
def test_feature_max_sequence_length(value: object) -> None:
    with pytest.raises(ValueError, match=rf"'f'.*`max_sequence_length`.*{re.escape(repr(value))}"):
        FeatureConfig(TableConfig(10, 4), max_sequence_length=value, name="f")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_feature_validate_flag_must_be_bool(value: object) -> None:
    with pytest.raises(ValueError, match=rf"'f'.*`validate_weights_and_indices`.*{re.escape(repr(value))}"):
        FeatureConfig(TableConfig(10, 4), validate_weights_and_indices=value, name="f")  # type: ignore[arg-type]


def test_feature_defaults_and_output_shape_normalised() -> None:
    feature = FeatureConfig(TableConfig(10, 4))
    assert (feature.max_sequence_length, feature.validate_weights_and_indices, feature.output_shape) == (0, True, None)
    shaped = FeatureConfig(TableConfig(10, 4), output_shape=[2, 3])  # type: ignore[arg-type]
    assert shaped.output_shape == (2, 3) and isinstance(shaped.output_shape, tuple)
    assert shaped == FeatureConfig(TableConfig(10, 4), output_shape=(2, 3))
    hash(shaped)


# ---------------------------------------------------------------------------------------------
# DistributedEmbedding construction (spec §4.3): table order and names, sharing, optimizers,
# no mutation of the caller's configs, initializers.
# ---------------------------------------------------------------------------------------------
def _table_shapes(emb: DistributedEmbedding) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in emb.embedding_tables.items()}


def test_unnamed_tables_named_in_flatten_order() -> None:
    t_v3, t_v5, t_v7, t_v9 = TableConfig(3, 2), TableConfig(5, 2), TableConfig(7, 2), TableConfig(9, 2)
    # tf.nest order: keys sorted -> "a" (t_v5), "b" (t_v3), "c"[0] (t_v9), "c"[1] (t_v3 again), "d" (t_v7).
    config = {
        "d": FeatureConfig(t_v7),
        "b": FeatureConfig(t_v3),
        "c": [FeatureConfig(t_v9), FeatureConfig(t_v3)],
        "a": FeatureConfig(t_v5),
    }
    emb = DistributedEmbedding(config, optimizer=SGD(0.1))
    assert emb.resolved_config.table_names == ("table_0", "table_1", "table_2", "table_3")
    assert _table_shapes(emb) == {"table_0": (5, 2), "table_1": (3, 2), "table_2": (9, 2), "table_3": (7, 2)}


def test_named_and_unnamed_tables_mix() -> None:
    config = {"a": FeatureConfig(TableConfig(3, 2, name="user")), "b": FeatureConfig(TableConfig(4, 2))}
    emb = DistributedEmbedding(config, optimizer=SGD(0.1))
    assert emb.resolved_config.table_names == ("user", "table_1")


@pytest.mark.parametrize("same_fields", [True, False])
def test_duplicate_table_names_raise(same_fields: bool) -> None:
    first = TableConfig(10, 4, name="video")
    second = TableConfig(10, 4, name="video") if same_fields else TableConfig(20, 8, name="video")
    config = {"a": FeatureConfig(first), "b": FeatureConfig(second)}
    with pytest.raises(ValueError, match=r"'video'"):
        DistributedEmbedding(config, optimizer=SGD(0.1))


def test_unnamed_table_colliding_with_default_name_raises() -> None:
    config = {"a": FeatureConfig(TableConfig(10, 4, name="table_1")), "b": FeatureConfig(TableConfig(5, 4))}
    with pytest.raises(ValueError, match=r"'table_1'"):
        DistributedEmbedding(config, optimizer=SGD(0.1))


def test_shared_table_object_is_one_table() -> None:
    shared = TableConfig(10, 4)
    emb = DistributedEmbedding({"a": FeatureConfig(shared), "b": FeatureConfig(shared)}, optimizer=SGD(0.1))
    assert emb.resolved_config.table_names == ("table_0",)
    assert emb.resolved_config.tables[0].feature_indices == (0, 1)
    assert list(emb.embedding_tables) == ["table_0"]


def test_equal_but_distinct_unnamed_tables_are_two_tables() -> None:
    t1, t2 = TableConfig(10, 4), TableConfig(10, 4)
    assert t1 == t2 and t1 is not t2
    emb = DistributedEmbedding({"a": FeatureConfig(t1), "b": FeatureConfig(t2)}, optimizer=SGD(0.1))
    assert emb.resolved_config.table_names == ("table_0", "table_1")
    assert [f.table_index for f in emb.resolved_config.features] == [0, 1]


def test_table_without_optimizer_raises() -> None:
    config = {"a": FeatureConfig(TableConfig(10, 4, name="lonely"))}
    with pytest.raises(ValueError, match=r"'lonely'.*optimizer"):
        DistributedEmbedding(config)


def _torch_sgd() -> object:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


@pytest.mark.parametrize(
    "make_bad",
    [_torch_sgd, lambda: torch.optim.Adam, lambda: "adagrad", lambda: object()],
    ids=["torch.optim.SGD", "torch.optim.Adam-class", "string", "object"],
)
def test_unsupported_global_optimizer_raises(make_bad: Callable[[], object]) -> None:
    config = {"a": FeatureConfig(TableConfig(10, 4))}
    with pytest.raises(ValueError, match=r"SGD, Adagrad, AdagradMomentum, Adam, FTRL"):
        DistributedEmbedding(config, optimizer=make_bad())  # type: ignore[arg-type]


def test_per_table_optimizer_overrides_global() -> None:
    own = SGD(0.5)
    config = {
        "a": FeatureConfig(TableConfig(10, 4, name="own", optimizer=own)),
        "b": FeatureConfig(TableConfig(10, 4, name="global")),
    }
    global_opt = Adagrad(0.1)
    emb = DistributedEmbedding(config, optimizer=global_opt)
    by_name = {t.name: t.optimizer for t in emb.resolved_config.tables}
    assert by_name["own"] is own and by_name["global"] is global_opt
    assert emb.slot_variables["own"] == {}
    assert list(emb.slot_variables["global"]) == ["accumulators"]


def test_per_table_optimizers_without_global() -> None:
    config = {"a": FeatureConfig(TableConfig(10, 4, optimizer=Adam(0.1)))}
    emb = DistributedEmbedding(config)
    assert list(emb.slot_variables["table_0"]) == ["momenta", "velocities"]


def test_caller_configs_never_mutated() -> None:
    t_shared = TableConfig(10, 4)
    t_own = TableConfig(6, 2, optimizer=SGD(0.3), combiner="SUM")
    f1, f2, f3 = FeatureConfig(t_shared), FeatureConfig(t_shared, max_sequence_length=2), FeatureConfig(t_own)
    config = {"z": f1, "y": [f2, f3]}
    before_tables = {id(t): dict(vars(t)) for t in (t_shared, t_own)}
    before_features = {id(f): dict(vars(f)) for f in (f1, f2, f3)}
    before_structure = {"keys": list(config), "y": list(config["y"])}

    emb = DistributedEmbedding(config, optimizer=Adagrad(0.1))
    _ = emb.embedding_tables

    assert t_shared.name is None and t_shared.optimizer is None
    assert t_own.name is None and t_own.optimizer == SGD(0.3)
    for t in (t_shared, t_own):
        assert dict(vars(t)) == before_tables[id(t)]
    for f in (f1, f2, f3):
        assert dict(vars(f)) == before_features[id(f)]
        assert f.name is None
    assert list(config) == before_structure["keys"]
    assert config["z"] is f1 and config["y"] == before_structure["y"]
    assert config["y"][0] is f2 and config["y"][1] is f3


def test_default_initializer_is_truncated_normal() -> None:
    torch.manual_seed(0)
    dim = 64
    emb = DistributedEmbedding({"a": FeatureConfig(TableConfig(1000, dim))}, optimizer=SGD(0.1))
    w = emb.embedding_tables["table_0"]
    assert w.dtype == torch.float32 and tuple(w.shape) == (1000, dim)
    bound = 2.0 / math.sqrt(dim)
    assert float(w.abs().max()) <= bound
    # Truncation at 2 sigma: std of N(0, 1) cut at +-2 is 0.8796.
    expected_std = 0.8796 / math.sqrt(dim)
    assert abs(float(w.std()) - expected_std) <= 0.1 * expected_std
    assert abs(float(w.mean())) < 0.01
    # Not a plain (untruncated) normal: that would put ~4.6% of values beyond 2 sigma, and std 1/sqrt(dim).
    assert abs(float(w.std()) - 1 / math.sqrt(dim)) > 0.05 / math.sqrt(dim)


def test_explicit_initializer_used() -> None:
    def init(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0.25, dtype=dtype)

    emb = DistributedEmbedding({"a": FeatureConfig(TableConfig(5, 3, initializer=init))}, optimizer=SGD(0.1))
    assert torch.equal(emb.embedding_tables["table_0"], torch.full((5, 3), 0.25))


def test_initializer_result_is_copied_not_aliased() -> None:
    # TF copies an initializer's value into a new variable; training must never write into the
    # caller's tensor (e.g. pretrained weights), nor link two modules built from one config.
    pretrained = torch.zeros(5, 3)

    def init(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return pretrained

    config = {"a": FeatureConfig(TableConfig(5, 3, initializer=init, name="t"))}
    first = DistributedEmbedding(config, optimizer=SGD(0.5))
    second = DistributedEmbedding(config, optimizer=SGD(0.5))
    first({"a": torch.tensor([1])})
    first.apply_gradients({"a": torch.ones(1, 3)})
    assert torch.equal(first.embedding_tables["t"][1], torch.full((3,), -0.5))
    assert torch.equal(pretrained, torch.zeros(5, 3))
    assert torch.equal(second.embedding_tables["t"], torch.zeros(5, 3))


def test_bad_initializer_return() -> None:
    def init(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape[0], shape[1] + 1)

    config = {"a": FeatureConfig(TableConfig(5, 3, initializer=init, name="t"))}
    with pytest.raises(ValueError, match=r"'t'.*initializer.*\(5, 3\).*\(5, 4\)"):
        DistributedEmbedding(config, optimizer=SGD(0.5))


def test_feature_config_leaves_must_be_feature_configs() -> None:
    with pytest.raises(ValueError, match=r"FeatureConfig.*a/1.*TableConfig"):
        DistributedEmbedding({"a": [FeatureConfig(TableConfig(5, 3)), TableConfig(5, 3)]}, optimizer=SGD(0.1))
    with pytest.raises(ValueError, match=r"feature_config.*no FeatureConfig"):
        DistributedEmbedding({}, optimizer=SGD(0.1))


def test_pipeline_flag_must_be_bool() -> None:
    config = {"a": FeatureConfig(TableConfig(5, 3))}
    with pytest.raises(TypeError, match=r"pipeline_execution_with_tensor_core.*'yes'"):
        DistributedEmbedding(config, optimizer=SGD(0.1), pipeline_execution_with_tensor_core="yes")  # type: ignore[arg-type]


class _SlotRecorder:
    """A slot_variable_creation_fn that records its arguments and returns distinctive slots."""

    def __init__(self, result: Callable[[torch.Tensor, list[str]], dict[str, torch.Tensor]] | None = None) -> None:
        self.calls: list[tuple[torch.Tensor, list[str], list[Any]]] = []
        self.result = result

    def __call__(self, table: torch.Tensor, slot_names: list[str], initializers: list[Any]) -> dict[str, Any]:
        self.calls.append((table.clone(), list(slot_names), list(initializers)))
        if self.result is not None:
            return self.result(table, slot_names)
        return {name: torch.full(table.shape, 0.5 + i, dtype=torch.float32) for i, name in enumerate(slot_names)}


def test_slot_variable_creation_fn_called_and_used() -> None:
    recorder = _SlotRecorder()

    def init(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.arange(math.prod(shape), dtype=dtype).reshape(shape)

    opt = FTRL(0.1, initial_accumulator_value=0.3, slot_variable_creation_fn=recorder)
    emb = DistributedEmbedding({"a": FeatureConfig(TableConfig(5, 3, initializer=init, name="t"))}, optimizer=opt)
    assert len(recorder.calls) == 1
    table, names, inits = recorder.calls[0]
    assert torch.equal(table, torch.arange(15, dtype=torch.float32).reshape(5, 3))
    assert isinstance(names, list) and names == ["accumulators", "linears"]
    assert isinstance(inits, list) and len(inits) == 2
    # The initializers are TF-style callables for the default slot values.
    assert torch.equal(inits[0]((5, 3), torch.float32), torch.full((5, 3), 0.3))
    assert torch.equal(inits[1]((5, 3), torch.float32), torch.zeros(5, 3))
    slots = emb.slot_variables["t"]
    assert torch.equal(slots["accumulators"], torch.full((5, 3), 0.5))
    assert torch.equal(slots["linears"], torch.full((5, 3), 1.5))


@pytest.mark.parametrize(
    "bad_result, match",
    [
        (lambda t, names: {"accumulators": torch.zeros(t.shape)}, r"'t'.*slot_variable_creation_fn.*linears"),
        (
            lambda t, names: {n: torch.zeros(t.shape[0] + 1, t.shape[1]) for n in names},
            r"'t'.*slot_variable_creation_fn.*\(6, 3\)",
        ),
        (
            lambda t, names: {**{n: torch.zeros(t.shape) for n in names}, "extra": torch.zeros(t.shape)},
            r"'t'.*slot_variable_creation_fn.*extra",
        ),
        (lambda t, names: [torch.zeros(t.shape) for _ in names], r"'t'.*slot_variable_creation_fn.*list"),
        (
            lambda t, names: {n: torch.zeros(t.shape, dtype=torch.int64) for n in names},
            r"'t'.*slot_variable_creation_fn.*int64",
        ),
    ],
    ids=["missing-key", "wrong-shape", "extra-key", "not-a-dict", "int-dtype"],
)
def test_slot_variable_creation_fn_bad_return(bad_result: Callable[[torch.Tensor, list[str]], Any], match: str) -> None:
    opt = FTRL(0.1, slot_variable_creation_fn=_SlotRecorder(bad_result))
    with pytest.raises(ValueError, match=match):
        DistributedEmbedding({"a": FeatureConfig(TableConfig(5, 3, name="t"))}, optimizer=opt)


def test_slot_defaults_without_creation_fn() -> None:
    emb = DistributedEmbedding(
        {"a": FeatureConfig(TableConfig(5, 3, name="t"))}, optimizer=Adagrad(0.1, initial_accumulator_value=0.7)
    )
    assert torch.equal(emb.slot_variables["t"]["accumulators"], torch.full((5, 3), 0.7))
