"""The ``Backend`` interface: the arithmetic of a step over a ``TableSet``, on one kind of device.

Three implementations: ``TorchBackend`` (the reference: every table, every input, any device),
``NativeBackend`` (the C kernels on CPU tables) and ``GpuBackend`` (the fused Triton kernels on CUDA
tables). A backend may serve part of a call and leave the rest (a quantized feature, a buffer its kernels
do not take) to the reference; ``EmbeddingCollection`` asks the chosen backend first and the reference
for what is left. Every method validates before it writes: an error leaves every table and slot as it was.

Shapes: B bags, F features, T tables, D a table's width, U distinct rows of a table's update, W the width
of the concatenated activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.tables.inputs import FeatureBatch
from embtables.tables.table_gradient import TableGradient

# (weights [V, D], ids [N] int64, offsets [S + 1] int64, coeffs [N] float32 or None): bags over one table
BagPart = tuple[Tensor, Tensor, Tensor, Tensor | None]
# (ids [N], offsets [S + 1], coeffs [N] or None, the bags' gradient [S, D]): one feature's share of phase 1
GradientPart = tuple[Tensor, Tensor, Tensor | None, Tensor | None]
Restore = Callable[[], None]
# (an accumulated table gradient, its learning rate, its effective weight decay): one table's update
Update = tuple[TableGradient, float, float]

# ``pool`` statuses
POOLED = 0  # every bag pooled
OUT_OF_RANGE = 1  # an id outside its table, or broken offsets: nothing to trust in the outputs
NOT_FINITE = 2  # pooled, and some output is not finite (the caller names the feature)

# ``prepare`` statuses (``Prepared.status``)
PREPARED = 0
GRADIENT_NOT_FINITE = 1
OUT_OF_MEMORY = 2
INPUT_CHANGED = 3  # ids or offsets changed after they were validated


def input_changed(what: str) -> InputError:
    """The error of phase 1 for ``INPUT_CHANGED`` (``what``: the table it names)."""
    return InputError(
        f"{what}: ids or offsets changed after they were validated (an input buffer was written between the "
        "lookup and apply_gradients()); no table or slot was changed."
    )


@dataclasses.dataclass
class Lookup:
    """What a backend's lookup served.

    ``acts[i]``: feature i's activations [*out_shape, D], or None for the reference to look up. ``checked``:
    the features whose activations the backend proved finite; ``complete``: every feature served and
    checked. ``wide``: with ``concat``, every feature written into one [B, W] tensor, all checked (``acts``
    is then unused)."""

    acts: list[Tensor | None]
    checked: set[int]
    wide: Tensor | None = None
    complete: bool = False


@dataclasses.dataclass
class Prepared:
    """Phase 1 of one table's gradient parts: ``status`` (``PREPARED``...) and, when prepared, the gradient."""

    status: int
    gradient: TableGradient | None = None


class Backend(Protocol):
    """The kernels of one device kind over a ``TableSet`` (see the module docstring)."""

    name: str

    def lookup(self, batches: Sequence[FeatureBatch], concat: bool) -> Lookup:
        """Activations of the features this backend serves (``Lookup``); raises for ids that changed
        after validation."""
        ...

    def table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        """Phase 1 of the tables it serves, by table name (validated: raises naming the table)."""
        ...

    def write_step(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> bool:
        """Phase 2 of every table in one call when this backend can (every update checked as it is
        written); False when it did not (nothing written)."""
        ...

    def checked_updates(self, updates: Sequence[Update], *, check_in_write: bool) -> list[Any | None]:
        """Check accumulated updates (writes nothing; the bounds of every table read together) and return,
        per update, what ``write`` writes, or None when this backend does not serve it. ``check_in_write``: a
        check may be left to ``write``, which then checks every update of the call before it writes any."""
        ...

    def settle(self) -> None:
        """Raise now every error found so far and not yet raised (the GPU backend's device checks; one sync
        there): called before a write that is not this backend's, so the step stays all or nothing."""
        ...

    def write(self, writes: Sequence[Any]) -> None:
        """Write updates its ``checked_updates`` returned (raises, writing none, when a check left to the
        write finds a non-finite value)."""
        ...

    def sequential(self, tg: TableGradient, lr: float) -> Restore | None:
        """Apply a no-accumulation update occurrence by occurrence (checked: restores and raises when a
        result is not finite); returns what undoes it, or None when this backend does not serve it."""
        ...

    def pool(self, parts: Sequence[BagPart]) -> tuple[list[Tensor], int] | None:
        """Pooled bags [S, D] of every part and a status (``POOLED``...), or None when this backend does
        not serve them all (the sharded engine's partial lookups over shards and looked-up rows)."""
        ...

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared | None:
        """Phase 1 of ``parts`` (ids in [0, ``table.vocabulary_size``)) for the table named ``table.name``:
        distinct rows and float32 sums, the gradient also when a sum is not finite; None when not served.
        ``scratch``: a name for separate scratch memory (a prepared gradient lives until its update)."""
        ...
