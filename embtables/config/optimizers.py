"""Optimizer configs: SGD, Adagrad, AdagradMomentum, Adam, FTRL (the TF v2 classes; the others are in
``extra_optimizers``, all of them listed in ``catalogue``).

Each is a frozen dataclass with TensorFlow's exact argument names, order and defaults
(``tf.tpu.experimental.embedding.*``), validated on construction with TF's rules. They hold no
tensors; the math lives in ``embtables.kernels`` (one file per optimizer). Use
``dataclasses.replace(opt, learning_rate=0.1)`` for a variant.

Formulas (spec §1.3) are listed in ``docs/optimizers.md``.

Each class spells out every field, the shared ones included, because TF puts each optimizer's own
arguments between ``learning_rate`` and ``use_gradient_accumulation``; dataclass inheritance would
append them at the end and break positional calls such as ``Adagrad(0.1, 0.05)``. The shared
validation and helpers live once, in ``_Optimizer``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from typing import Any, ClassVar

from embtables.errors import ConfigError

LearningRate = float | Callable[[], float]
ClipValue = float | tuple[float | None, float | None] | None
SlotVariableCreationFn = Callable[[Any, list[str], list[Any]], dict[str, Any]]


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


def as_float32(x: float) -> float:
    """``x`` rounded to float32 (the precision every kernel computes in), as a Python float; beyond
    float32's range it is +-inf, as a float32 conversion gives. The one float32 rounding of the package."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def _check_number(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_number(value):
        raise TypeError(f"{owner}: `{name}` must be a float{' or None' if optional else ''}, got {value!r}.")
    if not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise ConfigError(f"{owner}: `{name}` must be finite, got {value!r}.")
    if abs(float(value)) > FLOAT32_MAX:  # type: ignore[arg-type]
        raise ConfigError(
            f"{owner}: `{name}`={value!r} does not fit in float32 (largest 3.4e38), the precision the kernels "
            "compute in; it would become inf. Use a smaller value."
        )


def _check_positive_float32(owner: str, name: str, value: float, why: str) -> None:
    """``value`` must stay a positive normal float32 (it divides, or is squared, in the kernels)."""
    if not as_float32(value) >= FLOAT32_MIN_NORMAL:
        raise ConfigError(
            f"{owner}: `{name}` must be a positive float32 of at least 1.2e-38 ({why}), got {value!r}, which is "
            f"{as_float32(value)!r} in float32. Use a larger value."
        )


# The fields every optimizer has (TF's ``_Optimizer`` arguments); the others are its own.
SHARED_FIELDS = (
    "learning_rate",
    "use_gradient_accumulation",
    "clip_weight_min",
    "clip_weight_max",
    "weight_decay_factor",
    "multiply_weight_decay_factor_by_learning_rate",
    "slot_variable_creation_fn",
    "clipvalue",
    "low_dimensional_packing_status",
)


class _Optimizer:
    """Shared fields, validation and helpers of every embedding optimizer (TF's ``_Optimizer``)."""

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ()

    learning_rate: LearningRate
    use_gradient_accumulation: bool
    clip_weight_min: float | None
    clip_weight_max: float | None
    weight_decay_factor: float | None
    multiply_weight_decay_factor_by_learning_rate: bool | None
    clipvalue: ClipValue
    low_dimensional_packing_status: bool

    def __post_init__(self) -> None:
        name = type(self).__name__
        lr = self.learning_rate
        if not callable(lr):
            _check_number(name, "learning_rate", lr)
        if not isinstance(self.use_gradient_accumulation, bool):
            raise TypeError(
                f"{name}: `use_gradient_accumulation` must be a bool, got {self.use_gradient_accumulation!r}."
            )
        _check_number(name, "clip_weight_min", self.clip_weight_min, optional=True)
        _check_number(name, "clip_weight_max", self.clip_weight_max, optional=True)
        if (
            self.clip_weight_min is not None
            and self.clip_weight_max is not None
            and self.clip_weight_min > self.clip_weight_max
        ):
            raise ConfigError(
                f"{name}: `clip_weight_min` ({self.clip_weight_min}) must be <= `clip_weight_max` "
                f"({self.clip_weight_max}). Swap them or set one to None."
            )
        _check_number(name, "weight_decay_factor", self.weight_decay_factor, optional=True)
        if self.weight_decay_factor is not None and self.weight_decay_factor < 0:
            raise ConfigError(
                f"{name}: `weight_decay_factor` must be >= 0 (or None for no decay), got {self.weight_decay_factor}."
            )
        flag = self.multiply_weight_decay_factor_by_learning_rate
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(
                f"{name}: `multiply_weight_decay_factor_by_learning_rate` must be a bool or None, got {flag!r}."
            )
        object.__setattr__(self, "clipvalue", self._normalized_clipvalue(name))
        if not self.use_gradient_accumulation and self.clipvalue is not None:
            raise ConfigError(
                f"{name}: gradient clipping (`clipvalue`={self.clipvalue!r}) needs gradient accumulation, "
                "because it clips the accumulated per-row gradient. Set `use_gradient_accumulation=True` "
                "or `clipvalue=None`."
            )
        fn = getattr(self, "slot_variable_creation_fn", None)
        if fn is not None and not callable(fn):
            raise ConfigError(
                f"{name}: `slot_variable_creation_fn` must be either None or a callable taking "
                f"(table, slot_names, initializers), got {fn!r}."
            )
        if not isinstance(self.low_dimensional_packing_status, bool):
            raise TypeError(
                f"{name}: `low_dimensional_packing_status` must be a bool, got {self.low_dimensional_packing_status!r}."
            )
        self._validate()

    def _validate(self) -> None:
        """Optimizer-specific checks (overridden)."""

    def _normalized_clipvalue(self, name: str) -> ClipValue:
        cv = self.clipvalue
        if cv is None:
            return None
        if isinstance(cv, list):
            cv = tuple(cv)
        if isinstance(cv, tuple):
            if len(cv) != 2:
                raise ConfigError(f"{name}: `clipvalue` must be a scalar or a (min, max) pair, got {cv!r}.")
            lo, hi = cv
            _check_number(name, "clipvalue[0]", lo, optional=True)
            _check_number(name, "clipvalue[1]", hi, optional=True)
            if lo is not None and hi is not None and lo > hi:
                raise ConfigError(f"{name}: `clipvalue` min ({lo}) must be <= max ({hi}). Swap them.")
            return (lo, hi)
        _check_number(name, "clipvalue", cv)
        if cv < 0:
            raise ConfigError(
                f"{name}: a scalar `clipvalue` c clips to (-c, c) and must be >= 0, got {cv}. "
                "Pass a (min, max) pair for asymmetric clipping."
            )
        return cv

    # ------------------------------------------------------------------ helpers used by the engine
    @property
    def slot_names(self) -> tuple[str, ...]:
        """TF's slot names, in TF's order (``accumulators``, ``momenta``, ``velocities``, ``linears``)."""
        return self.SLOT_NAMES

    def slot_initial_values(self) -> tuple[float, ...]:
        """The constant each slot starts at, aligned with ``slot_names``."""
        return tuple(0.0 for _ in self.SLOT_NAMES)

    @property
    def gradient_clip_bounds(self) -> tuple[float | None, float | None]:
        """``clipvalue`` as ``(lower, upper)``; ``None`` is an open side."""
        cv = self.clipvalue
        if cv is None:
            return (None, None)
        if isinstance(cv, tuple):
            return cv
        return (-float(cv), float(cv))

    @property
    def lazy(self) -> bool:
        """True when rows without ids in the batch are left untouched (all but non-lazy Adam)."""
        return True

    @property
    def weight_decay_multiplied_by_lr(self) -> bool:
        return bool(self.weight_decay_factor) and bool(self.multiply_weight_decay_factor_by_learning_rate)


_COMMON_DOC = """
    Common arguments (TF's ``_Optimizer``): ``learning_rate`` is a float or a zero-argument callable
    evaluated once per ``apply_gradients``; ``use_gradient_accumulation`` sums every occurrence's
    gradient per row before one update (False applies occurrences one by one); ``clip_weight_min`` /
    ``clip_weight_max`` clamp updated weights; ``weight_decay_factor`` is decoupled decay of updated
    rows, multiplied by the learning rate when ``multiply_weight_decay_factor_by_learning_rate``;
    ``clipvalue`` clips the accumulated gradient (scalar c -> (-c, c), or (min, max) with None sides);
    ``slot_variable_creation_fn(table, slot_names, initializers) -> dict`` creates the slots;
    ``low_dimensional_packing_status`` is a TPU layout hint with no numeric effect.
"""


@dataclasses.dataclass(frozen=True)
class SGD(_Optimizer):
    """Stochastic gradient descent: ``w <- w - lr * g``. No slots."""

    learning_rate: LearningRate = 0.01
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False


@dataclasses.dataclass(frozen=True)
class Adagrad(_Optimizer):
    """Adagrad: ``a <- a + g^2; w <- w - lr * g / sqrt(a)`` (new accumulator, no epsilon).

    Slot ``accumulators`` starts at ``initial_accumulator_value`` (must be > 0).
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("accumulators",)

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        _check_number("Adagrad", "initial_accumulator_value", self.initial_accumulator_value)
        if self.initial_accumulator_value <= 0:
            raise ConfigError(
                "Adagrad: `initial_accumulator_value` must be a positive float (the update divides by "
                f"sqrt of the accumulator), got {self.initial_accumulator_value}."
            )
        _check_positive_float32(
            "Adagrad", "initial_accumulator_value", self.initial_accumulator_value, "the update divides by its sqrt"
        )

    def slot_initial_values(self) -> tuple[float, ...]:
        return (float(self.initial_accumulator_value),)


@dataclasses.dataclass(frozen=True)
class AdagradMomentum(_Optimizer):
    """Adagrad with momentum (TF v2): see ``docs/optimizers.md``.

    Slots ``accumulators`` and ``momenta`` start at 0.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("accumulators", "momenta")

    learning_rate: LearningRate = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2
    beta2: float = 1
    epsilon: float = 1e-10
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        for arg in ("momentum", "exponent", "beta2", "epsilon"):
            _check_number("AdagradMomentum", arg, getattr(self, arg))
        if not isinstance(self.use_nesterov, bool):
            raise TypeError(f"AdagradMomentum: `use_nesterov` must be a bool, got {self.use_nesterov!r}.")
        if self.epsilon <= 0:
            raise ConfigError(f"AdagradMomentum: `epsilon` must be positive, got {self.epsilon}.")
        if self.exponent <= 0:
            raise ConfigError(f"AdagradMomentum: the precondition `exponent` must be > 0, got {self.exponent}.")
        if not 0 < self.beta2 <= 1:
            raise ConfigError(
                f"AdagradMomentum: `beta2` must be in (0, 1] (1 sums squared gradients, < 1 averages them), got "
                f"{self.beta2}."
            )
        _check_positive_float32("AdagradMomentum", "epsilon", self.epsilon, "it is raised to -1/exponent")
        if as_float32(self.epsilon) ** (-1.0 / self.exponent) > FLOAT32_MAX:
            raise ConfigError(
                f"AdagradMomentum: epsilon^(-1/exponent) = {self.epsilon}^(-1/{self.exponent}) overflows float32, "
                "so a row with a zero accumulator would get an infinite step. Raise `epsilon` or `exponent`."
            )


@dataclasses.dataclass(frozen=True)
class Adam(_Optimizer):
    """Adam without bias correction (TPU Adam); lazy by default.

    ``m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2; w <- w - lr m / sqrt(v + eps^2)`` (or
    ``sqrt(v) + eps`` when ``sum_inside_sqrt=False``). Slots ``momenta`` and ``velocities`` start at 0.
    ``lazy_adam=False`` updates every row of the table each step and needs gradient accumulation.
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("momenta", "velocities")

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-07
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        for arg in ("beta_1", "beta_2", "epsilon"):
            _check_number("Adam", arg, getattr(self, arg))
        for arg in ("lazy_adam", "sum_inside_sqrt"):
            if not isinstance(getattr(self, arg), bool):
                raise TypeError(f"Adam: `{arg}` must be a bool, got {getattr(self, arg)!r}.")
        for arg in ("beta_1", "beta_2"):
            value = getattr(self, arg)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"Adam: `{arg}` must be >= 0 and < 1, got {value}.")
        if self.epsilon <= 0:
            raise ConfigError(f"Adam: `epsilon` must be positive, got {self.epsilon}.")
        eps = as_float32(self.epsilon)
        if not as_float32(eps * eps) >= FLOAT32_MIN_NORMAL:
            raise ConfigError(
                f"Adam: `epsilon`={self.epsilon!r} squared underflows float32 ({as_float32(eps * eps)!r}), so a row "
                "with zero velocities would divide by zero. Use epsilon >= 1.1e-19 (TF's default is 1e-7)."
            )
        if not self.lazy_adam and not self.use_gradient_accumulation:
            raise ConfigError(
                "Adam: non-lazy Adam (`lazy_adam=False`) updates every row from an accumulated gradient, "
                "so it needs gradient accumulation. Set `use_gradient_accumulation=True` or `lazy_adam=True`."
            )

    @property
    def lazy(self) -> bool:
        return self.lazy_adam


@dataclasses.dataclass(frozen=True)
class FTRL(_Optimizer):
    """Follow-the-regularized-leader (TF v2 FTRL); see ``docs/optimizers.md``.

    Slots ``accumulators`` (starts at ``initial_accumulator_value``, must be > 0) and ``linears``
    (starts at 0; holds ``lr * z`` when ``multiply_linear_by_learning_rate``).
    """

    SLOT_NAMES: ClassVar[tuple[str, ...]] = ("accumulators", "linears")

    learning_rate: LearningRate = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: SlotVariableCreationFn | None = None
    clipvalue: ClipValue = None
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False
    low_dimensional_packing_status: bool = False

    def _validate(self) -> None:
        for arg in (
            "learning_rate_power",
            "l1_regularization_strength",
            "l2_regularization_strength",
            "beta",
            "initial_accumulator_value",
        ):
            _check_number("FTRL", arg, getattr(self, arg))
        for arg in ("multiply_linear_by_learning_rate", "allow_zero_accumulator"):
            if not isinstance(getattr(self, arg), bool):
                raise TypeError(f"FTRL: `{arg}` must be a bool, got {getattr(self, arg)!r}.")
        for arg in ("l1_regularization_strength", "l2_regularization_strength", "beta"):
            if getattr(self, arg) < 0:
                raise ConfigError(f"FTRL: `{arg}` must be >= 0 (as TF documents), got {getattr(self, arg)}.")
        if self.learning_rate_power > 0:
            raise ConfigError(
                f"FTRL: `learning_rate_power` must be <= 0 (as TF v1 checks; -0.5 is the default), got "
                f"{self.learning_rate_power}."
            )
        if (
            not callable(self.learning_rate)
            and not self.multiply_linear_by_learning_rate
            and as_float32(self.learning_rate) == 0
        ):
            raise ConfigError(
                f"FTRL: `learning_rate`={self.learning_rate!r} is 0 in float32, and the update divides by it. Use a "
                "non-zero learning rate (or multiply_linear_by_learning_rate=True)."
            )
        if self.initial_accumulator_value > 0:
            _check_positive_float32(
                "FTRL", "initial_accumulator_value", self.initial_accumulator_value, "it is raised to a power"
            )
        if self.initial_accumulator_value <= 0:
            raise ConfigError(
                f"FTRL: `initial_accumulator_value` must be a positive float, got {self.initial_accumulator_value}."
            )

    def slot_initial_values(self) -> tuple[float, ...]:
        return (float(self.initial_accumulator_value), 0.0)


CORE_OPTIMIZER_TYPES: tuple[type[_Optimizer], ...] = (SGD, Adagrad, AdagradMomentum, Adam, FTRL)

for _cls in CORE_OPTIMIZER_TYPES:
    _cls.__doc__ = (_cls.__doc__ or "") + _COMMON_DOC
