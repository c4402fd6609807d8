"""Issue 6, numeric classes: values validated as the float32 the kernels use (6), the kernel paths agree
(11), derived constants in float32 as TF computes them (14), clear messages for learning-rate callables (13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from oracle.np_optimizers import update_row
from statecheck import assert_same, snapshot
from torch import Tensor

import embtables as et
from embtables.kernels import native

# ---------------------------------------------------------------------------------------------
# 6. Config values are validated as float32.
# ---------------------------------------------------------------------------------------------
BAD_CONFIGS: list[tuple[str, Callable[[], object], str]] = [
    ("sgd-lr-overflows", lambda: et.SGD(1e39), r"SGD: `learning_rate`.*float32"),
    ("decay-overflows", lambda: et.SGD(0.1, weight_decay_factor=1e39), r"`weight_decay_factor`.*float32"),
    ("clip-overflows", lambda: et.Adagrad(0.1, clipvalue=1e39), r"`clipvalue`.*float32"),
    ("weight-clip-overflows", lambda: et.SGD(0.1, clip_weight_max=-1e39), r"`clip_weight_max`.*float32"),
    ("adagrad-acc-underflows", lambda: et.Adagrad(0.1, initial_accumulator_value=1e-46), r"`initial_accumulator"),
    ("adam-eps-squared-underflows", lambda: et.Adam(0.1, epsilon=1e-25), r"Adam: `epsilon`.*squared underflows"),
    ("momentum-beta2-above-1", lambda: et.AdagradMomentum(0.1, beta2=2.0), r"`beta2` must be in \(0, 1\]"),
    ("momentum-beta2-zero", lambda: et.AdagradMomentum(0.1, beta2=0.0), r"`beta2` must be in \(0, 1\]"),
    ("momentum-precond-overflows", lambda: et.AdagradMomentum(0.1, epsilon=1e-30, exponent=0.5), r"overflows"),
    ("ftrl-lr-zero", lambda: et.FTRL(learning_rate=0.0), r"FTRL: `learning_rate`.*0 in float32"),
    ("ftrl-negative-l1", lambda: et.FTRL(0.1, l1_regularization_strength=-0.1), r"`l1_regularization_strength`"),
    ("ftrl-negative-l2", lambda: et.FTRL(0.1, l2_regularization_strength=-0.1), r"`l2_regularization_strength`"),
    ("ftrl-negative-beta", lambda: et.FTRL(0.1, beta=-1.0), r"`beta` must be >= 0"),
    ("ftrl-positive-power", lambda: et.FTRL(0.1, learning_rate_power=0.5), r"`learning_rate_power` must be <= 0"),
    ("ftrl-acc-underflows", lambda: et.FTRL(0.1, initial_accumulator_value=1e-46), r"`initial_accumulator"),
]


@pytest.mark.parametrize("make, match", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_config_values_are_validated_as_float32(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_legal_edge_values_are_accepted() -> None:
    et.Adam(0.1, epsilon=1e-15)  # eps^2 = 1e-30 is a normal float32
    et.AdagradMomentum(0.1, beta2=1.0)
    et.FTRL(0.0, multiply_linear_by_learning_rate=True)  # nothing divides by lr in this form
    et.SGD(-0.1)  # TF accepts negative learning rates


# ---------------------------------------------------------------------------------------------
# Dynamic learning rates: checked, wrapped, named.
# ---------------------------------------------------------------------------------------------
def _make_lr(lr: Any, opt: type = et.Adagrad) -> et.DistributedEmbedding:
    t = et.TableConfig(8, 2, name="t", initializer=et.Constant(0.5))
    return et.DistributedEmbedding({"f": et.FeatureConfig(t)}, opt(lr))


def _boom() -> float:
    raise KeyError("schedule not ready")


BAD_LRS: list[tuple[str, Any, type, type[Exception], str]] = [
    ("returns-str", lambda: "0.1", et.Adagrad, TypeError, r"table 't'.*must return a float, got str"),
    ("returns-bool", lambda: True, et.Adagrad, TypeError, r"table 't'.*must return a float, got bool"),
    ("raises", _boom, et.Adagrad, RuntimeError, r"table 't'.*raised KeyError.*schedule not ready"),
    ("wrong-arity", lambda step: 0.1, et.Adagrad, TypeError, r"table 't'.*zero-argument callable"),
    ("overflows-float32", lambda: 1e39, et.Adagrad, ValueError, r"table 't'.*not finite in float32"),
    ("nan", lambda: math.nan, et.Adagrad, ValueError, r"table 't'.*not finite"),
    ("ftrl-zero", lambda: 0.0, et.FTRL, ValueError, r"table 't'.*0 in float32.*FTRL"),
]


@pytest.mark.parametrize("lr, opt, exc, match", [c[1:] for c in BAD_LRS], ids=[c[0] for c in BAD_LRS])
def test_bad_learning_rate_callables_raise_and_change_nothing(
    lr: Any, opt: type, exc: type[Exception], match: str, kernel_path: str
) -> None:
    m = _make_lr(lr, opt)
    before = snapshot(m)
    acts = m({"f": torch.tensor([[1, 2]])})
    for _ in range(2):  # the second step is refused the same way (the arity check is remembered per callable)
        with pytest.raises(exc, match=match):
            m.apply_gradients({"f": torch.ones_like(acts["f"])})
        assert_same(snapshot(m), before)


def test_learning_rate_plans_keep_nothing_alive_past_their_module() -> None:
    """The per-config learning-rate plan lives on the module's tables: a schedule that captures a big
    object (an Estimator, its model) is released with the module, not kept by a process-wide cache."""
    import gc
    import weakref

    class Holder:
        rate = 0.1

    holder = Holder()
    gone = weakref.ref(holder)
    m = _make_lr(lambda h=holder: h.rate)
    acts = m({"f": torch.tensor([[1]])})
    m.apply_gradients({"f": torch.ones_like(acts["f"])})
    del m, acts, holder
    gc.collect()
    assert gone() is None


def test_learning_rate_callable_returning_numpy_and_tensor_scalars_work() -> None:
    for value in (np.float32(0.1), torch.tensor(0.1), 1):
        m = _make_lr(lambda value=value: value)
        acts = m({"f": torch.tensor([[1]])})
        m.apply_gradients({"f": torch.ones_like(acts["f"])})


# ---------------------------------------------------------------------------------------------
# load_state_dict checks values as float32 and each slot's domain.
# ---------------------------------------------------------------------------------------------
def _three_tables() -> et.DistributedEmbedding:
    feats = {
        "a": et.FeatureConfig(et.TableConfig(4, 2, name="ada", optimizer=et.Adagrad(0.1))),
        "b": et.FeatureConfig(et.TableConfig(4, 2, name="adam", optimizer=et.Adam(0.1))),
        "c": et.FeatureConfig(et.TableConfig(4, 2, name="ftrl", optimizer=et.FTRL(0.1, allow_zero_accumulator=True))),
    }
    return et.DistributedEmbedding(feats)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("ada", torch.full((4, 2), 1e39, dtype=torch.float64), r"'ada'.*finite float32"),
        ("ada/accumulators", torch.zeros(4, 2), r"'ada/accumulators'.*must be >= 1.1754944e-38"),
        ("ada/accumulators", torch.full((4, 2), 1e-46, dtype=torch.float64), r"must be >= 1.17"),  # 0 in float32
        ("ada/accumulators", torch.full((4, 2), 1e-39), r"must be >= 1.17.*subnormal"),  # read as 0 (spec §1.5)
        ("adam/velocities", -torch.ones(4, 2), r"'adam/velocities'.*must be >= 0"),
        ("ftrl/accumulators", -torch.ones(4, 2), r"'ftrl/accumulators'.*must be >= 0"),
    ],
)
def test_loaded_values_are_checked_as_float32_and_in_their_slot_domain(key: str, value: Tensor, match: str) -> None:
    m = _three_tables()
    before = snapshot(m)
    sd = {k: v.clone() for k, v in before.items()}
    sd[key] = value
    with pytest.raises(RuntimeError, match=match):
        m.load_state_dict(sd)
    assert_same(snapshot(m), before)


def test_the_smallest_normal_accumulator_loads() -> None:
    """2^-126 is the smallest normal float32: a positive slot may hold it (spec §1.5)."""
    m = _three_tables()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["ada/accumulators"] = torch.full((4, 2), torch.finfo(torch.float32).tiny)
    m.load_state_dict(sd)
    assert torch.equal(m.state_dict()["ada/accumulators"], sd["ada/accumulators"])


def test_ftrl_allow_zero_accumulator_loads_zero_and_agrees_on_both_paths() -> None:
    results = {}
    for path in ("native", "torch"):
        native.set_enabled(path == "native")
        try:
            t = et.TableConfig(4, 2, name="t", initializer=et.Constant(0.5))
            opt = et.FTRL(0.1, allow_zero_accumulator=True, beta=0.1)
            m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, opt)
            sd = m.state_dict()
            sd["t/accumulators"] = torch.zeros(4, 2)
            sd["t/linears"] = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, -2.0], [0.0, 0.0]])
            m.load_state_dict(sd)
            acts = m({"f": torch.tensor([[0, 1, 2]])})
            m.apply_gradients({"f": torch.zeros_like(acts["f"])})  # zero gradient: n stays 0, 0/0 must not be NaN
            results[path] = snapshot(m)
        finally:
            native.set_enabled(True)
    for v in results["native"].values():
        assert bool(torch.isfinite(v).all())
    assert_same(results["native"], results["torch"])
    assert float(results["native"]["t"][1, 0]) == 0.0  # z = 0, n = 0: 0 / (beta / lr), no NaN
    # With beta = l2 = 0 a zero accumulator and z != 0 give w = -z / 0: refused, never written as inf.
    t = et.TableConfig(4, 2, name="t", initializer=et.Constant(0.5))
    m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.FTRL(0.1, allow_zero_accumulator=True))
    sd = m.state_dict()
    sd["t/accumulators"] = torch.zeros(4, 2)
    sd["t/linears"] = torch.ones(4, 2)
    m.load_state_dict(sd)
    acts = m({"f": torch.tensor([[2]])})
    with pytest.raises(ValueError, match="non-finite"):
        m.apply_gradients({"f": torch.zeros_like(acts["f"])})


# ---------------------------------------------------------------------------------------------
# 11. The kernel paths agree bit for bit (the torch path is strict float32 too).
# ---------------------------------------------------------------------------------------------
PATH_OPTIMIZERS = {
    "sgd": et.SGD(0.3, weight_decay_factor=0.01, multiply_weight_decay_factor_by_learning_rate=True),
    "adagrad": et.Adagrad(0.3, clipvalue=0.8),
    "adam": et.Adam(0.05, beta_1=0.85, beta_2=0.995),
    "adam-non-lazy": et.Adam(0.05, lazy_adam=False, sum_inside_sqrt=False),
    "ftrl": et.FTRL(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.1, beta=0.2),
    "ftrl-multiply": et.FTRL(0.2, multiply_linear_by_learning_rate=True, l1_regularization_strength=0.01),
}


@pytest.mark.parametrize("name", sorted(PATH_OPTIMIZERS))
def test_native_and_torch_paths_are_bit_identical(name: str) -> None:
    results = {}
    for path in ("native", "torch"):
        native.set_enabled(path == "native")
        try:
            t = et.TableConfig(30, 8, name="t", initializer=et.TruncatedNormal(seed=4))
            m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, PATH_OPTIMIZERS[name])
            gen = torch.Generator().manual_seed(9)
            for _ in range(4):
                acts = m({"f": torch.randint(0, 30, (16, 3), generator=gen)})
                m.apply_gradients({"f": torch.randn(acts["f"].shape, generator=gen)})
            results[path] = snapshot(m)
        finally:
            native.set_enabled(True)
    assert_same(results["native"], results["torch"])


# ---------------------------------------------------------------------------------------------
# 14. Derived constants are float32, as TF computes them: visible in Adam's velocities.
# ---------------------------------------------------------------------------------------------
def test_adam_one_minus_beta_is_computed_in_float32(kernel_path: str) -> None:
    """v = (1 - beta_2) g^2 with 1 - beta_2 derived in float32 from float32(0.999): 1.3e-5 relative away
    from the float64-derived constant, so a regression to float64 constants fails here."""
    t = et.TableConfig(4, 1, name="t", initializer=et.Constant(0.0))
    m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adam(0.01, beta_1=0.9, beta_2=0.999))
    acts = m({"f": torch.tensor([[1]])})
    m.apply_gradients({"f": torch.full_like(acts["f"], 2.0)})
    v = float(m.slot_variables["t"]["velocities"][1, 0])
    mom = float(m.slot_variables["t"]["momenta"][1, 0])
    tf_v = float((np.float32(1.0) - np.float32(0.999)) * np.float32(4.0))
    tf_m = float((np.float32(1.0) - np.float32(0.9)) * np.float32(2.0))
    assert v == tf_v and mom == tf_m
    assert abs(v - float(np.float32((1.0 - 0.999) * 4.0))) > 1e-5 * v  # the float64 constant is visibly different


def test_adam_cancelling_updates_match_the_float32_constant_oracle(kernel_path: str) -> None:
    """Several Adam steps with alternating gradients, whose update cancels to near zero, against the
    float64 oracle that derives constants in float32: tight tolerance (a float64-constant engine is off)."""
    opt_cfg = {"name": "Adam", "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "lazy_adam": True}
    t = et.TableConfig(2, 3, name="t", initializer=et.Constant(0.25))
    m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adam(0.1, beta_1=0.9, beta_2=0.999))
    w = np.full(3, 0.25)
    slots = {"momenta": np.zeros(3), "velocities": np.zeros(3)}
    lr = float(np.float32(0.1))
    for step in range(8):
        g = np.array([1.0, -1.0, 0.5]) * (1 if step % 2 == 0 else -1)
        m({"f": torch.tensor([[1]])})
        m.apply_gradients({"f": torch.tensor(g, dtype=torch.float32).reshape(1, 1, 3)})
        w, slots = update_row(opt_cfg, w, slots, g, lr)
    np.testing.assert_allclose(m.embedding_tables["t"][1].double().numpy(), w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(
        m.slot_variables["t"]["velocities"][1].double().numpy(), slots["velocities"], rtol=1e-6, atol=0
    )


# ---------------------------------------------------------------------------------------------
# 12. No-accumulation on the torch path: vectorised for SGD and Adagrad (no Python round per repeat).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opt", [et.SGD(0.05, use_gradient_accumulation=False), et.Adagrad(0.05, use_gradient_accumulation=False)]
)
def test_no_accumulation_with_a_hot_id_matches_native_and_oracle(opt: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.zeros(3000, dtype=torch.int64), torch.randint(0, 40, (500,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].reshape(-1, 1)
    grads = torch.randn(ids.shape[0], 1, 4, generator=gen)
    results = {}
    for path in ("native", "torch"):
        native.set_enabled(path == "native")
        try:
            t = et.TableConfig(40, 4, name="t", initializer=et.TruncatedNormal(seed=6))
            m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, opt)
            m({"f": ids})
            m.apply_gradients({"f": grads})
            results[path] = snapshot(m)
        finally:
            native.set_enabled(True)
    if isinstance(opt, et.SGD):
        assert_same(results["native"], results["torch"])  # index_add_ adds in order: bit-identical
    else:
        for key in results["native"]:
            torch.testing.assert_close(results["torch"][key], results["native"][key], rtol=2e-6, atol=1e-7)
    # The float64 oracle, one occurrence at a time in order (spec §10.2).
    w = et.TruncatedNormal(seed=6)((40, 4)).double().numpy()
    acc = np.full((40, 4), 0.1)
    for row, g in zip(ids.reshape(-1).tolist(), grads.reshape(-1, 4).double().numpy()):
        if isinstance(opt, et.SGD):
            w[row] = w[row] - float(np.float32(0.05)) * g
        else:
            acc[row] = acc[row] + g * g
            w[row] = w[row] - float(np.float32(0.05)) * g / np.sqrt(acc[row])
    np.testing.assert_allclose(results["torch"]["t"].double().numpy(), w, rtol=1e-4, atol=1e-5)
