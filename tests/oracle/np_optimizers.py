"""Float64 NumPy reference for the per-row optimizer pipeline.

Everything here follows docs/spec.md: section 1.1 (the pipeline: gradient clip, weight decay,
optimizer math, weight clip), section 1.3 (the optimizer formulas) and section 10 (binding decisions).

An optimizer is described by a plain dict ``opt`` whose keys are TF's v2 argument names plus ``"name"``
(one of ``"SGD"``, ``"Adagrad"``, ``"AdagradMomentum"``, ``"Adam"``, ``"FTRL"``) and the optional extra key
``"clipping_limit"`` (spec §10.4). Missing keys take TF's v2 defaults (spec §1.2, 1.3). Keys that have no
numeric effect (``learning_rate``: the rate is passed in; ``slot_variable_creation_fn``;
``low_dimensional_packing_status``) are ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .np_subnormals import flush, flushing, plain

Opt = dict[str, Any]

OPTIMIZER_NAMES: tuple[str, ...] = (
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "FTRL",
    # spec §1.3, "v1-only, TPUEstimator-era optimizers" (embtables' v2-style names for their arguments).
    "ProximalAdagrad",
    "Momentum",
    "RMSProp",
    "CenteredRMSProp",
    "Adadelta",
    "ProximalYogi",
    "FrequencyEstimator",
)

# spec §1.2: arguments shared by every optimizer, with their v2 defaults. ``clipping_limit`` is spec §10.4.
_COMMON_DEFAULTS: dict[str, Any] = {
    "use_gradient_accumulation": True,
    "clip_weight_min": None,
    "clip_weight_max": None,
    "weight_decay_factor": None,
    "multiply_weight_decay_factor_by_learning_rate": None,
    "clipvalue": None,
    "clipping_limit": None,
}

# spec §1.3: the v2 defaults of each optimizer's own arguments.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "SGD": {},
    "Adagrad": {"initial_accumulator_value": 0.1},
    "AdagradMomentum": {
        "momentum": 0.0,
        "use_nesterov": False,
        "exponent": 2.0,
        "beta2": 1.0,
        "epsilon": 1e-10,
    },
    "Adam": {
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-07,
        "lazy_adam": True,
        "sum_inside_sqrt": True,
    },
    "FTRL": {
        "learning_rate_power": -0.5,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "beta": 0.0,
        "initial_accumulator_value": 0.1,
        "multiply_linear_by_learning_rate": False,
        "allow_zero_accumulator": False,
    },
    "ProximalAdagrad": {
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
    },
    "Momentum": {"momentum": 0.9, "use_nesterov": False},
    "RMSProp": {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-07},
    "CenteredRMSProp": {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-07},
    "Adadelta": {"rho": 0.95, "epsilon": 1e-07},
    "ProximalYogi": {
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-3,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "initial_accumulator_value": 1e-6,
    },
    "FrequencyEstimator": {"tau": 0.1, "max_delta": 1000.0, "outlier_threshold": 10.0, "weight_exponent": 1.0},
}

# spec §1.3: slot names in TF order.
_SLOT_NAMES: dict[str, list[str]] = {
    "SGD": [],
    "Adagrad": ["accumulators"],
    "AdagradMomentum": ["accumulators", "momenta"],
    "Adam": ["momenta", "velocities"],
    "FTRL": ["accumulators", "linears"],
    "ProximalAdagrad": ["accumulators"],
    "Momentum": ["momenta"],
    "RMSProp": ["ms", "mom"],
    "CenteredRMSProp": ["ms", "mom", "mg"],
    "Adadelta": ["accumulators", "updates"],
    "ProximalYogi": ["v", "m"],
    "FrequencyEstimator": ["last_hit_step"],
}


def optimizer_name(opt: Opt) -> str:
    """The optimizer's name, checked against the supported set."""
    name = opt.get("name")
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer name {name!r}; expected one of {OPTIMIZER_NAMES}")
    return str(name)


def param(opt: Opt, key: str) -> Any:
    """The value of hyperparameter ``key``: the one in ``opt``, else TF's default (spec §1.2, 1.3)."""
    name = optimizer_name(opt)
    if key in opt:
        return opt[key]
    if key in _DEFAULTS[name]:
        return _DEFAULTS[name][key]
    if key in _COMMON_DEFAULTS:
        return _COMMON_DEFAULTS[key]
    raise KeyError(f"{name} has no hyperparameter {key!r}")


def slot_names(opt: Opt) -> list[str]:
    """The TF slot names of the optimizer, in TF order (spec §1.3)."""
    return list(_SLOT_NAMES[optimizer_name(opt)])


def _slot_initial_value(opt: Opt, slot: str) -> float:
    """spec §1.3: the initial value of one slot."""
    name = optimizer_name(opt)
    if slot == "accumulators" and name in ("Adagrad", "FTRL", "ProximalAdagrad"):
        return float(param(opt, "initial_accumulator_value"))
    if slot == "v" and name == "ProximalYogi":
        return float(param(opt, "initial_accumulator_value"))
    # AdagradMomentum accumulators and momenta, Adam momenta and velocities, FTRL linears all start at 0.
    # (spec §1.3, AdagradMomentum: epsilon is NOT the initial accumulator.)
    return 0.0


def init_slots(opt: Opt, V: int, D: int) -> dict[str, np.ndarray]:
    """Freshly initialised slots of a (V, D) table, float64 (spec §1.3)."""
    slots: dict[str, np.ndarray] = {}
    for slot in slot_names(opt):
        slots[slot] = np.full((V, D), _slot_initial_value(opt, slot), dtype=np.float64)
    return slots


def gradient_clip_bounds(opt: Opt) -> tuple[float, float]:
    """The (lower, upper) gradient clip bounds; (-inf, +inf) when there is no clip.

    spec §1.1 step 4: a scalar ``clipvalue`` c means (-c, +c); a tuple (lo, hi) may hold None on either
    side, meaning unbounded. spec §10.4: ``clipping_limit`` L is a symmetric clip (-L, +L); when
    ``clipvalue`` is also set, the tighter bound wins on each side.
    """
    lower = -np.inf
    upper = np.inf
    clipvalue = param(opt, "clipvalue")
    if clipvalue is not None:
        if isinstance(clipvalue, (tuple, list)):
            lo, hi = clipvalue
            lower = -np.inf if lo is None else float(lo)
            upper = np.inf if hi is None else float(hi)
        else:
            lower = -float(clipvalue)
            upper = float(clipvalue)
    clipping_limit = param(opt, "clipping_limit")
    if clipping_limit is not None:
        lower = max(lower, -float(clipping_limit))
        upper = min(upper, float(clipping_limit))
    return lower, upper


def has_gradient_clip(opt: Opt) -> bool:
    """Whether a gradient clip (clipvalue or clipping_limit) is configured."""
    return param(opt, "clipvalue") is not None or param(opt, "clipping_limit") is not None


def _f32(*xs: float) -> float:
    """The float32 product of ``xs`` (left to right): TF derives every constant from float32
    hyper-parameters in float32 arithmetic (spec: all arithmetic is float32)."""
    out = np.float32(flush(float(np.float32(xs[0]))))
    for x in xs[1:]:
        out = np.float32(flush(float(np.float32(out * np.float32(flush(float(np.float32(x))))))))
    return float(out)


def _f32_one_minus(x: float) -> float:
    """``1 - x`` computed in float32 from float32 ``x``."""
    return float(np.float32(np.float32(1.0) - np.float32(x)))


def effective_weight_decay(opt: Opt, lr: float) -> float:
    """spec §10.1 / 1.1 step 5: lambda_eff = lambda*lr if the multiply flag is truthy, else lambda.

    A weight_decay_factor of 0 or None means no decay.
    """
    lam = param(opt, "weight_decay_factor")
    if not lam:
        return 0.0
    if param(opt, "multiply_weight_decay_factor_by_learning_rate"):
        return _f32(lam, lr)
    return _f32(lam)


def _accumulator_power(n: np.ndarray, p: float, allow_zero_accumulator: bool) -> np.ndarray:
    """``n**p`` elementwise; with allow_zero_accumulator an accumulator equal to 0 gives 0 (spec §10.3)."""
    result = np.empty_like(n)
    for d in range(n.shape[0]):
        if allow_zero_accumulator and n[d] == 0.0:
            result[d] = 0.0
        else:
            result[d] = n[d] ** p
    return result


def _sgd(w: np.ndarray, g: np.ndarray, lr: float) -> np.ndarray:
    # spec §1.3 SGD: w <- w - lr*g
    return w - lr * g


def _adagrad(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 Adagrad: a <- a + g^2; w <- w - lr*g/sqrt(a) with the NEW accumulator and no epsilon.
    a = slots["accumulators"] + g * g
    w_new = w - lr * g / np.sqrt(a)
    return w_new, {"accumulators": a}


def _adagrad_momentum(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 AdagradMomentum.
    momentum = _f32(param(opt, "momentum"))
    use_nesterov = bool(param(opt, "use_nesterov"))
    neg_inv_exponent = float(np.float32(np.float32(-1.0) / np.float32(param(opt, "exponent"))))
    beta2 = _f32(param(opt, "beta2"))
    epsilon = _f32(param(opt, "epsilon"))
    a = slots["accumulators"]
    m = slots["momenta"]
    # beta2 == 1: a <- a + g^2; otherwise a <- beta2*a + (1 - beta2)*g^2
    a_new = a + g * g if beta2 == 1.0 else beta2 * a + _f32_one_minus(beta2) * g * g
    s = (a_new + epsilon) ** neg_inv_exponent * g
    m_new = momentum * m + s
    u = momentum * m_new + s if use_nesterov else m_new
    w_new = w - lr * u
    return w_new, {"accumulators": a_new, "momenta": m_new}


def _adam(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 Adam, with no bias correction.
    beta_1 = _f32(param(opt, "beta_1"))
    beta_2 = _f32(param(opt, "beta_2"))
    epsilon = _f32(param(opt, "epsilon"))
    m_new = beta_1 * slots["momenta"] + _f32_one_minus(beta_1) * g
    v_new = beta_2 * slots["velocities"] + _f32_one_minus(beta_2) * g * g
    sum_inside_sqrt = bool(param(opt, "sum_inside_sqrt"))
    denom = np.sqrt(v_new + _f32(epsilon, epsilon)) if sum_inside_sqrt else np.sqrt(v_new) + epsilon
    w_new = w - lr * m_new / denom
    return w_new, {"momenta": m_new, "velocities": v_new}


def _ftrl(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 FTRL. ``w`` here is the (already weight-decayed, spec §10.1) weight entering the linear update.
    p = _f32(-float(param(opt, "learning_rate_power")))
    l1 = _f32(param(opt, "l1_regularization_strength"))
    l2 = float(param(opt, "l2_regularization_strength"))
    beta = _f32(param(opt, "beta"))
    allow_zero = bool(param(opt, "allow_zero_accumulator"))
    n = slots["accumulators"]
    z = slots["linears"]

    n_new = n + g * g
    n_pow = _accumulator_power(n, p, allow_zero)
    n_new_pow = _accumulator_power(n_new, p, allow_zero)
    delta = n_new_pow - n_pow
    if not param(opt, "multiply_linear_by_learning_rate"):
        z_new = z + g - (delta / lr) * w
        numer = np.clip(z_new, -l1, l1) - z_new
        denom = (n_new_pow + beta) / lr + _f32(2.0, l2)
    else:
        # The linears slot stores lr*z.
        z_new = z + lr * g - delta * w
        lim = _f32(lr, l1)
        numer = np.clip(z_new, -lim, lim) - z_new
        denom = n_new_pow + _f32(2.0, lr, l2) + beta

    w_new = np.empty_like(w)
    for d in range(w.shape[0]):
        if allow_zero and numer[d] == 0.0:
            # spec §10.3 (no NaN with a zero accumulator): a zero numerator gives w = 0 even when the
            # denominator is 0 too (n_new = 0, beta = 0, l2 = 0). For a non-zero denominator this is N/Dn.
            w_new[d] = 0.0
        else:
            w_new[d] = numer[d] / denom[d]
    return w_new, {"accumulators": n_new, "linears": z_new}


def _proximal(prox: np.ndarray, lr_t: np.ndarray, l1: float, l2: float) -> np.ndarray:
    # spec §1.3 ProximalAdagrad: sign(prox) * max(|prox| - lr_t*l1, 0) / (1 + lr_t*l2)
    return np.sign(prox) * np.maximum(np.abs(prox) - lr_t * l1, 0.0) / (1.0 + lr_t * l2)


def _proximal_adagrad(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 ProximalAdagrad: a += g^2; lr_t = lr/sqrt(a); prox = w - lr_t*g; proximal l1/l2 step.
    a = slots["accumulators"] + g * g
    lr_t = lr / np.sqrt(a)
    prox = w - lr_t * g
    l1 = _f32(param(opt, "l1_regularization_strength"))
    l2 = _f32(param(opt, "l2_regularization_strength"))
    return _proximal(prox, lr_t, l1, l2), {"accumulators": a}


def _momentum(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 Momentum (TF ApplyMomentum): m = mu*m + g; w -= lr*m, or lr*(g + mu*m) with Nesterov.
    mu = _f32(param(opt, "momentum"))
    m = mu * slots["momenta"] + g
    step = g + mu * m if param(opt, "use_nesterov") else m
    return w - lr * step, {"momenta": m}


def _rmsprop(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float, centered: bool
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 RMSProp: ms = rho*ms + (1-rho)*g^2; mom = mu*mom + lr*g/sqrt(ms + eps); w -= mom.
    # CenteredRMSProp: mg = rho*mg + (1-rho)*g and the denominator is sqrt(ms - mg^2 + eps).
    rho = _f32(param(opt, "rho"))
    mu = _f32(param(opt, "momentum"))
    eps = _f32(param(opt, "epsilon"))
    ms = rho * slots["ms"] + _f32_one_minus(rho) * g * g
    new: dict[str, np.ndarray] = {"ms": ms}
    if centered:
        mg = rho * slots["mg"] + _f32_one_minus(rho) * g
        new["mg"] = mg
        den = np.sqrt(ms - mg * mg + eps)
    else:
        den = np.sqrt(ms + eps)
    mom = mu * slots["mom"] + lr * g / den
    new["mom"] = mom
    return w - mom, new


def _adadelta(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 Adadelta (TF ApplyAdadelta): a = rho*a + (1-rho)*g^2; u = sqrt(upd+eps)/sqrt(a+eps)*g;
    # upd = rho*upd + (1-rho)*u^2; w -= lr*u.
    rho = _f32(param(opt, "rho"))
    eps = _f32(param(opt, "epsilon"))
    a = rho * slots["accumulators"] + _f32_one_minus(rho) * g * g
    u = np.sqrt(slots["updates"] + eps) / np.sqrt(a + eps) * g
    upd = rho * slots["updates"] + _f32_one_minus(rho) * u * u
    return w - lr * u, {"accumulators": a, "updates": upd}


def _proximal_yogi(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 ProximalYogi, no bias correction: m = b1*m + (1-b1)*g; v = v - (1-b2)*sign(v - g^2)*g^2;
    # then the proximal l1/l2 step of ProximalAdagrad with lr_t = lr/(sqrt(v) + eps) applied to w - lr_t*m.
    b1 = _f32(param(opt, "beta_1"))
    b2 = _f32(param(opt, "beta_2"))
    eps = _f32(param(opt, "epsilon"))
    m = b1 * slots["m"] + _f32_one_minus(b1) * g
    g2 = g * g
    v = slots["v"] - _f32_one_minus(b2) * np.sign(slots["v"] - g2) * g2
    lr_t = lr / (np.sqrt(v) + eps)
    prox = w - lr_t * m
    l1 = _f32(param(opt, "l1_regularization_strength"))
    l2 = _f32(param(opt, "l2_regularization_strength"))
    return _proximal(prox, lr_t, l1, l2), {"v": v, "m": m}


def _frequency_estimator(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # spec §1.3 FrequencyEstimator: the "learning rate" is the global step t; gradients are ignored.
    t = lr
    tau = _f32(param(opt, "tau"))
    delta = t - slots["last_hit_step"]
    delta_c = np.minimum(delta, _f32(param(opt, "max_delta")))
    outlier = delta >= _f32(param(opt, "outlier_threshold")) * w
    w_new = np.where(outlier, delta_c, w * _f32_one_minus(tau) + delta_c * tau)
    return w_new, {"last_hit_step": np.full_like(w, t)}


def update_row(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One optimizer update of one row: spec §1.1 steps 4 to 7.

    ``w`` and ``g`` have shape (D,); ``slots`` maps each slot name to its (D,) row. Returns new arrays
    (float64); the inputs are not modified. ``lr`` is this step's learning rate for the table.
    Subnormals (spec §1.5): every operand and result of every operation with float32 subnormals as zero.
    """
    w_new, new_slots = _update_row(
        opt, flushing(w), {k: flushing(v) for k, v in slots.items()}, flushing(g), flush(float(lr))
    )
    return plain(w_new), {k: plain(v) for k, v in new_slots.items()}


def _update_row(
    opt: Opt, w: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray, lr: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    name = optimizer_name(opt)
    lr = float(lr)
    # Step 4: gradient clip, elementwise, of the (accumulated) gradient.
    lower, upper = gradient_clip_bounds(opt)
    g_clipped = np.minimum(np.maximum(g, lower), upper)

    # Step 5 / spec §10.1: decoupled weight decay, w <- w - lambda_eff*w. For SGD, Adagrad, AdagradMomentum
    # and Adam this gives w_new = w - lambda_eff*w - delta_opt; for FTRL it is the w entering the linears
    # update.
    lam_eff = effective_weight_decay(opt, lr)
    w_decayed = w - lam_eff * w

    # Step 6: optimizer math (spec §1.3).
    if name == "SGD":
        w_new = _sgd(w_decayed, g_clipped, lr)
        new_slots: dict[str, np.ndarray] = {}
    elif name == "Adagrad":
        w_new, new_slots = _adagrad(opt, w_decayed, slots, g_clipped, lr)
    elif name == "AdagradMomentum":
        w_new, new_slots = _adagrad_momentum(opt, w_decayed, slots, g_clipped, lr)
    elif name == "Adam":
        w_new, new_slots = _adam(opt, w_decayed, slots, g_clipped, lr)
    elif name == "FTRL":
        w_new, new_slots = _ftrl(opt, w_decayed, slots, g_clipped, lr)
    elif name == "ProximalAdagrad":
        w_new, new_slots = _proximal_adagrad(opt, w_decayed, slots, g_clipped, lr)
    elif name == "Momentum":
        w_new, new_slots = _momentum(opt, w_decayed, slots, g_clipped, lr)
    elif name in ("RMSProp", "CenteredRMSProp"):
        w_new, new_slots = _rmsprop(opt, w_decayed, slots, g_clipped, lr, centered=name == "CenteredRMSProp")
    elif name == "Adadelta":
        w_new, new_slots = _adadelta(opt, w_decayed, slots, g_clipped, lr)
    elif name == "ProximalYogi":
        w_new, new_slots = _proximal_yogi(opt, w_decayed, slots, g_clipped, lr)
    else:
        w_new, new_slots = _frequency_estimator(opt, w_decayed, slots, lr)

    # Step 7: clip the new weights (not the slots); None = unbounded.
    wmin = param(opt, "clip_weight_min")
    wmax = param(opt, "clip_weight_max")
    lo = -np.inf if wmin is None else float(wmin)
    hi = np.inf if wmax is None else float(wmax)
    w_new = np.minimum(np.maximum(w_new, lo), hi)
    return w_new, new_slots
