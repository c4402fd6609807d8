"""Per-table state: the (V, D) weights and the optimizer's slots, created from a resolved table: float32, or
the table's half type (``TableConfig.dtype`` / ``slot_dtype``, spec §12)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import ConfigError
from embtables.kernels import huge_pages
from embtables.kernels.registry import record_of
from embtables.kernels.subnormals import SMALLEST_NORMAL
from embtables.tables.initializers import Constant, TruncatedNormal, default_initializer
from embtables.tables.offload_cache import OffloadedRows
from embtables.tables.offload_initial import OffloadShard, table_seed


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
    fill them in place without ever materialising rows this process does not own. ``offloaded``: an
    offloaded table's files and cache (``TableConfig.offload``), whose rows a checkpoint reads from the files
    (``OffloadedRows.read_records``) instead of the tensors when they were not made whole first.
    """

    table: str
    vocabulary_size: int
    rows: Tensor
    tensors: dict[str, Tensor]
    offloaded: OffloadedRows | None = None


def check_loaded_value(table: ResolvedTable, slot: str, value: Tensor) -> str | None:
    """Why ``value`` cannot be loaded as table ``table``'s weights (``slot == ""``) or slot ``slot``, or None.

    Every value must be finite as the float32 it becomes (a float64 1e39 would load as inf), and each
    slot must be in its optimizer's domain: accumulators that divide (Adagrad, FTRL) > 0 (>= 0 with
    FTRL's allow_zero_accumulator), AdagradMomentum's accumulators and Adam's velocities >= 0."""
    if value.numel() == 0:
        return None
    # One pass over the values as the float32 they become: beyond 3.4e38 turns into inf, 1e-46 into 0; a
    # half-precision table's as the half values they become (float16: beyond 65504 is inf).
    stored = storage_dtypes(table)[1 if slot else 0]
    as_stored = value.detach().to(torch.float32)
    if stored is not torch.float32:
        as_stored = as_stored.to(stored)
    smallest, largest = (float(v) for v in torch.aminmax(as_stored))
    if not (math.isfinite(smallest) and math.isfinite(largest)):
        if stored is torch.float32:
            return "must be finite float32 values (NaN, Inf or beyond 3.4e38 found; the checkpoint is corrupt)"
        name = str(stored).removeprefix("torch.")
        return f"must be finite {name} values (NaN, Inf or beyond {name}'s range found; the checkpoint is corrupt)"
    opt = table.optimizer
    domain = dict(zip(opt.slot_names, record_of(opt).slot_domains(opt))).get(slot, "any")
    if domain == "positive" and not smallest >= SMALLEST_NORMAL:  # exactly 2^-126 (float32's value is normal)
        return (
            f"holds {smallest!r} (as float32), but {type(opt).__name__}'s {slot} must be >= 1.1754944e-38, the "
            "smallest normal float32 (the update divides by it, and the kernels read a subnormal as zero)"
        )
    if domain == "nonnegative" and not smallest >= 0:
        return f"holds {smallest!r}, but {type(opt).__name__}'s {slot} must be >= 0"
    return None


def _checked(table: ResolvedTable, what: str, t: object, shape: tuple[int, int] | None = None) -> Tensor:
    shape = shape or (table.vocabulary_size, table.dim)
    if not isinstance(t, Tensor) or tuple(t.shape) != shape or not torch.is_floating_point(t):
        got = f"{type(t).__name__} {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise ConfigError(f"table {table.name!r}: {what} must return a float tensor of shape {shape}, got {got}.")
    return t


_MAX_TABLE_BYTES = 1 << 46  # 64 TiB: more is a typo, not a table


def storage_dtypes(table: ResolvedTable) -> tuple[torch.dtype, torch.dtype]:
    """The torch dtypes the table's rows and slots are stored in (``TableConfig.storage``, ``slot_storage``)."""
    config = table.config
    return getattr(torch, config.storage), getattr(torch, config.slot_storage)


def _owned(t: Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """Plain leaf storage of its own: detached from any graph (a pretrained nn.Parameter), of the table's
    storage ``dtype`` (float32 values are rounded to nearest into a half type: initial values, not an
    update), contiguous (the native kernels need it), never sharing memory with the caller's tensor; a
    large CPU table in huge pages (``kernels/huge_pages.py``)."""
    out = t.detach().to(device, dtype if t.dtype == dtype else torch.float32)  # a half table's own draw as it is
    if out.dtype != dtype or out.data_ptr() == t.data_ptr() or not out.is_contiguous():
        out = huge_pages.empty_float32(tuple(out.shape), out.device, dtype).copy_(out)  # copy_ rounds to nearest
    return out


def create_table_state(
    table: ResolvedTable, device: torch.device, offload: OffloadShard | None = None
) -> TableState | OffloadedRows:
    """Initialise weights with the table's initializer (TF's truncated normal by default) and the
    slots with the optimizer's constants, or with ``slot_variable_creation_fn`` when given. An offloaded
    table (``TableConfig.offload``) gets its files instead, its rows initialized when first read
    (``offload``: which shard; None: the whole table)."""
    if table.config.offload is not None:
        return _offloaded(table, device, offload)
    shape = (table.vocabulary_size, table.dim)
    row_dtype, slot_dtype = storage_dtypes(table)
    per_value = row_dtype.itemsize + slot_dtype.itemsize * len(table.optimizer.slot_names)
    nbytes = table.vocabulary_size * table.dim * per_value
    if nbytes > _MAX_TABLE_BYTES:
        raise ConfigError(
            f"table {table.name!r}: vocabulary_size={table.vocabulary_size} x dim={table.dim} needs "
            f"{nbytes / 2**40:.1f} TiB for the weights and {len(table.optimizer.slot_names)} slot(s) "
            f"({table.config.storage} rows, {table.config.slot_storage} slots). "
            "Check vocabulary_size and dim (hash ids into a smaller vocabulary)."
        )
    try:
        return _create(table, shape, device)
    except (RuntimeError, MemoryError) as exc:
        if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        raise MemoryError(
            f"table {table.name!r}: could not allocate {nbytes / 2**30:.2f} GiB for vocabulary_size="
            f"{table.vocabulary_size} x dim={table.dim} (weights and {len(table.optimizer.slot_names)} slot(s), "
            f"{table.config.storage} rows, {table.config.slot_storage} slots). Reduce vocabulary_size or dim, store "
            "the table in half precision (dtype=torch.bfloat16), or shard it over more processes."
        ) from exc


def _offloaded(table: ResolvedTable, device: torch.device, where: OffloadShard | None) -> OffloadedRows:
    if device.type != "cpu":
        raise ConfigError(
            f"table {table.name!r}: an offloaded table (TableConfig.offload) lives on the CPU, its rows in files; "
            f"device={device} is not supported. Drop `offload`, or keep the module on the CPU."
        )
    opt = table.optimizer
    if getattr(opt, "slot_variable_creation_fn", None) is not None:
        raise ConfigError(
            f"table {table.name!r}: an offloaded table initializes its slots when their rows are first read, from "
            "the optimizer's initial values; slot_variable_creation_fn (which builds whole slots) is not supported."
        )
    if not opt.lazy:
        raise ConfigError(
            f"table {table.name!r}: {type(opt).__name__} with lazy_adam=False updates every row at every step, "
            "which would read and write the whole offloaded table per step. Use lazy_adam=True (TF's default) for "
            "an offloaded table."
        )
    row_dtype, slot_dtype = storage_dtypes(table)
    parts = {"": row_dtype, **dict.fromkeys(opt.slot_names, slot_dtype)}
    slot_values = {n: float(v) for n, v in zip(opt.slot_names, opt.slot_initial_values())}
    where = where or OffloadShard(table, "w1r0", table_seed(table))
    return OffloadedRows(table, where, parts, slot_values)


def _create(table: ResolvedTable, shape: tuple[int, int], device: torch.device) -> TableState:
    weights, slots = _initial_values(table, shape, device)
    return TableState(weights=weights, slots=slots)


def initial_rows(table: ResolvedTable, n: int, device: torch.device) -> tuple[Tensor, dict[str, Tensor]]:
    """Fresh initial values for ``n`` rows [n, D] of ``table``: its initializer and slot initial values
    (or ``slot_variable_creation_fn``) called for an [n, D] block, as a dynamic table's reused rows get
    them (spec §11). A seeded initializer repeats its draw."""
    return _initial_values(table, (n, table.dim), device)


def _initial_values(
    table: ResolvedTable, shape: tuple[int, int], device: torch.device
) -> tuple[Tensor, dict[str, Tensor]]:
    init = table.config.initializer or default_initializer(table.dim)
    row_dtype, slot_dtype = storage_dtypes(table)
    # TruncatedNormal (the default) draws a half table's float32 values a block at a time, rounded into its
    # storage as they come (the same bits as the whole float32 draw rounded: tested); any other initializer
    # returns float32 values, rounded here. An initializer may return an existing tensor (pretrained weights):
    # never train it in place.
    drawn = init(shape, row_dtype if isinstance(init, TruncatedNormal) else torch.float32)
    weights = _owned(_checked(table, "the initializer", drawn, shape), device, row_dtype)
    del drawn  # freed before the slots are made
    opt = table.optimizer
    names = list(opt.slot_names)
    inits = [Constant(v) for v in opt.slot_initial_values()]
    creation_fn = getattr(opt, "slot_variable_creation_fn", None)
    if creation_fn is None:
        slots = {
            n: huge_pages.empty_float32(shape, device, slot_dtype).fill_(float(i.value)) for n, i in zip(names, inits)
        }
    else:
        made = creation_fn(weights, names, inits)
        if not isinstance(made, dict) or sorted(made) != sorted(names):
            raise ConfigError(
                f"table {table.name!r}: slot_variable_creation_fn must return a dict with exactly the keys "
                f"{names}, got {sorted(made) if isinstance(made, dict) else type(made).__name__}."
            )
        slots = {n: _checked(table, f"slot_variable_creation_fn[{n!r}]", made[n], shape) for n in names}
        ptrs = [t.data_ptr() for t in slots.values()] + [weights.data_ptr()]
        if len(set(ptrs)) != len(ptrs):
            raise ConfigError(
                f"table {table.name!r}: slot_variable_creation_fn returned tensors that share memory with each "
                "other or with the table; each slot needs its own storage."
            )
        slots = {n: _owned(t, device, slot_dtype) for n, t in slots.items()}
    return weights, slots
