"""Per-table state: the (V, D) float32 weights and the optimizer's slots, created from a resolved table."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import ConfigError
from embtables.tables.initializers import Constant, default_initializer


@dataclasses.dataclass(eq=False)
class TableState:
    """``weights`` [V, D] and ``slots`` {TF slot name: [V, D]} of one table, in slot-name order."""

    weights: Tensor
    slots: dict[str, Tensor]

    def slot_tuple(self) -> tuple[Tensor, ...]:
        return tuple(self.slots.values())

    def tensors(self) -> dict[str, Tensor]:
        """``{"": weights, "<slot>": slot}``: everything a checkpoint stores for this table."""
        return {"": self.weights, **self.slots}


@dataclasses.dataclass(frozen=True, eq=False)
class LocalShard:
    """The rows of one table that this process owns, with their global row ids.

    ``rows`` [N] int64 are global row ids in ascending order (``arange(V)`` in one process; a div
    block, a mod stride or a whole table when sharded). ``tensors`` maps ``""`` to the weights
    [N, D] and each TF slot name to its [N, D] slot, row i holding global row ``rows[i]``. The
    tensors are the live storage (writing into them changes the table), so checkpoint restore can
    fill them in place without ever materialising rows this process does not own.
    """

    table: str
    vocabulary_size: int
    rows: Tensor
    tensors: dict[str, Tensor]


def _checked(table: ResolvedTable, what: str, t: object) -> Tensor:
    shape = (table.vocabulary_size, table.dim)
    if not isinstance(t, Tensor) or tuple(t.shape) != shape or not torch.is_floating_point(t):
        got = f"{type(t).__name__} {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise ConfigError(f"table {table.name!r}: {what} must return a float tensor of shape {shape}, got {got}.")
    return t


def create_table_state(table: ResolvedTable, device: torch.device) -> TableState:
    """Initialise weights with the table's initializer (TF's truncated normal by default) and the
    slots with the optimizer's constants, or with ``slot_variable_creation_fn`` when given."""
    shape = (table.vocabulary_size, table.dim)
    init = table.config.initializer or default_initializer(table.dim)
    # clone(): an initializer may return an existing tensor (pretrained weights); never train it in place.
    weights = _checked(table, "the initializer", init(shape, torch.float32)).to(device, torch.float32).clone()
    opt = table.optimizer
    names = list(opt.slot_names)
    inits = [Constant(v) for v in opt.slot_initial_values()]
    creation_fn = getattr(opt, "slot_variable_creation_fn", None)
    if creation_fn is None:
        slots = {n: i(shape, torch.float32).to(device) for n, i in zip(names, inits)}
    else:
        made = creation_fn(weights, names, inits)
        if not isinstance(made, dict) or sorted(made) != sorted(names):
            raise ConfigError(
                f"table {table.name!r}: slot_variable_creation_fn must return a dict with exactly the keys "
                f"{names}, got {sorted(made) if isinstance(made, dict) else type(made).__name__}."
            )
        slots = {n: _checked(table, f"slot_variable_creation_fn[{n!r}]", made[n]) for n in names}
        ptrs = [t.data_ptr() for t in slots.values()] + [weights.data_ptr()]
        if len(set(ptrs)) != len(ptrs):
            raise ConfigError(
                f"table {table.name!r}: slot_variable_creation_fn returned tensors that share memory with each "
                "other or with the table; each slot needs its own storage."
            )
        slots = {n: t.to(device, torch.float32).contiguous() for n, t in slots.items()}
    return TableState(weights=weights, slots=slots)
