"""Half-precision tables (``TableConfig.dtype`` bfloat16 / float16, spec §12): rows read as float32 and
updated values rounded to the storage types as they are written.

The rounding of a written row is stochastic (``TableConfig.rounding="stochastic"``, the default) or to
nearest. Its random bits depend on (``rounding_seed``, the step, the table's index in the config, the
row's global id, the column) only: column c < D is the weights' column c, column (k + 1) * D + c slot k's
column c. The native kernels round the weights with the same bits (``native.round_rows``); the torch
functions of ``kernels/stochastic_rounding.py`` round everything else.

Shapes: U rows of an update, D columns, K slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.kernels import native
from embtables.kernels.stochastic_rounding import random_bits, round_to


def as_float32(t: Tensor) -> Tensor:
    """``t`` as float32 (itself when it already is): what every update and lookup computes in."""
    return t if t.dtype is torch.float32 else t.to(torch.float32)


def rounded_update(
    table: ResolvedTable,
    rows: Tensor,
    step: int,
    weights: Tensor,
    slots: Sequence[Tensor],
    row_dtype: torch.dtype,
    slot_dtype: torch.dtype,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The float32 update of ``rows`` [U] (global ids) of ``table``, ``weights`` [U, D] and ``slots`` (K x
    [U, D]), rounded to the storage types ``row_dtype`` / ``slot_dtype`` (a float32 part is returned as it
    is). A float16 value beyond 65504 becomes an infinity: the caller's finiteness check refuses it."""
    config = table.config
    stochastic = config.rounding == "stochastic"
    dim = weights.shape[1]
    bits = None
    if stochastic and (slot_dtype is not torch.float32 and slots):
        bits = random_bits(config.rounding_seed, step, table.index, rows, dim * (1 + len(slots)))
    out_w = weights
    if row_dtype is not torch.float32:
        if not stochastic:
            out_w = round_to(weights, row_dtype, None)
        elif bits is not None:
            out_w = round_to(weights, row_dtype, bits[:, :dim])
        else:
            out_w = _weights_rounded(config.rounding_seed, step, table.index, rows, weights, row_dtype)
    out_s = tuple(slots)
    if slot_dtype is not torch.float32:
        out_s = tuple(
            round_to(s, slot_dtype, None if bits is None else bits[:, (k + 1) * dim : (k + 2) * dim])
            for k, s in enumerate(slots)
        )
    return out_w, out_s


def _weights_rounded(seed: int, step: int, table: int, rows: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """The weights [U, D] stochastically rounded: in C on the CPU when the native kernels are built (the same
    bits), else in torch."""
    if weights.is_cpu and rows.is_cpu:
        done = native.round_rows(weights.contiguous(), rows.to(torch.int64).contiguous(), seed, step, table, dtype)
        if done is not None:
            return done
    return round_to(weights, dtype, random_bits(seed, step, table, rows, weights.shape[1]))
