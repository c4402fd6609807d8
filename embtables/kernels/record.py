"""``KernelRecord``: everything the engine knows about one optimizer, beside its config class.

Each optimizer's kernel module (``kernels/<name>.py``) defines its record next to its row math: the
torch row update, the native kernel's id and named constants (float32, derived exactly as the torch
kernel derives them), the bounds that prove an update finite, and the domain of each slot. The
registry (``kernels/registry.py``) lists the records; every dispatch (the torch update, the native
parameter block, the finiteness proof, state validation, the docs table) goes through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from torch import Tensor

from embtables.config.optimizers import SHARED_FIELDS

Domain = Literal["any", "nonnegative", "positive"]
RowUpdateFn = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]
# (opt, lr, g, w_dec, hi, lo) -> bounds on |new value| of (weights, *slots), or None when not proven;
# g: max |clipped summed gradient|; w_dec: bound on |decayed weight|; hi / lo: bounds on max |value|
# and on min value of (weights, *slots) before the update (see kernels/finite_guard.py).
BoundsFn = Callable[[Any, float, float, float, tuple[float, ...], tuple[float, ...]], "tuple[float, ...] | None"]
# (weights [V, D], slots, rows [N], grads [N, D], opt, lr) -> None: occurrences applied in order, in place
InOrderFn = Callable[[Tensor, tuple[Tensor, ...], Tensor, Tensor, Any, float], None]

SAFE = 1e30  # every bounded intermediate must stay below this (float32 max is 3.4e38)
F32_MIN_NORMAL = 1.1754944e-38


def bounded(*values: float) -> bool:
    """True when every value is finite and below ``SAFE`` (far from float32's overflow). One comparison
    chain per value: NaN and the infinities fail it (a loop: this runs several times per table per step)."""
    for v in values:  # noqa: SIM110 - a plain loop: all(genexpr) costs a generator per call
        if not -SAFE < v < SAFE:
            return False
    return True


def _none(opt: Any, *args: Any) -> dict[str, Any]:
    return {}


def slot_domains_of(domains: dict[str, Domain]) -> Callable[[Any], tuple[Domain, ...]]:
    """Fixed domains by slot name (slots not named are ``any``)."""
    return lambda opt: tuple(domains.get(s, "any") for s in opt.SLOT_NAMES)


def _all_any(opt: Any) -> tuple[Domain, ...]:
    return tuple("any" for _ in opt.SLOT_NAMES)


@dataclasses.dataclass(frozen=True)
class KernelRecord:
    """One optimizer's kernel facts.

    Attributes:
      config: the v2 config class (``embtables.Adagrad``...); its ``SLOT_NAMES`` order is the slots' order.
      native_kind: the optimizer's id in the C source (``ET_<NAME>``).
      native_name: its member of the C unions ``et_flags`` / ``et_constants`` (``adam``...).
      update_rows: ``(w [U, D], slots, g [U, D], *, opt, lr) -> (w, slots)``, the torch row math.
      flag_names / constant_names: the named fields of its C union members, in their C order.
      flags: ``opt -> {flag: bool}`` for ``flag_names``.
      constants: ``(opt, lr) -> {constant: float}`` for ``constant_names``, each the float32 value the
        torch kernel uses.
      bounds: proves an update finite (see ``BoundsFn``); None proves nothing (the exact dry run).
      slot_domains: ``opt -> (domain per slot)``: values a slot must keep (checked at load).
      divides_by_learning_rate: ``opt -> bool``: a learning rate of 0 would divide by zero.
      power_is_sqrt: ``constants -> bool`` (of ``native_constants``): the update's power is a square root,
        which the GPU kernel takes exactly with ``sqrt_rn`` instead of ``powf``.
      in_order: the no-accumulation update (occurrences applied one at a time, in order) in a few vectorised
        torch operations, where one exists (``kernels/sequential.py``); None: round by round.
      v1_names: ``(v2 field, v1 argument)`` pairs where TF v1's ``*Parameters`` class spells one of the
        optimizer's own fields differently (``beta_1`` is v1's ``beta1``); others share the v2 name.
    """

    config: type[Any]
    native_kind: int
    native_name: str
    update_rows: RowUpdateFn
    flag_names: tuple[str, ...] = ()
    constant_names: tuple[str, ...] = ()
    flags: Callable[[Any], dict[str, bool]] = _none
    constants: Callable[[Any, float], dict[str, float]] = _none
    bounds: BoundsFn | None = None
    slot_domains: Callable[[Any], tuple[Domain, ...]] = _all_any
    divides_by_learning_rate: Callable[[Any], bool] = lambda opt: False
    power_is_sqrt: Callable[[dict[str, float]], bool] = lambda constants: False
    in_order: InOrderFn | None = None
    v1_names: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = {v2 for v2, _ in self.v1_names} - set(self.own_fields())
        if unknown:
            raise ValueError(f"{self.config.__name__}: v1 names for fields it does not have: {sorted(unknown)}.")
        if len(self.flag_names) > 2 or len(self.constant_names) > 8:
            raise ValueError(f"{self.config.__name__}: the C parameter block holds 2 flags and 8 constants.")

    def own_fields(self) -> tuple[str, ...]:
        """The optimizer's own hyperparameters (its config's fields beyond ``SHARED_FIELDS``), in TF's order."""
        return tuple(f.name for f in dataclasses.fields(self.config) if f.name not in SHARED_FIELDS)

    def v1_name(self, field: str) -> str:
        """The TF v1 argument name of the own field ``field``."""
        return dict(self.v1_names).get(field, field)

    def native_flags(self, opt: Any) -> dict[str, bool]:
        """``flags(opt)``, checked to name exactly ``flag_names``."""
        return _exactly(self, "flags", self.flags(opt), self.flag_names)

    def native_constants(self, opt: Any, lr: float) -> dict[str, float]:
        """``constants(opt, lr)``, checked to name exactly ``constant_names``."""
        return _exactly(self, "constants", self.constants(opt, lr), self.constant_names)


def _exactly(record: KernelRecord, what: str, values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    if tuple(values) != names:
        raise RuntimeError(f"{record.config.__name__}: native {what} {tuple(values)} must be {names}, in that order.")
    return values
