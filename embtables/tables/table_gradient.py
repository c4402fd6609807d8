"""``TableGradient``: one table's validated gradient for one step, between phase 1 and phase 2 of an
``apply`` (``tables/collection.py``, computed by a backend in ``tables/backends/``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from embtables.config import ResolvedTable
from embtables.kernels import gpu_step, native


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
    gradient_max_abs: float | None = None  # max |grads| (or a bound on it), when phase 1 measured it (GPU)
    deferred: gpu_step.TableShare | None = (
        None  # GPU: this table's share of its group's phase 1 (``rows``, ``grads`` None)
    )

    def materialized(self) -> TableGradient:
        """The same gradient with rows [U] and sums [U, D] as tensors (copied out of C memory, or summed
        on the GPU)."""
        if self.deferred is not None and self.grads is None:
            rows, sums = self.deferred.sums.table_rows(self.deferred.index)
            return TableGradient(self.table, rows, sums, accumulated=True)
        if self.prepared is None:
            return self
        rows, grads = self.prepared.rows_and_grads()
        return TableGradient(self.table, rows, grads, accumulated=True)

    def owned(self) -> TableGradient:
        """This gradient, reading only memory the engine owns: a GPU share copies the activation gradients its
        group's update would read (the caller may reuse them before a held-back update lands)."""
        if self.deferred is not None and self.grads is None:
            gpu_step.own_gradients(self.deferred.sums)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy or a pickle (of a module with a pipelined update pending) carries the gradient itself,
        # never the native scratch memory it was prepared in, so it applies anywhere, native or not.
        m = self.materialized()
        return (TableGradient, (m.table, m.rows, m.grads, m.accumulated))
