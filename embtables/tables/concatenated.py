"""Concatenated activations: every feature's pooled activation side by side in one [B, sum(D)] tensor.

A model that concatenates its embeddings anyway (DLRM, wide-and-deep, the Estimator's input layer) gets
them as one tensor, in the flattened feature order (``tf.nest`` order: dict keys sorted), with one
gradient back instead of F. That is what TorchRec's ``KeyedTensor`` and FBGEMM's table-batched output
give; at small batches it also saves autograd most of its per-step work (one leaf instead of F).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeGuard

import torch
from torch import Tensor

from embtables.config import ResolvedConfig
from embtables.errors import ConfigError, InputError
from embtables.kernels.column_blocks import ColumnBlocks
from embtables.tables.inputs import FeatureBatch

logger = logging.getLogger("embtables")


def column_starts(resolved: ResolvedConfig) -> tuple[list[int], int]:
    """Each feature's first column in the concatenated activations [B, sum(D)] (flattened feature order), and
    their width sum(D)."""
    starts, at = [], 0
    for f in resolved.features:
        starts.append(at)
        at += resolved.tables[f.table_index].dim
    return starts, at


class ConcatLayout:
    """Where each feature's D columns sit in the concatenated activation [B, sum(D)] (flattened feature
    order). Built for a resolved config whose features all pool to one row per example."""

    def __init__(self, resolved: ResolvedConfig) -> None:
        for f in resolved.features:
            cfg = f.config
            if cfg.max_sequence_length:
                raise ConfigError(
                    f"feature {f.name!r}: concat_activations=True needs every activation to be [B, D], but this is a "
                    f"sequence feature (max_sequence_length={cfg.max_sequence_length}, activations [B, M, D]). Use "
                    "the nest of activations (concat_activations=False) for sequence features."
                )
            if cfg.output_shape is not None and len(cfg.output_shape) != 1:
                raise ConfigError(
                    f"feature {f.name!r}: concat_activations=True needs every activation to be [B, D], but its "
                    f"output_shape is {list(cfg.output_shape)}. Give it a one-dimensional output_shape (or none)."
                )
        self.names = [f.name for f in resolved.features]
        self.dims = [resolved.tables[f.table_index].dim for f in resolved.features]
        starts, self.width = column_starts(resolved)
        self.starts = tuple(starts)
        self.columns = {name: (a, a + dim) for name, a, dim in zip(self.names, starts, self.dims)}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if "starts" not in state:  # pickled before the gradient went to phase 1 as column blocks
            self.starts = tuple(start for start, _ in self.columns.values())

    def check_batches(self, batches: Sequence[FeatureBatch]) -> None:
        """Raise ``InputError`` unless every feature's batch pools to the same B rows (one per example)."""
        first = batches[0].out_shape if batches else ()
        for name, b in zip(self.names, batches):
            if len(b.out_shape) != 1 or b.out_shape != first:
                raise InputError(
                    f"feature {name!r}: concat_activations=True needs every feature to give the same batch of "
                    f"[B] bags, but feature {self.names[0]!r} gives {list(first)} and this one {list(b.out_shape)} "
                    "(a dense input of more than one dimension looks up every element on its own, or a different "
                    "batch size). Pass each feature the same B examples: dense ids [B] (one id each), or a Ragged "
                    "or sparse input of B rows (several ids per example, combined)."
                )

    def whole_gradient_ok(self, gradient: object, activation: Tensor) -> TypeGuard[Tensor]:
        """Whether ``gradient`` is already what one process's phase 1 reads in its column blocks: a dense
        float32 CPU tensor shaped like the activation [B, W] with unit column stride and rows at least W
        apart, not requiring grad (then every block [B, D_f] passes the per-feature gradient check)."""
        return (
            type(gradient) is Tensor
            and gradient.dtype is torch.float32
            and gradient.is_cpu
            and activation.is_cpu
            and gradient.layout is torch.strided
            and not gradient.is_nested
            and not gradient.requires_grad
            and gradient.dim() == 2
            and gradient.shape == activation.shape
            and (gradient.stride(1) == 1 or gradient.shape[1] <= 1)
            and (gradient.stride(0) >= self.width or gradient.shape[0] <= 1)
        )

    def blocks(self, gradient: Tensor) -> ColumnBlocks:
        """The F per-feature gradients [B, D_f] of a gradient that ``whole_gradient_ok`` accepted, as column
        blocks that one process's phase 1 reads in place (views cut only when asked for)."""
        return ColumnBlocks(gradient, self.starts, self.dims)

    def split_gradient(self, gradient: object, activation: Tensor, explicit: bool) -> list[Tensor | None]:
        """The F per-feature gradients [B, D_f] (column views) of a gradient of the concatenated
        activation: ``gradient`` passed to ``apply_gradients`` (``explicit``) or its ``.grad``. None (no
        gradient reached it) is a zero gradient for every feature, logged."""
        if gradient is None:
            why = "gradient is None" if explicit else "no gradient reached the concatenated activation"
            logger.warning("features %s: %s; applying a zero gradient.", ", ".join(map(repr, self.names)), why)
            return [None] * len(self.names)
        if not isinstance(gradient, Tensor):
            raise TypeError(
                "apply_gradients: with concat_activations=True the gradient must be one Tensor shaped like the "
                f"concatenated activation [B, {self.width}] (or None), got {type(gradient).__name__}."
            )
        if tuple(gradient.shape) != tuple(activation.shape):
            raise InputError(
                f"apply_gradients: gradient shape {list(gradient.shape)} does not match the concatenated activation "
                f"shape {list(activation.shape)} ([B, sum of the features' dims]). Pass d(loss)/d(activation)."
            )
        return list(torch.split_with_sizes(gradient, self.dims, dim=1))
