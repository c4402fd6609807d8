"""The native backend's small-batch fast path: a step whose every feature was staged by one native call,
over tables that the native kernels serve whole (CPU, not quantized, gradients accumulated, lazy), takes one
native call per phase through ``kernels/native_step.py``, with the tables' argument arrays built once. Steps with
half-precision tables take it too (``kernels/native_half.HalfStep``: one lookup call, phase 1 as float32's, one
update call), float32 tables among them included when each of their updates is small.

Everything else, and every step whose call reports anything but success, goes through the general path of
``NativeBackend``, which repeats the work and raises its errors (naming the feature or table): the fast
calls write nothing a failed step keeps (the lookup only its own outputs, phase 1 only the scratch
workspaces, phase 2 nothing unless every table's update is finite).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.kernels import native, native_step
from embtables.kernels.affine_rows import GlobalRows
from embtables.kernels.native_half import HalfStep
from embtables.kernels.native_step import StagedBags, TableArrays
from embtables.kernels.stochastic_rounding import HALF_TYPES
from embtables.tables.backends.table_set import TableSet
from embtables.tables.inputs import FeatureBatch
from embtables.tables.table_gradient import TableGradient


class NativeFastPath:
    """The fast path over ``tables``: the tables' phase-1 workspaces and optimizer blocks are the native
    backend's (``workspace(table)``, ``params(table, lr)``)."""

    def __init__(
        self,
        tables: TableSet,
        workspace: Callable[[ResolvedTable], native.Workspace],
        params: Callable[[ResolvedTable, float], Any],
    ) -> None:
        self.set = tables
        self.resolved = tables.resolved
        self._workspace = workspace
        self._params = params
        configs = self.resolved.tables
        # the config decides whether the path can ever serve these tables; the tensors are checked per call
        self.possible = bool(configs) and all(
            t.config.quantization_config is None and t.optimizer.use_gradient_accumulation and t.optimizer.lazy
            for t in configs
        )
        self._arrays: TableArrays | None = None
        self._prepared: tuple[TableArrays, dict[str, TableGradient]] | None = None
        self._small = False  # every update of the last phase 1 here is checked as it is written (see apply)
        self._rates: tuple[tuple[float, ...], list[Any]] = ((), [])  # learning rates -> optimizer blocks
        self._dense = [0] * len(configs)  # lazy optimizers only: a non-lazy one updates every row
        self._alike_for: TableArrays | None = None
        self._half: tuple[TableArrays, HalfStep] | None = None  # see _half_step
        self._alike_dims = False

    def _tensors(self) -> list[Tensor]:
        """Every table's weights and slots, table by table."""
        states = self.set.states
        tensors: list[Tensor] = []
        for table in self.resolved.tables:
            state = states[table.name]
            tensors.append(state.weights)
            tensors += state.slots.values()
        return tensors

    def arrays(self, weights_only: bool = False) -> TableArrays | None:
        """The tables' argument arrays, built again when any weights or slot tensor changed (``weights_only``:
        when the weights changed, for a call that reads only them); None when the native kernels do not
        serve every table (the general path then does)."""
        if not self.possible or native.library() is None:
            return None
        arrays = self._arrays
        states = self.set.states
        weights = [states[t.name].weights for t in self.resolved.tables] if weights_only else []
        if weights_only and arrays is not None and arrays.current_weights(weights):
            return arrays
        tensors = self._tensors()
        if arrays is not None and arrays.current(tensors):
            return arrays
        self.set.check_storage()  # a tensor changed: one replaced by another dtype or shape is refused, named
        if not native.usable(*(t for t in tensors if t.dtype not in HALF_TYPES)) or not all(
            t.is_cpu and t.is_contiguous() for t in tensors if t.dtype in HALF_TYPES
        ):
            return None
        tables = self.resolved.tables
        pairs = [(states[t.name].weights, states[t.name].slot_tuple()) for t in tables]
        workspaces = [self._workspace(t) for t in tables]
        try:
            self._arrays = TableArrays(pairs, workspaces, [f.table_index for f in self.resolved.features])
        except native.NativeBufferError:  # e.g. a slot no longer shaped like its table: the general path's checks
            self._arrays = None
        return self._arrays

    @staticmethod
    def bags_of(batches: Sequence[FeatureBatch]) -> StagedBags | None:
        """The staged bags that hold exactly ``batches``, or None."""
        bags = batches[0].staged if batches else None
        return bags if bags is not None and bags.serves(batches) else None

    def lookup(self, batches: Sequence[FeatureBatch], into: Tensor | None, starts: list[int]) -> list[Tensor] | None:
        """Every feature's activations in one call (into ``into`` [B, W] at ``starts`` when given, as the
        general lookup's concatenated output), or None when this path does not serve the step or the call
        found anything wrong."""
        bags = self.bags_of(batches)
        arrays = None if bags is None else self.arrays(weights_only=True)
        if bags is None or arrays is None:
            return None
        if arrays.half:  # some table half: one call (into ``into``'s columns when given)
            outs = self._half_step(arrays).lookup(bags, into, starts)
            if outs is None or into is not None:
                return outs
            return [o if len(b.out_shape) == 1 else o.reshape(*b.out_shape, o.shape[1]) for o, b in zip(outs, batches)]
        if into is not None:
            if native_step.lookup(arrays, bags, [into], starts) != 0:
                return None
            return [into]
        n_bags = bags.n_bags
        if bags.alike_bags >= 0 and self._alike(arrays):
            # every output [S, D] alike: one block [F, S, D], each feature's activations a contiguous block[f]
            block = torch.empty((len(batches), bags.alike_bags, int(arrays.fdims[0])), dtype=torch.float32)
            if native_step.lookup(arrays, bags, [block], None) != 0:
                return None
            outs = list(block.unbind(0))
        else:
            outs = [torch.empty((n, int(d)), dtype=torch.float32) for n, d in zip(n_bags, arrays.fdims)]
            if native_step.lookup(arrays, bags, outs, None) != 0:
                return None
        return [o if len(b.out_shape) == 1 else o.reshape(*b.out_shape, o.shape[1]) for o, b in zip(outs, batches)]

    def _alike(self, arrays: TableArrays) -> bool:
        """Whether every feature of ``arrays`` has the same width D (decided once per arrays)."""
        if self._alike_for is not arrays:
            dims = list(arrays.fdims)
            self._alike_for, self._alike_dims = arrays, bool(dims) and dims.count(dims[0]) == len(dims)
        return self._alike_dims

    def table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient] | None:
        """Phase 1 of every table in one call (by table name), or None (not served, or a table's status is
        not 0). Phase 1 reads no table: the arrays' sizes serve it without checking the tensors (C checks the
        ids against them, and phase 2 checks that the prepared rows fit the tables it writes)."""
        bags = self.bags_of(batches)
        arrays = None if bags is None else self._arrays if self._arrays is not None else self.arrays()
        if bags is None or arrays is None:
            return None
        self._small = False
        if any(native_step.prepare(arrays, bags, grads)):
            return None
        prepared = self._prepared
        if prepared is None or prepared[0] is not arrays:  # the same (immutable) gradients every step
            tables = self.resolved.tables
            prepared = self._prepared = (arrays, {t.name: TableGradient(t, None, None, True, ws) for t, ws in
                                                  zip(tables, arrays.workspaces)})  # fmt: skip
        # every table's update (unique rows x D values) small enough to be checked exactly as it is written
        self._small = native_step.updates_fit_checking(arrays)
        return prepared[1]  # read, never changed, by the caller

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> bool:
        """Phase 2 of every table in one call, each update checked exactly as it is written, for the
        gradients of this path's last phase 1 when every update was small; False (nothing written) when
        this path does not serve the step or an update is not finite (the general path then finds the
        table and row, and raises)."""
        prepared = self._prepared
        if prepared is None or len(table_grads) != len(prepared[1]):
            return False
        for tg, ours in zip(table_grads, prepared[1].values()):
            if tg is not ours:
                return False
        arrays = prepared[0]
        if arrays is not self._arrays or not arrays.current(self._tensors()):
            return False
        tables = self.resolved.tables
        rates = tuple(lrs[t.name] for t in tables)
        if rates != self._rates[0]:  # the optimizer blocks at these learning rates (the backend's cache)
            self._rates = (rates, [self._params(t, lr) for t, lr in zip(tables, rates)])
        if arrays.half:  # every half update rounded and checked as it is written, put back when one is not finite
            half = self._half_step(arrays)
            if half.mixed and not native_step.updates_fit_checking(arrays, half.float_dims):
                return False  # a large float32 update: the general phase 2 measures its bounds on every thread
            global_rows: list[GlobalRows | None] | None = None  # None: every table's rows are global
            if self.set.global_rows:
                global_rows = [self.set.global_rows.get(t.name) for t in tables]
                if not all(
                    not isinstance(g, Tensor) or (g.dtype == torch.int64 and g.is_cpu and g.is_contiguous())
                    for g in global_rows
                ):
                    return False  # the general phase 2 converts them
            return max(half.apply(native_step.param_array(arrays, self._rates[1]), global_rows, self.set.step)) < 0
        if not self._small:
            return False
        return max(native_step.apply_checked(arrays, self._rates[1], self._dense)) < 0  # -1 per table: all written

    def _half_step(self, arrays: TableArrays) -> HalfStep:
        """The one-call lookup and phase 2 of ``arrays``, some of whose tables are half (built once per arrays)."""
        held = self._half
        if held is None or held[0] is not arrays:
            tables = self.resolved.tables
            rounding = [(t.config.rounding_seed, t.index, t.config.rounding == "stochastic") for t in tables]
            held = self._half = (arrays, HalfStep(arrays, rounding))
        return held[1]
