"""Subnormal float32 values flushed to zero on the torch path, as TF's CPU kernels and TPUs do (spec §1.5).

The C kernels run with the CPU's flush-to-zero and denormals-are-zero modes (``ET_FLUSH_SUBNORMALS`` in
``csrc/embtables_native.c``): every float32 operation reads a subnormal operand as zero and writes a subnormal
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
from torch import Tensor
from torch.overrides import TorchFunctionMode

SMALLEST_NORMAL = 2.0**-126
"""The smallest positive normal float32 (``torch.finfo(torch.float32).tiny``); anything smaller is flushed."""


def flush(t: Tensor) -> Tensor:
    """``t`` with every float32 value of magnitude below ``SMALLEST_NORMAL`` replaced by a zero of its sign (``t``
    itself when it is not float32). No host synchronisation: a new tensor every time."""
    if t.dtype is not torch.float32:
        return t
    return torch.where(t.abs() < SMALLEST_NORMAL, t * 0.0, t)


def flush_scalar(x: float) -> float:
    """A Python float operand as the flushing hardware reads it."""
    return x * 0.0 if abs(x) < SMALLEST_NORMAL else x


class _Flushing(TorchFunctionMode):
    """Every float32 tensor result flushed; Python float operands read as the hardware reads them."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        args = tuple(flush_scalar(a) if type(a) is float else a for a in args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and out.dtype is torch.float32 and not getattr(func, "__name__", "").endswith("_"):
            return flush(out)
        return out


@contextmanager
def flushing() -> Iterator[None]:
    """Run out-of-place float32 torch arithmetic with subnormal results flushed after every operation."""
    with _Flushing():
        yield
