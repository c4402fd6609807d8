"""Subnormal float32 values flushed to zero on the torch path, as TF's CPU kernels and TPUs do (spec §1.5).

The C kernels run with the CPU's flush-to-zero and denormals-are-zero modes (``ET_FLUSH_SUBNORMALS`` in
``csrc/embtables_native.h``): every float32 operation reads a subnormal operand as zero and writes a subnormal
result as zero. The torch functions do the same in software: ``flush`` zeroes the subnormals of a tensor (keeping
their sign, as the hardware does), and ``flushing()`` is a context in which every torch operation's float32
result is flushed and every Python float operand below the smallest normal is read as zero. A row function run
on flushed inputs inside ``flushing()`` therefore computes what the C kernels compute, operation by operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

SMALLEST_NORMAL = 2.0**-126
"""The smallest positive normal float32 (``torch.finfo(torch.float32).tiny``); anything smaller is flushed."""
_LARGEST_SUBNORMAL = 2.0**-126 - 2.0**-149


def flush(t: Tensor) -> Tensor:
    """``t`` with every float32 value of magnitude below ``SMALLEST_NORMAL`` replaced by a zero of its sign (``t``
    itself when it is not float32). No host synchronisation: a new tensor every time."""
    if t.dtype is not torch.float32:
        return t
    # hardshrink keeps |x| > the largest subnormal, zeroes the rest as +0; copysign gives the zero its sign
    return torch.copysign(F.hardshrink(t, _LARGEST_SUBNORMAL), t)


def flush_scalar(x: float) -> float:
    """A Python float operand as the flushing hardware reads it."""
    return x * 0.0 if abs(x) < SMALLEST_NORMAL else x


# Operations whose float32 result is never a nonzero subnormal when their operands are flushed floats: they
# select, compare, copy or move a value, or (sqrt) take it toward 1. Every other operation's result is flushed.
_EXACT_NAMES = (
    "__get__ __getitem__ abs __abs__ neg __neg__ clamp clamp_min clamp_max maximum minimum where sign "
    "sqrt ge gt le lt eq ne __ge__ __gt__ __le__ __lt__ __eq__ __ne__ double full_like zeros_like "
    "ones_like contiguous clone detach view reshape unsqueeze squeeze expand index_select cat stack"
)
_EXACT = frozenset(_EXACT_NAMES.split())


class _Flushing(TorchFunctionMode):
    """Every float32 tensor result flushed (but those of ``_EXACT`` operations and in-place ones); Python float
    operands read as the hardware reads them."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        args = tuple(flush_scalar(a) if type(a) is float else a for a in args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and out.dtype is torch.float32:
            name = getattr(func, "__name__", "")
            if name not in _EXACT and not name.endswith("_") and not _adds_zero(name, args):
                return flush(out)
        return out


def _adds_zero(name: str, args: tuple[Any, ...]) -> bool:
    """``t + 0.0``: the operand itself, or +0 for -0."""
    return name in ("add", "__add__", "__radd__") and len(args) == 2 and type(args[1]) is float and args[1] == 0.0


@contextmanager
def flushing() -> Iterator[None]:
    """Run out-of-place float32 torch arithmetic with subnormal results flushed after every operation."""
    with _Flushing():
        yield
