"""The TPUEstimator-era optimizers that have no TF v2 class: ProximalAdagrad, Momentum, RMSProp,
CenteredRMSProp, Adadelta, ProximalYogi and FrequencyEstimator.

TF exposes them only as v1 ``tf.tpu.experimental.*Parameters`` (``embtables.estimator``); embtables
also gives each a v2-style class, with the same field layout as ``embtables.config.optimizers``
(own arguments between ``learning_rate`` and ``use_gradient_accumulation``, then the shared ones),
so they plug into ``TableConfig(optimizer=...)`` and ``DistributedEmbedding`` like the core five.
Formulas (spec §1.3, "v1-only") are in ``docs/optimizers.md``; every derived constant is float32.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from embtables.config.optimizers import (
    ClipValue,
    LearningRate,
    SlotVariableCreationFn,
    _check_number,
    _check_positive_float32,
    _Optimizer,
)
from embtables.errors import ConfigError


def _check_unit_interval(owner: str, name: str, value: float, *, closed_top: bool = False) -> None:
    """``value`` in [0, 1) (or [0, 1] with ``closed_top``)."""
    _check_number(owner, name, value)
    ok = 0.0 <= value <= 1.0 if closed_top else 0.0 <= value < 1.0
    if not ok:
        top = "<= 1" if closed_top else "< 1"
        raise ConfigError(f"{owner}: `{name}` must be >= 0 and {top}, got {value}.")


def _check_non_negative(owner: str, *pairs: tuple[str, float]) -> None:
    for name, value in pairs:
        _check_number(owner, name, value)
        if value < 0:
            raise ConfigError(f"{owner}: `{name}` must be >= 0, got {value}.")


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be a bool, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ProximalAdagrad(_Optimizer):
    """Proximal Adagrad (TF ApplyProximalAdagrad): ``a <- a + g^2; lr_t = lr / sqrt(a);
    p = w - lr_t g; w <- sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2)``.

    Slot ``accumulators`` starts at ``initial_accumulator_value`` (must be > 0).
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("accumulators",)

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        name = "ProximalAdagrad"
        _check_number(name, "initial_accumulator_value", self.initial_accumulator_value)
        if self.initial_accumulator_value <= 0:
            raise ConfigError(
                f"{name}: `initial_accumulator_value` must be a positive float (the update divides by sqrt of the "
                f"accumulator), got {self.initial_accumulator_value}."
            )
        _check_positive_float32(name, "initial_accumulator_value", self.initial_accumulator_value, "divides")
        _check_non_negative(
            name,
            ("l1_regularization_strength", self.l1_regularization_strength),
            ("l2_regularization_strength", self.l2_regularization_strength),
        )

    def slot_initial_values(self) -> tuple[float, ...]:
        return (float(self.initial_accumulator_value),)


@dataclasses.dataclass(frozen=True)
class Momentum(_Optimizer):
    """Momentum (TF ApplyMomentum): ``m <- mu m + g; w <- w - lr m`` (Nesterov: ``w <- w - lr (g + mu m)``).

    Slot ``momenta`` starts at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("momenta",)

    learning_rate: LearningRate = 0.01
    momentum: float = 0.9
    use_nesterov: bool = False
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        _check_number("Momentum", "momentum", self.momentum)
        _check_bool("Momentum", "use_nesterov", self.use_nesterov)


@dataclasses.dataclass(frozen=True)
class RMSProp(_Optimizer):
    """RMSProp (TF ApplyRMSProp): ``ms <- rho ms + (1-rho) g^2; mom <- mu mom + lr g / sqrt(ms + eps);
    w <- w - mom``. Slots ``ms`` and ``mom`` start at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("ms", "mom")

    learning_rate: LearningRate = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-07
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        _validate_rmsprop(type(self).__name__, self.rho, self.momentum, self.epsilon)


def _validate_rmsprop(name: str, rho: float, momentum: float, epsilon: float) -> None:
    _check_unit_interval(name, "rho", rho, closed_top=True)
    _check_number(name, "momentum", momentum)
    _check_number(name, "epsilon", epsilon)
    if epsilon <= 0:
        raise ConfigError(f"{name}: `epsilon` must be positive (the update divides by it), got {epsilon}.")
    _check_positive_float32(name, "epsilon", epsilon, "the update divides by sqrt(ms + epsilon)")


@dataclasses.dataclass(frozen=True)
class CenteredRMSProp(_Optimizer):
    """Centered RMSProp (TF ApplyCenteredRMSProp): ``mg <- rho mg + (1-rho) g``; ``ms`` as RMSProp;
    ``mom <- mu mom + lr g / sqrt(ms - mg^2 + eps); w <- w - mom``. Slots ``ms``, ``mom``, ``mg`` start at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("ms", "mom", "mg")

    learning_rate: LearningRate = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-07
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        _validate_rmsprop(type(self).__name__, self.rho, self.momentum, self.epsilon)


@dataclasses.dataclass(frozen=True)
class Adadelta(_Optimizer):
    """Adadelta (TF ApplyAdadelta): ``a <- rho a + (1-rho) g^2; u = sqrt(upd + eps) / sqrt(a + eps) g;
    upd <- rho upd + (1-rho) u^2; w <- w - lr u``. Slots ``accumulators`` and ``updates`` start at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("accumulators", "updates")

    learning_rate: LearningRate = 0.001
    rho: float = 0.95
    epsilon: float = 1e-07
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        _check_unit_interval("Adadelta", "rho", self.rho, closed_top=True)
        _check_number("Adadelta", "epsilon", self.epsilon)
        if self.epsilon <= 0:
            raise ConfigError(f"Adadelta: `epsilon` must be positive (it divides), got {self.epsilon}.")
        _check_positive_float32("Adadelta", "epsilon", self.epsilon, "the update divides by sqrt(a + epsilon)")


@dataclasses.dataclass(frozen=True)
class ProximalYogi(_Optimizer):
    """Proximal Yogi, lazy, no bias correction: ``m <- b1 m + (1-b1) g;
    v <- v - (1-b2) sign(v - g^2) g^2; lr_t = lr / (sqrt(v) + eps); p = w - lr_t m;
    w <- sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2)``.

    Slots ``v`` (starts at ``initial_accumulator_value``) and ``m`` (starts at 0), in TF's order.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("v", "m")

    learning_rate: LearningRate = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-3
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    initial_accumulator_value: float = 1e-6
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        name = "ProximalYogi"
        _check_unit_interval(name, "beta_1", self.beta_1)
        _check_unit_interval(name, "beta_2", self.beta_2)
        _check_number(name, "epsilon", self.epsilon)
        if self.epsilon <= 0:
            raise ConfigError(f"{name}: `epsilon` must be positive (it divides), got {self.epsilon}.")
        _check_positive_float32(name, "epsilon", self.epsilon, "the update divides by sqrt(v) + epsilon")
        _check_non_negative(
            name,
            ("l1_regularization_strength", self.l1_regularization_strength),
            ("l2_regularization_strength", self.l2_regularization_strength),
            ("initial_accumulator_value", self.initial_accumulator_value),
        )

    def slot_initial_values(self) -> tuple[float, ...]:
        return (float(self.initial_accumulator_value), 0.0)


@dataclasses.dataclass(frozen=True)
class FrequencyEstimator(_Optimizer):
    """Frequency estimator (TF proto ``FrequencyEstimatorParameters``): the table holds, per id, an
    estimate ``D`` of the steps between two hits (``1/D`` is the id's frequency).

    Per looked-up row, with ``t`` = the learning rate, which **must be the global step** (pass
    ``learning_rate=lambda: float(step)``; the estimator does this for you):
    ``delta = t - last; dc = min(delta, max_delta); out = delta >= outlier_threshold * D;
    D <- dc if out else D (1 - tau) + dc tau; last <- t``. Gradients are ignored (feed zeros), and the
    table should start at ``max_delta`` (``initializer=Constant(max_delta)``) with ``dim=1``.
    ``weight_exponent`` is for the consumer: a weight ``(D / max_delta) ** weight_exponent``.
    Slot ``last_hit_step`` starts at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("last_hit_step",)

    learning_rate: LearningRate = 0.0
    tau: float = 0.1
    max_delta: float = 1000.0
    outlier_threshold: float = 10.0
    weight_exponent: float = 1.0
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        name = "FrequencyEstimator"
        _check_unit_interval(name, "tau", self.tau, closed_top=True)
        _check_non_negative(
            name,
            ("max_delta", self.max_delta),
            ("outlier_threshold", self.outlier_threshold),
            ("weight_exponent", self.weight_exponent),
        )


EXTRA_OPTIMIZER_TYPES: tuple[type[_Optimizer], ...] = (
    ProximalAdagrad,
    Momentum,
    RMSProp,
    CenteredRMSProp,
    Adadelta,
    ProximalYogi,
    FrequencyEstimator,
)
