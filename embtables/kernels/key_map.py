"""The native key map of a dynamic table (``csrc/key_map.c``, spec §12): any int64 key -> one of V rows.

``KeyMap`` owns one C map and checks every buffer before C reads it. It is the table's vocabulary state:
a copy or a pickle carries it as its row arrays (``export``), never as native memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch
from torch import Tensor

from embtables.config import DynamicVocabulary
from embtables.kernels import native
from embtables.kernels.native_abi import decode, raise_for

STAT_NAMES = ("admitted", "evicted", "expired", "rejected", "untracked")


@dataclasses.dataclass(frozen=True)
class KeyMapState:
    """A map's rows as tensors [V] int64 each: ``keys``, ``counts`` (lookups of the row's key; 0 = free
    row), ``last_step`` (the training step of its last lookup) and ``order`` (the global touch order that
    breaks ties between rows looked up at one step); ``step`` is the last training step; the keys seen
    but not admitted yet, [P] each: ``pending_keys``, ``pending_counts``, ``pending_last_step``."""

    keys: Tensor
    counts: Tensor
    last_step: Tensor
    order: Tensor
    step: int
    pending_keys: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    pending_counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    pending_last_step: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))


def _library() -> Any:
    lib = native.library(required=True)
    if lib is None:
        raise RuntimeError(
            "embtables: dynamic vocabularies (TableConfig(dynamic=...)) need the native key map, which could not "
            "be compiled (no C compiler: set CC). Install a C compiler, or use a fixed table with hashed ids."
        )
    return lib


def _keys(keys: Tensor) -> Tensor:
    return native.require(keys, "keys", torch.int64, (-1,))


class KeyMap:
    """One dynamic table's map from keys to its ``capacity`` rows."""

    def __init__(self, capacity: int, policy: DynamicVocabulary) -> None:
        lib = _library()
        ttl = -1 if policy.ttl_steps is None else policy.ttl_steps
        handle = lib.et_km_new(capacity, policy.admit_after, policy.eviction_code, ttl)
        if not handle:
            raise MemoryError(
                f"embtables: could not allocate the key map of a dynamic table with {capacity} rows (about "
                f"{capacity * 200 / 2**20:.0f} MiB: up to 200 bytes per row). Reduce vocabulary_size (the capacity)."
            )
        self._handle: int | None = handle
        self.capacity = capacity
        self.policy = policy

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        lib = native.library(required=True)
        if handle and lib is not None:
            lib.et_km_free(handle)

    @property
    def handle(self) -> int:
        assert self._handle is not None, "the key map was freed"
        return self._handle

    def train(self, keys: Tensor, step: int, pin_from: int) -> tuple[Tensor, Tensor]:
        """One training lookup at ``step`` of ``keys`` [N] in the batch's order (sample-major): each key's
        row [N] (-1 when not admitted), and the rows given to new keys at this step [R] (to reset)."""
        keys = _keys(keys)
        n = keys.numel()
        rows = torch.empty(n, dtype=torch.int64)
        reset = torch.empty(n, dtype=torch.int64)
        got = int(_library().et_km_train(self.handle, keys.data_ptr(), n, step, pin_from, rows.data_ptr(),
                                         reset.data_ptr()))  # fmt: skip
        return rows, reset[: self._reset_count(got, step)]

    def _reset_count(self, status: int, step: int) -> int:
        """The number of reset rows ``et_km_train`` returned, or its error raised."""
        meaning = decode("et_km_train", status)
        if meaning == "step_back":
            raise RuntimeError(
                f"embtables: a dynamic table's training lookup at step {step} comes after step {self.step} "
                "(steps never go back); this is an embtables bug."
            )
        raise_for("et_km_train", status, "a dynamic table admitting keys")
        return status

    @staticmethod
    def train_many(maps: list[KeyMap], keys: list[Tensor], step: int, pin_from: int) -> list[tuple[Tensor, Tensor]]:
        """``train`` of several maps (each its own keys [N_t]) in one native call, in parallel over the maps."""
        if len(maps) == 1:
            return [maps[0].train(keys[0], step, pin_from)]
        checked = [_keys(k) for k in keys]
        sizes = [k.numel() for k in checked]
        t = len(maps)
        # every map's rows [N_t], then its reset rows [N_t], then the statuses [T]: one buffer, its views in one call
        parts = torch.empty(2 * sum(sizes) + t, dtype=torch.int64).split_with_sizes([*sizes, *sizes, t])
        rows, resets, out = parts[:t], parts[t : 2 * t], parts[2 * t]
        arr, i64s = ctypes.c_void_p * t, ctypes.c_int64 * t
        _library().et_km_train_many(
            t, arr(*[m.handle for m in maps]), arr(*[k.data_ptr() for k in checked]), i64s(*sizes), step, pin_from,
            arr(*[r.data_ptr() for r in rows]), arr(*[r.data_ptr() for r in resets]), out.data_ptr(),
            max(1, torch.get_num_threads()),
        )  # fmt: skip
        # a status >= 0 is the count of reset rows; a negative one is raised by _reset_count
        return [
            (r, reset[: got if got >= 0 else m._reset_count(got, step)])
            for m, got, r, reset in zip(maps, out.tolist(), rows, resets)
        ]

    def find(self, keys: Tensor) -> Tensor:
        """The rows [N] of ``keys`` [N] (-1 for keys without one); changes nothing (evaluation)."""
        keys = _keys(keys)
        rows = torch.empty(keys.numel(), dtype=torch.int64)
        _library().et_km_find(self.handle, keys.data_ptr(), keys.numel(), rows.data_ptr())
        return rows

    def stats(self) -> dict[str, int]:
        """Counters since creation or the last ``load``: admitted, evicted, expired, rejected, untracked
        (keys not counted because the pending set was full), and the live rows and pending keys now."""
        out = torch.empty(10, dtype=torch.int64)
        _library().et_km_stats(self.handle, out.data_ptr())
        values = out.tolist()
        stats = dict(zip(STAT_NAMES, values[4:9]))
        stats.update(live=values[1], pending=values[2], capacity=values[9])
        return stats

    @property
    def step(self) -> int:
        out = torch.empty(10, dtype=torch.int64)
        _library().et_km_stats(self.handle, out.data_ptr())
        return int(out[0])

    def export(self) -> KeyMapState:
        """Copies of the map's state: rows and pending keys (not the counters)."""
        lib, v = _library(), self.capacity
        keys, counts, last, order = (torch.empty(v, dtype=torch.int64) for _ in range(4))
        lib.et_km_export(self.handle, keys.data_ptr(), counts.data_ptr(), last.data_ptr(), order.data_ptr())
        p = self.stats()["pending"]
        pkeys, pcounts, plast = (torch.empty(p, dtype=torch.int64) for _ in range(3))
        lib.et_km_export_pending(self.handle, pkeys.data_ptr(), pcounts.data_ptr(), plast.data_ptr())
        return KeyMapState(keys, counts, last, order, self.step, pkeys, pcounts, plast)

    def load(self, state: KeyMapState) -> None:
        """Replace the map's state with ``state`` (validated here: the map stays empty and this raises when a
        rule is broken); the counters start afresh."""
        shape = (self.capacity,)
        fields = {"keys": state.keys, "counts": state.counts, "last_step": state.last_step, "order": state.order}
        arrays = [native.require(t, name, torch.int64, shape) for name, t in fields.items()]
        p = int(state.pending_keys.numel()) if isinstance(state.pending_keys, Tensor) else -1
        pending = [
            native.require(t, name, torch.int64, (p,))
            for name, t in (("pending_keys", state.pending_keys), ("pending_counts", state.pending_counts),
                            ("pending_last_step", state.pending_last_step))
        ]  # fmt: skip
        ptrs = [t.data_ptr() for t in arrays + pending]
        status = _library().et_km_import(self.handle, *ptrs, p, int(state.step))
        if decode("et_km_import", status) != "ok":
            raise ValueError(
                "the dynamic table's vocabulary state is inconsistent (a negative count, a key twice, a last step "
                f"after the state's step {state.step}, two live rows with one order, or more pending keys than "
                "rows); the table's vocabulary was left empty. Restore from an intact checkpoint."
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "policy": self.policy, "state": self.export()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["capacity"], d["policy"])  # type: ignore[misc]
        self.load(d["state"])
