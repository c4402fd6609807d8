"""Table initializers: callables ``(shape, dtype) -> Tensor``, like TF's initializers."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

_DRAW_VALUES = 1 << 22  # float32 values drawn at a time into a half-precision table (16 MiB)


def _generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


@dataclasses.dataclass(frozen=True)
class TruncatedNormal:
    """Normal(mean, stddev) cut at 2 stddev (TF ``TruncatedNormal``); ``seed`` makes it reproducible
    independently of the global torch RNG."""

    mean: float = 0.0
    stddev: float = 0.05
    seed: int | None = None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        """The float32 draw of ``shape``, rounded to nearest into ``dtype``. Another ``dtype`` (a half table's
        storage) is filled a block of rows at a time from float32 draws of the same generator, so the values
        are bit for bit those of one float32 draw rounded, without the whole float32 table in memory."""
        gen = _generator(self.seed)
        if dtype == torch.float32 or len(shape) != 2:
            return self._draw(shape, gen).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        step = max(1, _DRAW_VALUES // max(1, shape[1]))
        for start in range(0, shape[0], step):  # uniform_ consumes the generator value by value: the same draws
            stop = min(shape[0], start + step)
            out[start:stop].copy_(self._draw((stop - start, shape[1]), gen))  # rounded to nearest
        return out

    def _draw(self, shape: tuple[int, ...], gen: torch.Generator | None) -> Tensor:
        out = torch.empty(shape, dtype=torch.float32)
        # Inverse-CDF sampling, as torch.nn.init.trunc_normal_, with an explicit generator.
        lo, hi = -2.0, 2.0
        cdf_lo = 0.5 * (1.0 + torch.erf(torch.tensor(lo) / 2**0.5))
        cdf_hi = 0.5 * (1.0 + torch.erf(torch.tensor(hi) / 2**0.5))
        out.uniform_(2 * float(cdf_lo) - 1, 2 * float(cdf_hi) - 1, generator=gen)
        out.erfinv_().mul_(self.stddev * 2**0.5).add_(self.mean)
        out.clamp_(self.mean + lo * self.stddev, self.mean + hi * self.stddev)
        return out

    def block(self, start: int, shape: tuple[int, int], seed: int) -> Tensor:
        """Rows [start, start + shape[0]) of an offloaded table: drawn from ``seed``, the block's own seed."""
        return dataclasses.replace(self, seed=seed)(shape)


@dataclasses.dataclass(frozen=True)
class Constant:
    """Every value is ``value``."""

    value: float = 0.0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.full(shape, float(self.value), dtype=dtype)

    def block(self, start: int, shape: tuple[int, int], seed: int) -> Tensor:
        """Rows [start, start + shape[0]) of an offloaded table."""
        return self(shape)


@dataclasses.dataclass(frozen=True)
class RowIdInitializer:
    """Row r is filled with ``offset + r`` (TF ``RowIdInitializer``); makes rows identifiable in tests."""

    offset: float = 0.0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        rows = torch.arange(shape[0], dtype=torch.float64) + self.offset
        return rows.reshape(-1, *([1] * (len(shape) - 1))).expand(shape).to(dtype).clone()

    def block(self, start: int, shape: tuple[int, int], seed: int) -> Tensor:
        """Rows [start, start + shape[0]) of an offloaded table: ``offset + start + i``."""
        return RowIdInitializer(self.offset + start)(shape)


def default_initializer(dim: int) -> TruncatedNormal:
    """TF's default for ``TableConfig(initializer=None)``: TruncatedNormal(0, 1/sqrt(dim))."""
    return TruncatedNormal(mean=0.0, stddev=1.0 / dim**0.5)
