"""Pure-Python reference of a dynamic table's key map (docs/spec.md §11), written from the spec with
plain dicts and linear scans: no hashing, heaps or queues, so it shares no structure with the C map.
Imports neither torch nor embtables."""

from __future__ import annotations

from typing import Any


class PyKeyMap:
    def __init__(self, capacity: int, admit_after: int, eviction: str | None, ttl: int | None) -> None:
        self.capacity, self.admit_after, self.eviction, self.ttl = capacity, admit_after, eviction, ttl
        self.rows: dict[int, dict[str, int]] = {}  # row -> {key, count, last, order}
        self.row_of: dict[int, int] = {}  # live key -> row
        self.pending: dict[int, list[int]] = {}  # key -> [count, last]
        self.seq = 0
        self.step = 0
        self.stats = dict.fromkeys(("admitted", "evicted", "expired", "rejected", "untracked"), 0)

    def _free(self, row: int) -> None:
        del self.row_of[self.rows.pop(row)["key"]]

    def _touch(self, row: int, s: int) -> None:
        r = self.rows[row]
        r["count"] += 1
        r["last"] = s
        r["order"] = self.seq
        self.seq += 1

    def _take_row(self, pin_from: int) -> int:
        free = [r for r in range(self.capacity) if r not in self.rows]
        if free:
            return min(free)
        movable = [r for r, v in self.rows.items() if v["last"] < pin_from]
        if self.eviction is None or not movable:
            return -1
        if self.eviction == "lru":
            oldest = min(self.rows, key=lambda r: self.rows[r]["order"])
            if oldest not in movable:
                return -1
            victim = oldest
        else:
            victim = min(movable, key=lambda r: (self.rows[r]["count"], self.rows[r]["order"]))
        self._free(victim)
        self.stats["evicted"] += 1
        return victim

    def train(self, keys: list[int], s: int, pin_from: int) -> tuple[list[int], list[int]]:
        self.step = s
        if self.ttl is not None:
            for row in sorted(self.rows, key=lambda r: self.rows[r]["order"]):
                if s - self.rows[row]["last"] > self.ttl and self.rows[row]["last"] < pin_from:
                    self._free(row)
                    self.stats["expired"] += 1
        out, reset = [], []
        for k in keys:
            if k in self.row_of:
                row = self.row_of[k]
                if self.rows[row]["last"] != s:
                    self._touch(row, s)
                out.append(row)
                continue
            if k in self.pending:
                count, last = self.pending[k]
                if last == s:
                    out.append(-1)
                    continue
                count = 1 if self.ttl is not None and s - last > self.ttl else count + 1
            else:
                count = 1
            if count >= self.admit_after:
                row = self._take_row(pin_from)
                if row >= 0:
                    self.pending.pop(k, None)
                    self.rows[row] = {"key": k, "count": count - 1, "last": -1, "order": -1}
                    self.row_of[k] = row
                    self._touch(row, s)
                    self.stats["admitted"] += 1
                    reset.append(row)
                    out.append(row)
                    continue
                self.stats["rejected"] += 1
            if k not in self.pending and len(self.pending) == self.capacity:
                self.pending = {q: v for q, v in self.pending.items() if v[1] >= s}
                if len(self.pending) == self.capacity:
                    self.stats["untracked"] += 1
                    out.append(-1)
                    continue
            self.pending[k] = [count, s]
            out.append(-1)
        return out, reset

    def find(self, keys: list[int]) -> list[int]:
        return [self.row_of.get(k, -1) for k in keys]

    def export(self) -> dict[str, Any]:
        cols: dict[str, list[int]] = {"keys": [], "counts": [], "last_step": [], "order": []}
        for row in range(self.capacity):
            v = self.rows.get(row)
            cols["keys"].append(v["key"] if v else 0)
            cols["counts"].append(v["count"] if v else 0)
            cols["last_step"].append(v["last"] if v else 0)
            cols["order"].append(v["order"] if v else 0)
        return cols

    def restored(self) -> None:
        """What a restore keeps: rows and pending keys; the counters start afresh."""
        self.stats = dict.fromkeys(self.stats, 0)
