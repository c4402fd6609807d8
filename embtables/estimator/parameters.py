"""TPUEstimator's v1 optimizer parameter classes (``tf.tpu.experimental.*Parameters``).

Each is a frozen dataclass with TF v1's argument names, order and defaults (note ``AdamParameters``'
``epsilon=1e-08`` and ``AdagradParameters``' ``initial_accumulator``), validated on construction, and
``to_optimizer()`` gives the embtables optimizer with the same numerics. v1 differences kept on
purpose: ``StochasticGradientDescentParameters`` has no accumulation argument (accumulation is on
exactly when a gradient clip bound is given); ``FtrlParameters`` allows ``initial_accumulator_value=0``;
gradient clipping is ``clip_gradient_min`` / ``clip_gradient_max``. One difference from TF v1: a
gradient clip with ``use_gradient_accumulation=False`` raises (TF v1 builds that error and drops it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from embtables.config import (
    FTRL,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    CenteredRMSProp,
    FrequencyEstimator,
    Momentum,
    Optimizer,
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
)
from embtables.errors import ConfigError
from embtables.kernels.registry import record_of_type

LearningRate = float | Callable[[], float]


class _OptimizationParameters:
    """Shared v1 fields and the conversion of the shared ones to v2 arguments."""

    learning_rate: LearningRate
    use_gradient_accumulation: bool
    clip_weight_min: float | None
    clip_weight_max: float | None
    weight_decay_factor: float | None
    multiply_weight_decay_factor_by_learning_rate: bool | None
    clip_gradient_min: float | None
    clip_gradient_max: float | None

    def __post_init__(self) -> None:
        self.to_optimizer()  # validates every argument with the v2 class's rules, naming this class

    def _common(self) -> dict[str, Any]:
        lo, hi = self.clip_gradient_min, self.clip_gradient_max
        return {
            "learning_rate": self.learning_rate,
            "use_gradient_accumulation": self.use_gradient_accumulation,
            "clip_weight_min": self.clip_weight_min,
            "clip_weight_max": self.clip_weight_max,
            "weight_decay_factor": self.weight_decay_factor,
            "multiply_weight_decay_factor_by_learning_rate": self.multiply_weight_decay_factor_by_learning_rate,
            "clipvalue": None if lo is None and hi is None else (lo, hi),
        }

    def _build(self, cls: type[Any], **overrides: Any) -> Any:
        """``cls`` from the shared fields and, through its kernel record's names, this class's own
        fields (``overrides`` replace some)."""
        record = record_of_type(cls)
        own = {f: getattr(self, record.v1_name(f)) for f in record.own_fields() if hasattr(self, record.v1_name(f))}
        own.update(overrides)
        try:
            return cls(**own, **self._common())
        except (ValueError, TypeError) as exc:
            message = str(exc).replace(f"{cls.__name__}:", f"{type(self).__name__}:", 1)
            raise type(exc)(message) from None

    OPTIMIZER: ClassVar[type[Any]]  # the v2 class with the same numerics

    def to_optimizer(self) -> Optimizer:
        """The embtables optimizer with these numerics."""
        out: Optimizer = self._build(self.OPTIMIZER)
        return out


@dataclasses.dataclass(frozen=True)
class StochasticGradientDescentParameters(_OptimizationParameters):
    """SGD. Accumulation is forced off, or on when a gradient clip bound is given (as TF v1)."""

    OPTIMIZER: ClassVar[type[Any]] = SGD

    learning_rate: LearningRate
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None

    @property
    def use_gradient_accumulation(self) -> bool:  # type: ignore[override]
        return self.clip_gradient_min is not None or self.clip_gradient_max is not None


@dataclasses.dataclass(frozen=True)
class AdagradParameters(_OptimizationParameters):
    """Adagrad; ``initial_accumulator`` (default 0.1) is v2's ``initial_accumulator_value``."""

    OPTIMIZER: ClassVar[type[Any]] = Adagrad

    learning_rate: LearningRate
    initial_accumulator: float = 0.1
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class AdamParameters(_OptimizationParameters):
    """Adam without bias correction; v1's default ``epsilon`` is 1e-08 (v2: 1e-07)."""

    OPTIMIZER: ClassVar[type[Any]] = Adam

    learning_rate: LearningRate
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-08
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


def _zero_slots(table: Tensor, names: list[str], initializers: list[Any]) -> dict[str, Tensor]:
    """FTRL slots that start at 0 (``FtrlParameters(initial_accumulator_value=0)``, allowed by TF v1)."""
    del initializers
    return {n: torch.zeros_like(table) for n in names}


@dataclasses.dataclass(frozen=True)
class FtrlParameters(_OptimizationParameters):
    """FTRL. Unlike v2, ``initial_accumulator_value`` may be 0 (``learning_rate_power`` must be <= 0,
    l1/l2 >= 0); with a zero accumulator and a zero gradient the update is 0/0, which embtables
    refuses with an error naming the table (set ``allow_zero_accumulator=True`` to get 0 instead)."""

    OPTIMIZER: ClassVar[type[Any]] = FTRL

    learning_rate: LearningRate
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    multiply_linear_by_learning_rate: bool = False
    beta: float = 0
    allow_zero_accumulator: bool = False
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None

    def to_optimizer(self) -> Optimizer:
        init = self.initial_accumulator_value
        if isinstance(init, (int, float)) and not isinstance(init, bool) and init < 0:
            raise ConfigError(f"FtrlParameters: `initial_accumulator_value` must be >= 0, got {init}.")
        zero = isinstance(init, (int, float)) and init == 0
        out: Optimizer = self._build(
            FTRL,
            initial_accumulator_value=0.1 if zero else init,
            slot_variable_creation_fn=_zero_slots if zero else None,
        )
        return out


@dataclasses.dataclass(frozen=True)
class ProximalAdagradParameters(_OptimizationParameters):
    """Proximal Adagrad (``initial_accumulator`` default 0.1, l1/l2 default 0)."""

    OPTIMIZER: ClassVar[type[Any]] = ProximalAdagrad

    learning_rate: LearningRate
    initial_accumulator: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class MomentumParameters(_OptimizationParameters):
    """Momentum (``momentum`` is required, as in TF v1)."""

    OPTIMIZER: ClassVar[type[Any]] = Momentum

    learning_rate: LearningRate
    momentum: float
    use_nesterov: bool = False
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class RMSPropParameters(_OptimizationParameters):
    """RMSProp (``rho``, ``momentum`` and ``epsilon`` are required, as in TF v1)."""

    OPTIMIZER: ClassVar[type[Any]] = RMSProp

    learning_rate: LearningRate
    rho: float
    momentum: float
    epsilon: float
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class CenteredRMSPropParameters(_OptimizationParameters):
    """Centered RMSProp (the proto's ``CenteredRmsProp``; arguments as ``RMSPropParameters``)."""

    OPTIMIZER: ClassVar[type[Any]] = CenteredRMSProp

    learning_rate: LearningRate
    rho: float
    momentum: float
    epsilon: float
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class AdadeltaParameters(_OptimizationParameters):
    """Adadelta (the proto's ``Adadelta``; ``rho`` and ``epsilon`` are required)."""

    OPTIMIZER: ClassVar[type[Any]] = Adadelta

    learning_rate: LearningRate
    rho: float
    epsilon: float
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class ProximalYogiParameters(_OptimizationParameters):
    """Proximal Yogi (every argument has TF v1's default)."""

    OPTIMIZER: ClassVar[type[Any]] = ProximalYogi

    learning_rate: LearningRate = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-3
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    initial_accumulator_value: float = 1e-6
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clip_gradient_min: float | None = None
    clip_gradient_max: float | None = None


@dataclasses.dataclass(frozen=True)
class FrequencyEstimatorParameters(_OptimizationParameters):
    """Frequency estimator (see ``embtables.FrequencyEstimator``). Its "learning rate" is the global
    step: the estimator passes it; ``to_optimizer(global_step=fn)`` does the same by hand."""

    OPTIMIZER: ClassVar[type[Any]] = FrequencyEstimator

    tau: float
    max_delta: float
    outlier_threshold: float
    weight_exponent: float

    learning_rate: LearningRate = dataclasses.field(default=0.0, init=False, repr=False)
    use_gradient_accumulation: bool = dataclasses.field(default=True, init=False, repr=False)
    clip_weight_min: float | None = dataclasses.field(default=None, init=False, repr=False)
    clip_weight_max: float | None = dataclasses.field(default=None, init=False, repr=False)
    weight_decay_factor: float | None = dataclasses.field(default=None, init=False, repr=False)
    multiply_weight_decay_factor_by_learning_rate: bool | None = dataclasses.field(default=None, init=False, repr=False)
    clip_gradient_min: float | None = dataclasses.field(default=None, init=False, repr=False)
    clip_gradient_max: float | None = dataclasses.field(default=None, init=False, repr=False)

    def to_optimizer(self, global_step: Callable[[], float] | None = None) -> Optimizer:
        out: Optimizer = self._build(FrequencyEstimator)
        if global_step is not None:
            out = dataclasses.replace(out, learning_rate=global_step)
        return out


PARAMETER_TYPES: tuple[type[_OptimizationParameters], ...] = (
    StochasticGradientDescentParameters,
    AdagradParameters,
    AdamParameters,
    FtrlParameters,
    ProximalAdagradParameters,
    MomentumParameters,
    RMSPropParameters,
    CenteredRMSPropParameters,
    AdadeltaParameters,
    ProximalYogiParameters,
    FrequencyEstimatorParameters,
)
