"""Self-checks of the float64 oracle against numbers computed by hand from docs/spec.md, sections 1, 2 and 10."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from .np_embedding import lookup, occurrences
from .np_engine import OracleEngine
from .np_optimizers import init_slots, slot_names, update_row

T4x2 = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])


def _row(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def F(*xs: float) -> float:
    """The float32 product of ``xs``: hyper-parameters and derived constants are float32 (spec §1, issue 6)."""
    out = np.float32(xs[0])
    for x in xs[1:]:
        out = np.float32(out * np.float32(x))
    return float(out)


def one_minus(x: float) -> float:
    return float(np.float32(1.0) - np.float32(x))


def _close(actual: Any, expected: Any) -> None:
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- optimizers


def test_slot_names_and_init() -> None:
    assert slot_names({"name": "SGD"}) == []
    assert slot_names({"name": "Adagrad"}) == ["accumulators"]
    assert slot_names({"name": "AdagradMomentum"}) == ["accumulators", "momenta"]
    assert slot_names({"name": "Adam"}) == ["momenta", "velocities"]
    assert slot_names({"name": "FTRL"}) == ["accumulators", "linears"]
    s = init_slots({"name": "Adagrad"}, 3, 2)
    _close(s["accumulators"], np.full((3, 2), 0.1))
    s = init_slots({"name": "FTRL", "initial_accumulator_value": 0.7}, 2, 1)
    _close(s["accumulators"], [[0.7], [0.7]])
    _close(s["linears"], [[0.0], [0.0]])
    s = init_slots({"name": "AdagradMomentum", "epsilon": 0.5}, 1, 1)
    _close(s["accumulators"], [[0.0]])  # epsilon is not the initial accumulator
    assert s["accumulators"].dtype == np.float64
    with pytest.raises(ValueError):
        slot_names({"name": "Lion"})


def test_sgd() -> None:
    w, slots = update_row({"name": "SGD"}, _row([1.0, -2.0]), {}, _row([0.5, 1.0]), 0.1)
    _close(w, [1.0 - 0.05, -2.0 - 0.1])
    assert slots == {}


def test_adagrad_one_step() -> None:
    # a = 0.1 + 0.5^2 = 0.35; w -= 0.1*0.5/sqrt(0.35) (new accumulator, no epsilon)
    opt = {"name": "Adagrad", "initial_accumulator_value": 0.1}
    w, slots = update_row(opt, _row([1.0]), {"accumulators": _row([0.1])}, _row([0.5]), 0.1)
    _close(slots["accumulators"], [0.35])
    _close(w, [1.0 - 0.1 * 0.5 / math.sqrt(0.35)])


def test_adagrad_momentum_nesterov() -> None:
    opt = {"name": "AdagradMomentum", "momentum": 0.5, "use_nesterov": True, "exponent": 2, "epsilon": 1e-10}
    slots = {"accumulators": _row([0.0]), "momenta": _row([0.0])}
    w, new = update_row(opt, _row([1.0]), slots, _row([2.0]), 0.1)
    a = 0.0 + 4.0
    s = (a + 1e-10) ** (-1.0 / 2.0) * 2.0
    m = 0.5 * 0.0 + s
    u = 0.5 * m + s
    _close(new["accumulators"], [a])
    _close(new["momenta"], [m])
    _close(w, [1.0 - 0.1 * u])


def test_adagrad_momentum_beta2_two_steps() -> None:
    opt = {"name": "AdagradMomentum", "momentum": 0.9, "exponent": 4.0, "beta2": 0.5, "epsilon": 1e-10}
    slots = {"accumulators": _row([0.0]), "momenta": _row([0.0])}
    w1, s1 = update_row(opt, _row([1.0]), slots, _row([2.0]), 0.1)
    a1 = 0.5 * 0.0 + 0.5 * 4.0  # = 2
    sc1 = (a1 + F(1e-10)) ** -0.25 * 2.0
    m1 = sc1
    _close(w1, [1.0 - 0.1 * m1])
    w2, s2 = update_row(opt, w1, s1, _row([1.0]), 0.1)
    a2 = 0.5 * 2.0 + 0.5 * 1.0  # = 1.5
    sc2 = (a2 + F(1e-10)) ** -0.25 * 1.0
    m2 = F(0.9) * m1 + sc2
    _close(s2["accumulators"], [1.5])
    _close(s2["momenta"], [m2])
    _close(w2, [1.0 - 0.1 * m1 - 0.1 * m2])


@pytest.mark.parametrize("sum_inside_sqrt", [True, False])
def test_adam(sum_inside_sqrt: bool) -> None:
    opt = {"name": "Adam", "sum_inside_sqrt": sum_inside_sqrt}  # defaults 0.9, 0.999, 1e-7
    slots = {"momenta": _row([0.0]), "velocities": _row([0.0])}
    w, new = update_row(opt, _row([1.0]), slots, _row([0.5]), 0.01)
    m = one_minus(0.9) * 0.5  # 0.05, with 1 - beta_1 derived in float32
    v = one_minus(0.999) * 0.25  # 0.00025 (1 - beta_2 in float32 is 1.3e-5 relative off 0.001)
    denom = math.sqrt(v + F(1e-7, 1e-7)) if sum_inside_sqrt else math.sqrt(v) + F(1e-7)
    _close(new["momenta"], [m])
    _close(new["velocities"], [v])
    _close(w, [1.0 - 0.01 * m / denom])  # no bias correction


@pytest.mark.parametrize("multiply_linear", [False, True])
def test_ftrl_default(multiply_linear: bool) -> None:
    opt = {"name": "FTRL", "multiply_linear_by_learning_rate": multiply_linear}
    slots = {"accumulators": _row([0.1]), "linears": _row([0.0])}
    w, new = update_row(opt, _row([1.0]), slots, _row([0.5]), 0.1)
    n_new = 0.35
    delta = math.sqrt(0.35) - math.sqrt(0.1)
    z = 0.5 - delta / 0.1 * 1.0
    w_expected = -z / (math.sqrt(n_new) / 0.1)
    _close(new["accumulators"], [n_new])
    _close(new["linears"], [0.1 * z if multiply_linear else z])  # the slot stores lr*z when multiplied
    _close(w, [w_expected])


@pytest.mark.parametrize("multiply_linear", [False, True])
def test_ftrl_l1_l2_beta(multiply_linear: bool) -> None:
    opt = {
        "name": "FTRL",
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.2,
        "beta": 0.3,
        "multiply_linear_by_learning_rate": multiply_linear,
    }
    slots = {"accumulators": _row([0.1]), "linears": _row([0.0])}
    w, _ = update_row(opt, _row([1.0]), slots, _row([0.5]), 0.1)
    delta = math.sqrt(0.35) - math.sqrt(0.1)
    if not multiply_linear:
        z = 0.5 - delta / 0.1  # about -2.254, so |z| > l1
        numer = -F(0.01) - z  # clamp(z, -l1, l1) - z with z < -l1
        denom = (math.sqrt(0.35) + F(0.3)) / 0.1 + F(2.0, 0.2)
    else:  # the linears slot holds lr * z; constants lr * l1 and 2 * lr * l2 derived in float32
        z = 0.1 * 0.5 - delta
        numer = -F(0.1, 0.01) - z
        denom = math.sqrt(0.35) + F(2.0, 0.1, 0.2) + F(0.3)
    assert z < -0.01
    _close(w, [numer / denom])


def test_ftrl_l1_zeroes_weight() -> None:
    opt = {"name": "FTRL", "l1_regularization_strength": 1.0}
    slots = {"accumulators": _row([0.1]), "linears": _row([0.0])}
    w, new = update_row(opt, _row([0.0]), slots, _row([0.5]), 0.1)
    _close(new["linears"], [0.5])  # z = 0 + 0.5 - delta/lr * 0
    _close(w, [0.0])  # |z| = 0.5 < l1 = 1


def test_ftrl_learning_rate_power_zero() -> None:
    opt = {"name": "FTRL", "learning_rate_power": 0.0}
    slots = {"accumulators": _row([0.1]), "linears": _row([0.0])}
    w, new = update_row(opt, _row([1.0]), slots, _row([0.5]), 0.1)
    # n^0 = 1 so delta = 0, z = 0.5, w = -0.5 / (1/0.1)
    _close(new["linears"], [0.5])
    _close(w, [-0.05])


def test_ftrl_allow_zero_accumulator() -> None:
    base = {"name": "FTRL", "initial_accumulator_value": 0.0, "learning_rate_power": 0.0}
    slots = {"accumulators": _row([0.0]), "linears": _row([0.0])}
    # With the flag: 0**0 -> 0 (spec §10.3), 0.25**0 = 1, delta = 1, z = 0.5 - 1/0.1*1 = -9.5, w = 9.5/(1/0.1)
    w, new = update_row({**base, "allow_zero_accumulator": True}, _row([1.0]), slots, _row([0.5]), 0.1)
    _close(new["linears"], [-9.5])
    _close(w, [0.95])
    # Without the flag: 0**0 = 1, delta = 0, z = 0.5, w = -0.05
    w, new = update_row({**base, "allow_zero_accumulator": False}, _row([1.0]), slots, _row([0.5]), 0.1)
    _close(new["linears"], [0.5])
    _close(w, [-0.05])
    # A zero accumulator that stays zero (g = 0), beta = l2 = 0: the flag gives w = 0, not NaN.
    opt = {"name": "FTRL", "initial_accumulator_value": 0.0, "allow_zero_accumulator": True}
    w, new = update_row(opt, _row([1.0]), slots, _row([0.0]), 0.1)
    _close(new["accumulators"], [0.0])
    _close(w, [0.0])
    assert np.all(np.isfinite(w))


def test_weight_decay_with_and_without_lr_multiplier() -> None:
    g = _row([0.5])
    # lambda_eff = 0.1: w = 2 - 0.1*2 - 0.5*0.5 = 1.55
    w, _ = update_row({"name": "SGD", "weight_decay_factor": 0.1}, _row([2.0]), {}, g, 0.5)
    _close(w, [2.0 - F(0.1) * 2.0 - 0.25])  # 1.55 with lambda as float32
    # lambda_eff = 0.1*0.5 = 0.05 (in float32): w = 2 - 0.1 - 0.25 = 1.65
    opt = {"name": "SGD", "weight_decay_factor": 0.1, "multiply_weight_decay_factor_by_learning_rate": True}
    w, _ = update_row(opt, _row([2.0]), {}, g, 0.5)
    _close(w, [2.0 - F(0.1, 0.5) * 2.0 - 0.25])
    # 0 means off; the multiply flag alone does nothing
    w, _ = update_row({"name": "SGD", "weight_decay_factor": 0.0}, _row([2.0]), {}, g, 0.5)
    _close(w, [1.75])
    opt = {"name": "SGD", "multiply_weight_decay_factor_by_learning_rate": True}
    w, _ = update_row(opt, _row([2.0]), {}, g, 0.5)
    _close(w, [1.75])
    # Adagrad: w_new = w - lambda*w - lr*g/sqrt(a_new)
    opt = {"name": "Adagrad", "weight_decay_factor": 0.1}
    w, _ = update_row(opt, _row([2.0]), {"accumulators": _row([0.1])}, g, 0.5)
    _close(w, [2.0 - F(0.1) * 2.0 - 0.5 * 0.5 / math.sqrt(0.35)])


def test_weight_decay_ftrl_enters_linear() -> None:
    opt = {"name": "FTRL", "weight_decay_factor": 0.5}
    slots = {"accumulators": _row([0.1]), "linears": _row([0.0])}
    w, new = update_row(opt, _row([1.0]), slots, _row([0.5]), 0.1)
    w_decayed = 1.0 - 0.5 * 1.0
    z = 0.5 - (math.sqrt(0.35) - math.sqrt(0.1)) / 0.1 * w_decayed
    _close(new["linears"], [z])
    _close(w, [-z / (math.sqrt(0.35) / 0.1)])


def test_gradient_clip() -> None:
    g = _row([-5.0, 0.5])
    w0 = _row([0.0, 0.0])
    w, _ = update_row({"name": "SGD", "clipvalue": (None, 0.2)}, w0, {}, g, 1.0)
    _close(w, [5.0, -0.2])  # lower side unbounded
    w, _ = update_row({"name": "SGD", "clipvalue": (None, 0.2), "clipping_limit": 1.0}, w0, {}, g, 1.0)
    _close(w, [1.0, -0.2])  # tighter bound on each side
    w, _ = update_row({"name": "SGD", "clipvalue": 0.3, "clipping_limit": 1.0}, w0, {}, g, 1.0)
    _close(w, [0.3, -0.3])
    w, _ = update_row({"name": "SGD", "clipping_limit": 0.4}, w0, {}, g, 1.0)
    _close(w, [0.4, -0.4])


def test_weight_clip() -> None:
    opt = {"name": "SGD", "clip_weight_min": -1.0, "clip_weight_max": None}
    w, _ = update_row(opt, _row([0.0, 0.0]), {}, _row([-5.0, 5.0]), 1.0)
    _close(w, [5.0, -1.0])
    opt = {"name": "Adagrad", "clip_weight_max": 0.5}
    w, s = update_row(opt, _row([0.0]), {"accumulators": _row([0.1])}, _row([-3.0]), 1.0)
    _close(w, [0.5])
    _close(s["accumulators"], [9.1])  # slots are not clipped


# ---------------------------------------------------------------------------------------------- lookups


def test_combiners_with_weights() -> None:
    ids = [[0, 1, 1]]
    weights = [[1.0, 2.0, 0.5]]
    total = [1.0 + 6.0 + 1.5, 2.0 + 8.0 + 2.0]  # 1*T0 + 2*T1 + 0.5*T1
    _close(lookup(T4x2, ids, weights, "sum"), [total])
    _close(lookup(T4x2, ids, weights, "mean"), [[total[0] / 3.5, total[1] / 3.5]])
    r = math.sqrt(1.0 + 4.0 + 0.25)
    _close(lookup(T4x2, ids, weights, "sqrtn"), [[total[0] / r, total[1] / r]])
    _close(lookup(T4x2, [[2, 3]], None, "mean"), [[6.0, 7.0]])  # weights default to 1


def test_empty_samples_give_zeros() -> None:
    for combiner in ("sum", "mean", "sqrtn"):
        out = lookup(T4x2, [[], [1], [-1]], None, combiner)
        _close(out, [[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    # validate=False keeps non-positive weights; weights summing to 0 give the zero vector
    _close(lookup(T4x2, [[0, 1]], [[1.0, -1.0]], "mean", validate=False), [[0.0, 0.0]])


def test_dropping_rules() -> None:
    # validate=True drops id < 0 and weight <= 0
    _close(lookup(T4x2, [[0, -1, 2, 3]], [[1.0, 5.0, 0.0, -1.0]], "mean"), [[1.0, 2.0]])
    _close(lookup(T4x2, [[0, 2]], [[2.0, -1.0]], "mean"), [[1.0, 2.0]])
    # validate=False keeps weight -1: (2*T0 - T2)/(2 - 1)
    _close(lookup(T4x2, [[0, 2]], [[2.0, -1.0]], "mean", validate=False), [[-3.0, -2.0]])
    with pytest.raises(ValueError):
        lookup(T4x2, [[0, -1]], None, "sum", validate=False)
    with pytest.raises(ValueError):
        lookup(T4x2, [[4]], None, "sum")
    with pytest.raises(ValueError):
        lookup(T4x2, [[4]], [[0.0]], "sum")  # id >= V raises even with a weight that would be dropped
    with pytest.raises(ValueError):
        lookup(T4x2, [[0]], [[float("nan")]], "sum")
    with pytest.raises(ValueError):
        lookup(T4x2, [[0]], [[float("inf")]], "sum", validate=False)
    with pytest.raises(ValueError):
        lookup(T4x2, [[0, 1]], [[1.0]], "sum")  # ragged shapes differ


def test_sequence_truncation_and_padding() -> None:
    out = lookup(T4x2, [[0, 1, 2], [3], [], [-1, 2]], None, "sum", max_sequence_length=2)
    expected = [
        [[1.0, 2.0], [3.0, 4.0]],  # column 2 truncated
        [[7.0, 8.0], [0.0, 0.0]],  # missing position zero
        [[0.0, 0.0], [0.0, 0.0]],  # empty sample
        [[0.0, 0.0], [5.0, 6.0]],  # dropped negative id leaves a zero at its own position
    ]
    _close(out, expected)
    with pytest.raises(ValueError):
        lookup(T4x2, [[0]], [[1.0]], "sum", max_sequence_length=2)  # no weights for sequences


def test_quantization() -> None:
    table = np.array([[0.3, 2.6, 5.0, -1.0]])
    # q = (4 - 0)/(5 - 1) = 1; clamp to [0, 4]; floor(x + 0.5)
    _close(lookup(table, [[0]], None, "sum", quantization=(5, 0.0, 4.0)), [[0.0, 3.0, 4.0, 0.0]])
    table = np.array([[0.4, -0.6, 2.0]])
    # q = 1; floor(x + 1 + 0.5) - 1 after clamping to [-1, 1]
    _close(lookup(table, [[0, 0]], None, "mean", quantization=(3, -1.0, 1.0)), [[0.0, -1.0, 1.0]])
    with pytest.raises(ValueError):
        lookup(table, [[0]], None, "sum", quantization=(1, -1.0, 1.0))


def test_occurrences_pooled_and_sequence() -> None:
    g = np.array([[1.0, 2.0], [10.0, 20.0]])
    occ = occurrences([[0, 1], [2]], [[1.0, 3.0], [2.0]], "mean", 0, g)
    assert [(b, k, r) for b, k, r, _ in occ] == [(0, 0, 0), (0, 1, 1), (1, 0, 2)]
    _close(occ[0][3], [0.25, 0.5])  # s_0 = 1/4, w = 1
    _close(occ[1][3], [0.75, 1.5])  # s_0 = 1/4, w = 3
    _close(occ[2][3], [10.0, 20.0])  # s_1 = 1/2, w = 2
    gs = np.arange(1.0, 5.0).reshape(1, 2, 2)
    occ = occurrences([[0, -1, 2]], None, "sum", 2, gs)
    assert len(occ) == 1  # position 1 dropped, position 2 truncated
    assert occ[0][:3] == (0, 0, 0)
    _close(occ[0][3], [1.0, 2.0])
    with pytest.raises(ValueError):
        occurrences([[7]], None, "sum", 0, np.zeros((1, 2)), vocab_size=4)


# ---------------------------------------------------------------------------------------------- engine


def _engine(opt: dict[str, Any], weights: np.ndarray, n_features: int = 1, **table: Any) -> OracleEngine:
    tables = {"t": {"weights": weights, "combiner": "sum", "optimizer": opt, **table}}
    return OracleEngine(tables, [{"table": "t"} for _ in range(n_features)])


def test_engine_lookup_and_shared_table_accumulation() -> None:
    eng = _engine({"name": "Adagrad"}, T4x2, n_features=2)
    inputs: list[Any] = [([[1], [0]], None), ([[1]] * 2, None)]
    out = eng.lookup(inputs)
    _close(out[0], [[3.0, 4.0], [1.0, 2.0]])
    _close(out[1], [[3.0, 4.0], [3.0, 4.0]])
    grads = [np.array([[1.0, 1.0], [0.0, 0.0]]), np.array([[1.0, 1.0], [1.0, 1.0]])]
    eng.apply_gradients(inputs, grads, {"t": 0.1})
    # row 1: summed gradient 3 -> a = 0.1 + 9, one update
    _close(eng.tables["t"][1], [3.0 - 0.1 * 3 / math.sqrt(9.1), 4.0 - 0.1 * 3 / math.sqrt(9.1)])
    _close(eng.slots["t"]["accumulators"][1], [9.1, 9.1])
    # row 0: touched with a zero gradient -> a stays 0.1, w unchanged
    _close(eng.tables["t"][0], [1.0, 2.0])
    _close(eng.slots["t"]["accumulators"][0], [0.1, 0.1])
    _close(eng.tables["t"][2:], T4x2[2:])
    assert eng.tables["t"].dtype == np.float64


def test_engine_gradient_clip_is_on_accumulated_gradient() -> None:
    eng = _engine({"name": "SGD", "clipvalue": 1.0}, np.zeros((1, 1)))
    eng.apply_gradients([([[0], [0]], None)], [np.array([[0.8], [0.8]])], {"t": 0.5})
    _close(eng.tables["t"], [[-0.5]])  # clip(1.6) = 1, not 2*0.8


def test_no_accumulation_duplicate_id_differs_from_sum() -> None:
    ids: list[list[int]] = [[0, 0]]
    g = [np.array([[1.0]])]
    eng = _engine({"name": "Adagrad", "use_gradient_accumulation": False}, np.zeros((1, 1)))
    eng.apply_gradients([(ids, None)], g, {"t": 0.1})
    # two occurrences of g = 1: a = 1.1 then 2.1
    w_seq = -0.1 / math.sqrt(1.1) - 0.1 / math.sqrt(2.1)
    _close(eng.tables["t"], [[w_seq]])
    _close(eng.slots["t"]["accumulators"], [[2.1]])
    acc = _engine({"name": "Adagrad"}, np.zeros((1, 1)))
    acc.apply_gradients([(ids, None)], g, {"t": 0.1})
    w_sum = -0.1 * 2.0 / math.sqrt(4.1)  # one update with the sum 2
    _close(acc.tables["t"], [[w_sum]])
    assert abs(w_seq - w_sum) > 1e-3


def test_no_accumulation_order_sample_then_feature_then_position() -> None:
    opt = {"name": "Adagrad", "use_gradient_accumulation": False}
    eng = _engine(opt, np.zeros((1, 1)), n_features=2)
    inputs: list[Any] = [([[], [0]], None), ([[0], []], None)]
    grads = [np.array([[0.0], [3.0]]), np.array([[1.0], [0.0]])]
    eng.apply_gradients(inputs, grads, {"t": 1.0})
    # sample 0 (feature 1, g = 1) first, then sample 1 (feature 0, g = 3)
    w1 = -1.0 / math.sqrt(1.1)
    _close(eng.tables["t"], [[w1 - 3.0 / math.sqrt(10.1)]])
    # inside a sample: position order, weights 1 then 2 with a sum combiner -> g = 1 then g = 2
    eng = _engine(opt, np.zeros((1, 1)))
    eng.apply_gradients([([[0, 0]], [[1.0, 2.0]])], [np.array([[1.0]])], {"t": 1.0})
    _close(eng.tables["t"], [[-1.0 / math.sqrt(1.1) - 2.0 / math.sqrt(5.1)]])


def test_non_lazy_adam_moves_untouched_row() -> None:
    lr = 0.1
    results = {}
    for lazy in (True, False):
        eng = _engine({"name": "Adam", "lazy_adam": lazy}, np.zeros((2, 1)))
        eng.apply_gradients([([[0]], None)], [np.array([[1.0]])], {"t": lr})
        eng.apply_gradients([([[1]], None)], [np.array([[1.0]])], {"t": lr})
        results[lazy] = eng
    m1, v1, eps2 = one_minus(0.9), one_minus(0.999), F(1e-7, 1e-7)  # m = 0.1, v = 0.001 (float32 constants)
    w0_step1 = -lr * m1 / math.sqrt(v1 + eps2)
    _close(results[True].tables["t"][0], [w0_step1])  # lazy: row 0 untouched in step 2
    # non-lazy: row 0 has g = 0 in step 2, m = 0.09, v = 0.000999
    m2, v2 = F(0.9) * m1, F(0.999) * v1
    _close(results[False].tables["t"][0], [w0_step1 - lr * m2 / math.sqrt(v2 + eps2)])
    _close(results[False].slots["t"]["momenta"][0], [m2])
    # both: row 1 had m = v = 0 (non-lazy step 1 updated it with g = 0 and it did not move)
    for eng in results.values():
        _close(eng.tables["t"][1], [-lr * m1 / math.sqrt(v1 + eps2)])


def test_weight_decay_only_on_updated_rows() -> None:
    table = np.array([[1.0], [2.0]])
    for lazy, row1 in ((True, 2.0), (False, 1.0)):
        eng = _engine({"name": "Adam", "lazy_adam": lazy, "weight_decay_factor": 0.5}, table)
        eng.apply_gradients([([[0]], None)], [None], {"t": 0.1})
        _close(eng.tables["t"], [[0.5], [row1]])  # zero gradient: only the decay moves touched rows
    # no accumulation: decay once per occurrence
    eng = _engine({"name": "SGD", "use_gradient_accumulation": False, "weight_decay_factor": 0.5}, table)
    eng.apply_gradients([([[0, 0]], None)], [None], {"t": 0.1})
    _close(eng.tables["t"], [[0.25], [2.0]])


def test_non_finite_gradients_raise_and_change_nothing() -> None:
    tables = {
        "a": {"weights": T4x2, "combiner": "sum", "optimizer": {"name": "SGD"}},
        "b": {"weights": T4x2, "combiner": "sum", "optimizer": {"name": "Adagrad"}},
    }
    eng = OracleEngine(tables, [{"table": "a"}, {"table": "b"}])
    inputs: list[Any] = [([[0]], None), ([[1]], None)]
    with pytest.raises(ValueError, match="'b'"):
        eng.apply_gradients(inputs, [np.ones((1, 2)), np.array([[np.nan, 0.0]])], {"a": 1.0, "b": 1.0})
    _close(eng.tables["a"], T4x2)
    _close(eng.tables["b"], T4x2)
    _close(eng.slots["b"]["accumulators"], np.full((4, 2), 0.1))
    with pytest.raises(ValueError, match="out of range"):
        eng.apply_gradients([([[0]], None), ([[9]], None)], [np.ones((1, 2)), None], {"a": 1.0, "b": 1.0})
    _close(eng.tables["a"], T4x2)
    # a NaN in a padded sequence position reaches no table
    seq = OracleEngine(
        {"t": {"weights": T4x2, "optimizer": {"name": "SGD"}}}, [{"table": "t", "max_sequence_length": 2}]
    )
    seq.apply_gradients([([[3]], None)], [np.array([[[1.0, 1.0], [np.nan, np.nan]]])], {"t": 1.0})
    _close(seq.tables["t"][3], [6.0, 7.0])


def test_engine_config_errors() -> None:
    with pytest.raises(ValueError):
        _engine({"name": "SGD", "use_gradient_accumulation": False, "clipvalue": 1.0}, T4x2)
    with pytest.raises(ValueError):
        _engine({"name": "Adam", "use_gradient_accumulation": False, "lazy_adam": False}, T4x2)
    with pytest.raises(ValueError):
        OracleEngine({"t": {"weights": T4x2, "combiner": "max", "optimizer": {"name": "SGD"}}}, [])


def test_engine_quantized_lookup_straight_through() -> None:
    eng = _engine({"name": "SGD"}, np.array([[0.3, 2.6]]), quantization=(5, 0.0, 4.0))
    _close(eng.lookup([([[0]], None)])[0], [[0.0, 3.0]])
    eng.apply_gradients([([[0]], None)], [np.array([[1.0, 1.0]])], {"t": 0.1})
    _close(eng.tables["t"], [[0.2, 2.5]])  # stored weights stay unquantized
