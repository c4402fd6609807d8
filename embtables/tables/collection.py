"""``EmbeddingCollection``: all tables of a resolved config in one process, with the pooled lookup
and the fused sparse update. ``DistributedEmbedding`` (``embtables.api``) wraps it with the TF verbs.

Every ``apply`` is two-phase: phase 1 computes and validates every table's gradient (shapes,
finiteness, learning rates) without touching state; phase 2 updates. A bad batch therefore
changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import InputError
from embtables.kernels import native, sparse_update_
from embtables.kernels.clip_decay import effective_weight_decay
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum, occurrence_rounds
from embtables.kernels.sparse_update import as_float32
from embtables.tables.inputs import FeatureBatch
from embtables.tables.state import TableState, create_table_state


@dataclasses.dataclass(frozen=True, eq=False)
class TableGradient:
    """One table's validated gradient for one step.

    With accumulation, ``rows`` [U] are distinct and ``grads`` [U, D] are their summed gradients;
    without it, ``rows`` [N] / ``grads`` [N, D] are single occurrences in the order they apply.
    On the native path the accumulated rows and sums stay in C memory (``prepared``).
    """

    table: ResolvedTable
    rows: Tensor | None
    grads: Tensor | None
    accumulated: bool
    prepared: native.Workspace | None = None


class EmbeddingCollection:
    """Tables of ``resolved`` on ``device``; single process. A plain object: the ``nn.Module``
    integration (``.to()``, ``state_dict``) lives in ``DistributedEmbedding``."""

    def __init__(self, resolved: ResolvedConfig, device: torch.device) -> None:
        self.resolved = resolved
        self.states: dict[str, TableState] = {t.name: create_table_state(t, device) for t in resolved.tables}
        self._workspaces: dict[str, native.Workspace] = {}

    @property
    def device(self) -> torch.device:
        return next(iter(self.states.values())).weights.device

    # ------------------------------------------------------------------ forward
    def lookup(self, batches: Sequence[FeatureBatch]) -> list[Tensor]:
        """Activations per feature, [*out_shape, D], in feature order.

        Features the native kernel serves are looked up together in one parallel region."""
        out: list[Tensor | None] = [None] * len(batches)
        fast: list[int] = []
        for i, (feature, batch) in enumerate(zip(self.resolved.features, batches)):
            table = self.resolved.tables[feature.table_index]
            weights = self.states[table.name].weights
            if table.config.quantization_config is None and native.usable(
                weights, batch.ids, batch.offsets, batch.coeffs
            ):
                fast.append(i)
        if fast:
            parts = []
            for i in fast:
                table = self.resolved.tables[self.resolved.features[i].table_index]
                b = batches[i]
                parts.append((self.states[table.name].weights, b.ids, b.offsets, b.coeffs))
            for i, acts in zip(fast, native.lookup_many(parts)):
                dim = self.resolved.tables[self.resolved.features[i].table_index].dim
                out[i] = acts.reshape(*batches[i].out_shape, dim)
        for i, (feature, batch) in enumerate(zip(self.resolved.features, batches)):
            if out[i] is not None:
                continue
            table = self.resolved.tables[feature.table_index]
            q = table.config.quantization_config
            weights = self.states[table.name].weights
            acts = pooled_lookup(
                weights,
                batch.ids,
                batch.seg,
                batch.offsets,
                batch.coeffs,
                quantization=None if q is None else (q.num_buckets, float(q.lower), float(q.upper)),
            )
            out[i] = acts.reshape(*batch.out_shape, table.dim)
        return [a for a in out if a is not None]

    # ------------------------------------------------------------------ backward, phase 1
    def check_gradient(self, feature_index: int, batch: FeatureBatch, grad: Any) -> Tensor | None:
        """Validate one activation gradient (None is allowed); returns it as [S, D] float32."""
        feature = self.resolved.features[feature_index]
        table = self.resolved.tables[feature.table_index]
        if grad is None:
            return None
        expected = (*batch.out_shape, table.dim)
        if not isinstance(grad, Tensor):
            raise TypeError(
                f"feature {feature.name!r}: the gradient must be a Tensor or None, got {type(grad).__name__}."
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
        return grad.detach().to(self.device, torch.float32).reshape(batch.num_segments, table.dim).contiguous()

    def table_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> list[TableGradient]:
        """Per-table gradients from per-feature activation gradients [S, D] (None = zero)."""
        out = []
        fast = self._native_table_gradients(batches, grads)
        for table in self.resolved.tables:
            if table.name in fast:
                out.append(fast[table.name])
                continue
            ids_parts, grad_parts = [], []
            for f in table.feature_indices:
                batch, g = batches[f], grads[f]
                if g is None:
                    per_id = torch.zeros((batch.ids.numel(), table.dim), dtype=torch.float32, device=self.device)
                else:
                    per_id = occurrence_gradients(g, batch.seg, batch.coeffs)
                ids_parts.append(batch.ids)
                grad_parts.append(per_id)
            ids = torch.cat(ids_parts)
            per_id = torch.cat(grad_parts)
            accumulated = table.optimizer.use_gradient_accumulation
            if accumulated:
                rows, row_grads = dedup_sum(ids, per_id)
            else:
                # Occurrence order (SPEC 10.2): sample-major, then feature order, then position.
                num_features = len(table.feature_indices)
                keys = torch.cat(
                    [batches[f].sample_index() * num_features + local for local, f in enumerate(table.feature_indices)]
                )
                order = torch.sort(keys, stable=True).indices
                rows, row_grads = ids[order], per_id[order]
            if not bool(torch.isfinite(row_grads).all()):
                raise _non_finite(table)
            out.append(TableGradient(table, rows, row_grads, accumulated=accumulated))
        return out

    def _native_table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        """Phase 1 in C (dedup, float32 sums, finiteness) for every table the native path serves."""
        eligible: list[tuple[ResolvedTable, list[native.FeaturePart]]] = []
        for table in self.resolved.tables:
            if not table.optimizer.use_gradient_accumulation:
                continue
            parts = [(batches[f].ids, batches[f].offsets, batches[f].coeffs, grads[f]) for f in table.feature_indices]
            if native.usable(self.states[table.name].weights, *(t for part in parts for t in part)):
                eligible.append((table, parts))
        if not eligible:
            return {}
        statuses = native.prepare_many([(self._workspace(table), parts) for table, parts in eligible])
        out = {}
        for (table, _), status in zip(eligible, statuses):
            if status == 2:
                raise MemoryError(f"table {table.name!r}: out of memory while preparing the sparse update.")
            if status != 0:
                raise _non_finite(table)
            out[table.name] = TableGradient(table, None, None, accumulated=True, prepared=self._workspace(table))
        return out

    def _workspace(self, table: ResolvedTable) -> native.Workspace:
        ws = self._workspaces.get(table.name)
        if ws is None:
            ws = self._workspaces[table.name] = native.Workspace(table.dim)
        return ws

    def learning_rates(self) -> dict[str, float]:
        """Evaluate each distinct learning-rate callable once (SPEC 1.1.8), float32-rounded, per table."""
        values: dict[int, float] = {}
        for fn in self.resolved.learning_rate_callables():
            users = [t.name for t in self.resolved.tables if t.optimizer.learning_rate is fn]
            values[id(fn)] = _checked_lr(fn, users)
        out = {}
        for t in self.resolved.tables:
            lr = t.optimizer.learning_rate
            out[t.name] = values[id(lr)] if callable(lr) else as_float32(float(lr))
        return out

    # ------------------------------------------------------------------ backward, phase 2
    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> None:
        """Apply validated gradients: the fused sparse update of every table."""
        for tg in table_grads:
            state = self.states[tg.table.name]
            opt = tg.table.optimizer
            lr = lrs[tg.table.name]
            slots = state.slot_tuple()
            if tg.prepared is not None or (not tg.accumulated and native.usable(state.weights, *slots)):
                decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
                params = native.opt_params(opt, lr, decay, clip_gradients=tg.accumulated)
                if tg.prepared is not None:
                    tg.prepared.apply(state.weights, slots, params, dense=not opt.lazy)
                else:
                    assert tg.rows is not None and tg.grads is not None
                    native.apply_sequential(tg.rows, tg.grads.contiguous(), state.weights, slots, params)
                continue
            assert tg.rows is not None and tg.grads is not None
            if not tg.accumulated:
                for round_positions in occurrence_rounds(tg.rows):
                    sparse_update_(
                        state.weights,
                        slots,
                        tg.rows[round_positions],
                        tg.grads[round_positions],
                        opt=opt,
                        lr=lr,
                        clip_gradients=False,
                    )
            elif opt.lazy:
                sparse_update_(state.weights, slots, tg.rows, tg.grads, opt=opt, lr=lr)
            else:
                dense = torch.zeros_like(state.weights)
                dense.index_copy_(0, tg.rows, tg.grads)
                sparse_update_(state.weights, slots, None, dense, opt=opt, lr=lr)

    # ------------------------------------------------------------------ torch integration
    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace every table and slot tensor ``t`` by ``fn(t)`` (used by ``Module.to``)."""
        for state in self.states.values():
            state.weights = fn(state.weights)
            state.slots = {k: fn(v) for k, v in state.slots.items()}

    def state_keys(self) -> dict[str, Tensor]:
        """``{"<table>": weights, "<table>/<slot>": slot}``: the TF checkpoint names (SPEC 7)."""
        out = {}
        for name, state in self.states.items():
            for slot, t in state.tensors().items():
                out[f"{name}/{slot}" if slot else name] = t
        return out


def _non_finite(table: ResolvedTable) -> InputError:
    return InputError(
        f"table {table.name!r}: the gradient reaching the table has NaN or Inf values; no table or slot was "
        "changed. Check the loss for overflow or lower the learning rate of the dense model."
    )


def _checked_lr(fn: Callable[[], float], tables: list[str]) -> float:
    who = "table " + ", ".join(map(repr, tables))
    value = fn()
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{who}: the learning_rate callable must return a float, got {type(value).__name__}.") from None
    if not math.isfinite(lr):
        raise InputError(
            f"{who}: the learning_rate callable returned {lr}; learning rates must be finite. "
            "No table or slot was changed."
        )
    return as_float32(lr)
