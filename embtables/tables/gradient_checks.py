"""``GradientChecks``: every activation gradient validated before phase 1 reads it.

A gradient reaches phase 1 as a float32 [S, D] tensor on the tables' device: contiguous, or (one process,
``column_block``) a feature's columns of the concatenated activations' gradient, which phase 1 reads in
place. A gradient of another floating dtype, device or layout is converted; a wrong type, shape or layout
raises naming the feature, its table and the fix. Nothing here changes a table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.errors import InputError
from embtables.kernels import native
from embtables.tables.backends.table_set import TableSet
from embtables.tables.inputs import FeatureBatch


class GradientChecks:
    """The checks of the F activation gradients of the tables in ``tables``."""

    def __init__(self, tables: TableSet) -> None:
        self.set = tables
        self.dims = [tables.table_of(i).dim for i in range(len(tables.features))]  # D of every feature

    def check_all(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Any], *, column_block: bool = False
    ) -> list[Tensor | None]:
        """``check`` of every feature, with the common case (a contiguous float32 [S, D] CPU tensor that does
        not require grad, on CPU tables) tested in one loop."""
        if self.set.device.type != "cpu":
            return [self.check(i, b, g, column_block=column_block) for i, (b, g) in enumerate(zip(batches, grads))]
        f32, strided = torch.float32, torch.strided
        out: list[Tensor | None] = []
        for i, (batch, grad, dim) in enumerate(zip(batches, grads, self.dims)):
            if (
                type(grad) is Tensor
                and grad.dtype is f32
                and grad.is_cpu
                and grad.layout is strided
                and not grad.is_nested
                and len(batch.out_shape) == 1
                and grad.shape == (batch.out_shape[0], dim)
                and not grad.requires_grad
                and grad.is_contiguous()
            ):
                out.append(grad)
            else:
                out.append(self.check(i, batch, grad, column_block=column_block))
        return out

    def check(self, feature_index: int, batch: FeatureBatch, grad: Any, *, column_block: bool = False) -> Tensor | None:
        """Validate one activation gradient (None is allowed); returns it as [S, D] float32, contiguous,
        or with ``column_block`` also a column block of a wider gradient (rows further apart, unit column
        stride: a feature's columns of the concatenated activations' gradient, which phase 1 reads in
        place)."""
        if grad is None:
            return None
        feature = self.set.features[feature_index]
        table = self.set.table_of(feature_index)
        weights = self.set.states[table.name].weights
        if (  # the common case: already what phase 1 reads
            type(grad) is Tensor
            and grad.dtype is torch.float32
            and len(batch.out_shape) == 1
            and (grad.is_cpu if weights.is_cpu else grad.device == weights.device)
            and grad.layout is torch.strided
            and not grad.is_nested  # a strided nested tensor has no shape to compare
            and grad.shape == (batch.out_shape[0], table.dim)
            and not grad.requires_grad
            and (grad.is_contiguous() or (column_block and native.gradient_rows(grad, table.dim) is not None))
        ):
            return grad
        expected = (*batch.out_shape, table.dim)
        if not isinstance(grad, Tensor):
            raise TypeError(
                f"feature {feature.name!r}: the gradient must be a Tensor or None, got {type(grad).__name__}."
            )
        if grad.layout != torch.strided or grad.is_nested:
            raise TypeError(
                f"feature {feature.name!r} (table {table.name!r}): the gradient must be a dense (strided) tensor, "
                f"got layout {grad.layout}{' (nested)' if grad.is_nested else ''}. Pass grad.to_dense()."
            )
        if tuple(grad.shape) != expected:
            raise InputError(
                f"feature {feature.name!r} (table {table.name!r}): gradient shape {list(grad.shape)} does not "
                f"match the activation shape {list(expected)} (output_shape + [dim]). Pass d(loss)/d(activation)."
            )
        if not torch.is_floating_point(grad):
            raise TypeError(f"feature {feature.name!r}: the gradient must be floating point, got {grad.dtype}.")
        # contiguous(): the native update reads raw rows; a transposed or sliced gradient must not
        # silently send the table down the slower torch path.
        return grad.detach().to(weights.device, torch.float32).reshape(batch.num_segments, table.dim).contiguous()
