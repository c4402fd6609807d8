"""Learning rates of one step: each distinct learning-rate callable evaluated once, checked, and
rounded to the float32 the kernels use (spec §1.1.8)."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.config.optimizers import FLOAT32_MAX, as_float32
from embtables.errors import InputError
from embtables.kernels.registry import record_of


class LearningRatePlan:
    """What ``rates()`` needs of a config, worked out once (a table collection keeps one for its config):
    each distinct callable with the tables that use it, those of them that divide by it (FTRL), and
    whether it takes no argument (``inspect.signature`` costs about 70 us); each table's fixed rate
    (float32) or the index of its callable. It holds nothing the config does not already hold."""

    def __init__(self, resolved: ResolvedConfig) -> None:
        self.resolved = resolved
        callables = resolved.learning_rate_callables()
        index = {id(fn): k for k, fn in enumerate(callables)}
        self.callables: list[tuple[Callable[[], float], list[ResolvedTable], list[str], bool]] = []
        for fn in callables:
            users = [t for t in resolved.tables if t.optimizer.learning_rate is fn]
            divides = [t.name for t in users if record_of(t.optimizer).divides_by_learning_rate(t.optimizer)]
            self.callables.append((fn, users, divides, _takes_no_argument(fn)))
        self.fixed: dict[str, float] = {}
        self.dynamic: list[tuple[str, int]] = []
        for t in resolved.tables:
            lr = t.optimizer.learning_rate
            if callable(lr):
                self.dynamic.append((t.name, index[id(lr)]))
            else:
                self.fixed[t.name] = as_float32(float(lr))

    def rates(self) -> dict[str, float]:
        """``{table name: learning rate}`` for this step: every callable called once, checked, float32."""
        values = [_checked_lr(fn, users, divides, ok) for fn, users, divides, ok in self.callables]
        out = dict(self.fixed)
        for name, k in self.dynamic:
            out[name] = values[k]
        return out


def _takes_no_argument(fn: Callable[[], float]) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        return False
    except ValueError:
        pass  # no signature (a builtin): just call it
    return True


def _who(tables: list[ResolvedTable]) -> str:
    return "table " + ", ".join(repr(t.name) for t in tables)


def _checked_lr(
    fn: Callable[[], float], tables: list[ResolvedTable], divides: list[str], takes_no_argument: bool
) -> float:
    """Call a dynamic learning rate once and check its value as the float32 the kernels use (``divides``:
    the tables among ``tables`` that divide by it)."""
    if not takes_no_argument:
        who = _who(tables)
        raise TypeError(
            f"{who}: the learning_rate callable {fn!r} needs arguments; it must be a zero-argument callable "
            "(e.g. `lambda: schedule(step)`), evaluated once per apply_gradients. No table or slot was changed."
        )
    try:
        value = fn()
    except Exception as exc:
        raise RuntimeError(
            f"{_who(tables)}: the learning_rate callable raised {type(exc).__name__}: {exc}. No table or slot was "
            "changed."
        ) from exc
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(
            f"{_who(tables)}: the learning_rate callable must return a float, got {type(value).__name__} {value!r}. "
            "No table or slot was changed."
        )
    if isinstance(value, Tensor) and (value.numel() != 1 or value.dtype == torch.bool):
        raise TypeError(f"{_who(tables)}: the learning_rate callable returned a tensor {value!r}; return a float.")
    lr = float(value)
    lr32 = as_float32(lr) if math.isfinite(lr) and abs(lr) <= FLOAT32_MAX else math.inf
    if not math.isfinite(lr32):
        raise InputError(
            f"{_who(tables)}: the learning_rate callable returned {lr!r}, which is not finite in float32 (the kernels' "
            "precision). No table or slot was changed."
        )
    if lr32 == 0 and divides:
        raise InputError(
            f"{_who(tables)}: the learning_rate callable returned {lr!r}, which is 0 in float32, and FTRL table(s) "
            f"{divides} divide by the learning rate. No table or slot was changed."
        )
    return lr32
