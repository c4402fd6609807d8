"""The dynamic tables of one process (spec §11): their key maps, and batches of keys turned into rows.

A dynamic feature's ``FeatureBatch`` holds keys (any int64) until a lookup translates it: a training
lookup asks the table's ``KeyMap`` (admitting, evicting and expiring as it goes, keys in the batch's
order: sample-major, then feature order, then position), an evaluation lookup only reads it. Keys without a
row leave their bags, and the combiner's weights are normalised over the keys that remain, exactly as if
they had not been in the input: every later stage (lookup, gradients, the fused update) sees a fixed
table's batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.kernels.key_map import KeyMap, KeyMapState
from embtables.kernels.segments import offsets_from_segments
from embtables.tables.inputs import FeatureBatch, combiner_coeffs


def with_rows(batch: FeatureBatch, rows: Tensor, table: ResolvedTable) -> FeatureBatch:
    """``batch`` (of keys) with each key replaced by its row ``rows`` [N]; keys without one (-1) dropped,
    the combiner's coefficients computed again over the keys kept (bit for bit what the input without
    them gives)."""
    keep = rows >= 0
    if bool(keep.all()):
        return dataclasses.replace(batch, ids=rows, weights=None)
    seg = batch.seg[keep]
    ids = rows[keep]
    weights = None if batch.weights is None else batch.weights[keep]
    kept = FeatureBatch(ids, offsets_from_segments(seg, batch.num_segments), None, batch.out_shape, seg_=seg,
                        dropped=batch.dropped)  # fmt: skip
    return dataclasses.replace(kept, coeffs=combiner_coeffs(table.config.combiner, kept, weights))


def _cat_keys(batches: Sequence[FeatureBatch]) -> Tensor:
    """The keys of one table's features, concatenated [N], as a contiguous CPU int64 tensor."""
    keys = batches[0].ids if len(batches) == 1 else torch.cat([b.ids for b in batches])
    return keys.to("cpu", torch.int64).contiguous()


def occurrence_order(batches: Sequence[FeatureBatch]) -> Tensor | None:
    """The permutation [N] putting the concatenated ids of one table's features in sample-major order
    (then feature order, then position), or None when concatenation already is (one feature)."""
    if len(batches) == 1:
        return None
    num = len(batches)
    keys = torch.cat([b.sample_index() * num + local for local, b in enumerate(batches)])
    return torch.sort(keys, stable=True).indices


class Vocabularies:
    """The key map of every dynamic table of ``resolved`` (tables without ``dynamic`` have none)."""

    def __init__(self, resolved: ResolvedConfig) -> None:
        self.resolved = resolved
        self.maps: dict[str, KeyMap] = {}
        # per dynamic half-precision table, the key [V] int64 each row holds (what its updates are rounded with,
        # spec §12.1: the same bits for any W), kept current by every training lookup (``note``)
        self.row_keys: dict[str, Tensor] = {}
        for t in resolved.tables:
            if t.config.dynamic is not None:
                self.maps[t.name] = KeyMap(t.vocabulary_size, t.config.dynamic)
                if t.config.half:
                    self.row_keys[t.name] = vocabulary_arrays(self.maps[t.name].export())["keys"].clone()

    def __bool__(self) -> bool:
        return bool(self.maps)

    def translate(
        self, batches: Sequence[FeatureBatch], training: bool, step: int, pin_from: int
    ) -> tuple[list[FeatureBatch], dict[str, Tensor]]:
        """Batches of rows for batches of keys, and per dynamic table the rows given to new keys [R] (to
        reset before the lookup). A training lookup at ``step`` admits, evicts and expires (never a row
        looked up at a step >= ``pin_from``); an evaluation lookup changes nothing."""
        out = list(batches)
        resets: dict[str, Tensor] = {}
        # A step staged whole (``StagedBags``, the small-batch fast path's input): a table whose every key has a
        # row gets its rows written over its features' keys in the arena, the batches staying the staged ones
        # (the fast path then serves the step); the arena's keys are kept first and put back when the same
        # staged step is looked up again, so every lookup reads the keys as staged.
        staged = batches[0].staged if batches else None
        if staged is not None and not staged.serves(batches):
            staged = None  # not the staged step: new batches of rows
        if staged is not None and staged.keys is not None:
            staged.arena[: staged.keys.numel()].copy_(staged.keys)
            staged.keys = None
        tables = [t for t in self.resolved.tables if t.name in self.maps]
        parts = [[batches[f] for f in t.feature_indices] for t in tables]
        keys = [_cat_keys(p) for p in parts]
        if training:  # every table's map in one native call, in parallel over the tables
            orders = [occurrence_order(p) for p in parts]
            ordered = [k if o is None else k[o].contiguous() for k, o in zip(keys, orders)]
            trained = KeyMap.train_many([self.maps[t.name] for t in tables], ordered, step, pin_from)
            found = []
            for t, p, o, k, (rows, reset) in zip(tables, parts, orders, ordered, trained):
                self.note(t.name, k, rows)
                resets[t.name] = reset.to(p[0].ids.device)
                found.append(rows if o is None else torch.empty_like(rows).index_copy_(0, o, rows))
        else:
            found = [self.maps[t.name].find(k) for t, k in zip(tables, keys)]
        for t, p, rows in zip(tables, parts, found):
            rows = rows.to(p[0].ids.device)
            if staged is not None and (rows.numel() == 0 or int(rows.min()) >= 0):
                if staged.keys is None:
                    staged.keys = staged.arena[: staged.ends[0]].clone()
                start = 0
                for b in p:  # the staged batches stay: their ids (arena views) now hold the rows
                    n = b.ids.numel()
                    b.ids.copy_(rows[start : start + n])
                    start += n
                continue
            start = 0
            for f, b in zip(t.feature_indices, p):
                n = b.ids.numel()
                out[f] = with_rows(b, rows[start : start + n], t)
                start += n
        return out, resets

    def note(self, name: str, keys: Tensor, rows: Tensor) -> None:
        """The rows [N] (-1: none) a training lookup gave ``keys`` [N] of table ``name``: what ``row_keys`` holds."""
        held = self.row_keys.get(name)
        if held is not None:
            given = rows >= 0
            held.index_copy_(0, rows[given].to(torch.int64), keys[given].to(torch.int64))

    def arrays(self) -> dict[str, dict[str, Tensor]]:
        """``{table: {field: [V] int64}}`` (``VOCABULARY_FIELDS``) for every dynamic table."""
        return {name: vocabulary_arrays(m.export()) for name, m in self.maps.items()}

    def load(self, values: dict[str, dict[str, Tensor]], step: int) -> None:
        """Replace the named tables' vocabularies with checked ``arrays`` (ages count back from ``step``)."""
        for name, arrays in values.items():
            self.maps[name].load(key_map_state(arrays, step))
            if name in self.row_keys:
                self.row_keys[name].copy_(vocabulary_arrays(self.maps[name].export())["keys"])


# The state of a dynamic table beside its weights and slots (state dict keys "<table>/<field>", checkpoint
# blocks), each [V] int64 by row: the row's key, its lookup count (0 = a free row), its age (training steps
# since its last lookup) and its touch order (0..L-1 over the L live rows: ties of age, oldest first); then
# the keys seen but not admitted yet, [P] each: key, count of lookups, age.
ROW_FIELDS = ("keys", "counts", "age", "order")
_LIMIT = 1 << 62  # the largest count, age and touch order a loaded state may hold (no step arithmetic overflows)
PENDING_FIELDS = ("pending_keys", "pending_counts", "pending_age")
VOCABULARY_FIELDS = ROW_FIELDS + PENDING_FIELDS


def vocabulary_arrays(state: KeyMapState) -> dict[str, Tensor]:
    """A map's rows as the four ``VOCABULARY_FIELDS`` arrays [V] (free rows: all 0)."""
    live = state.counts > 0
    zero = torch.zeros_like(state.keys)
    order = zero.clone()
    live_rows = torch.nonzero(live).flatten()
    by_touch = live_rows[torch.argsort(state.order[live_rows], stable=True)]
    order[by_touch] = torch.arange(by_touch.numel(), dtype=torch.int64)
    return {
        "keys": torch.where(live, state.keys, zero),
        "counts": state.counts.clone(),
        "age": torch.where(live, state.step - state.last_step, zero),
        "order": order,
        "pending_keys": state.pending_keys.clone(),
        "pending_counts": state.pending_counts.clone(),
        "pending_age": state.step - state.pending_last_step,
    }


def vocabulary_problem(table: str, arrays: dict[str, Any], capacity: int) -> str | None:
    """What is wrong with ``arrays`` (``VOCABULARY_FIELDS`` -> [V] int64 tensors) as the vocabulary of
    a table of ``capacity`` rows, or None. Data from files are strangers: everything is checked."""
    pending = arrays.get("pending_keys")
    num_pending = int(pending.numel()) if isinstance(pending, Tensor) and pending.dim() == 1 else -1
    for field in VOCABULARY_FIELDS:
        t = arrays.get(field)
        shape = (capacity,) if field in ROW_FIELDS else (num_pending,)
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or tuple(t.shape) != shape:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            want = f"[{capacity}]" if field in ROW_FIELDS else "[P], P the number of pending keys,"
            return f"table {table!r}: `{field}` must be an int64 tensor of shape {want} got {got}"
    if num_pending > capacity:
        return f"table {table!r}: {num_pending} pending keys, more than its {capacity} rows"
    return vocabulary_values_problem(table, arrays)


def vocabulary_values_problem(table: str, arrays: dict[str, Tensor]) -> str | None:
    """What is wrong with the values of ``arrays`` (``VOCABULARY_FIELDS`` -> int64 tensors: [N] row fields of any
    N, [P] pending fields), or None: the rules ``load_state_dict`` and ``restore`` both apply."""
    counts, age, order, keys = (arrays[f].cpu() for f in ("counts", "age", "order", "keys"))
    if bool((counts < 0).any()) or bool((counts > _LIMIT).any()):
        return f"table {table!r}: a lookup count is negative or above 2**62"
    live = counts > 0
    if bool((age[live] < 0).any()) or bool((age[live] > _LIMIT).any()):
        return f"table {table!r}: a live row's age is negative or above 2**62"
    if bool((order[live] > _LIMIT).any()):
        return f"table {table!r}: a touch order is above 2**62"
    live_keys, live_order = keys[live], order[live]
    if torch.unique(live_keys).numel() != live_keys.numel():
        return f"table {table!r}: a key holds two rows"
    if torch.unique(live_order).numel() != live_order.numel() or bool((live_order < 0).any()):
        return f"table {table!r}: two live rows share a touch order, or one is negative"
    pkeys, pcounts, page = (arrays[f].cpu() for f in PENDING_FIELDS)
    if (
        bool((pcounts < 1).any())
        or bool((page < 0).any())
        or bool((pcounts > _LIMIT).any())
        or bool((page > _LIMIT).any())
    ):
        return f"table {table!r}: a pending key's count is below 1 or its age negative (or one is above 2**62)"
    if torch.unique(torch.cat([live_keys, pkeys])).numel() != live_keys.numel() + pkeys.numel():
        return f"table {table!r}: a key is both live and pending, or pending twice"
    return None


def key_map_state(arrays: dict[str, Tensor], step: int) -> KeyMapState:
    """Checked ``arrays`` (see ``vocabulary_problem``) as a map's state at training step ``step``."""
    counts = arrays["counts"].cpu().contiguous()
    live = counts > 0
    last = torch.where(live, step - arrays["age"].cpu(), torch.zeros_like(counts)).contiguous()
    return KeyMapState(
        arrays["keys"].cpu().contiguous(),
        counts,
        last,
        arrays["order"].cpu().contiguous(),
        step,
        arrays["pending_keys"].cpu().contiguous(),
        arrays["pending_counts"].cpu().contiguous(),
        (step - arrays["pending_age"].cpu()).contiguous(),
    )
