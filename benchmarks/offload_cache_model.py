"""What an offloaded table's row cache must read and write, per step, for a workload's ids (issue 42;
docs/offload.md "Speed"): a model of cache designs, no embtables engine, no disk.

    python -m benchmarks.offload_cache_model                          # 1 table of 1M rows, 600k cached, Zipf
    python -m benchmarks.offload_cache_model --rows 10000000 --cache-rows 2000000 --ids uniform

The ids are the benchmark's own (``benchmarks.workload``: B 4096 x 20 ids, Zipf ranks hashed over the rows),
a fresh batch every step. Six designs, the current batch's units always kept:

* ``page_groups``: embtables' earlier cache (before issue 59): units of G rows, whole pages of the weights file and
  of each slot file (G = 16 for 64 float32 columns), the least used dropped (ids looked up, decayed by 0.98 a
  step); a missed unit is read (one page per file) and, dirty after training, written back whole (one page
  per file). ``page_groups_lru``: the same units, the least recently used dropped (its earlier policy).
* ``rows``: a least-recently-used row cache (rows copied into a compact array; embtables' cache since issue 59
  drops the least used instead); a missed row reads its page of each file, and its write-back must read the
  page it lands in again when the page cache no longer holds it (a page is the unit of I/O: read, modify,
  write).
* ``first_touch_groups``: least-recently-used page groups over rows placed in the files in the order of their
  first lookup (hot rows, looked up early, share pages): what a remapping of rows to file slots would give.
* ``interleaved_groups``: a row's weights and slots side by side in one file, units of one page (G / files
  rows: 8 for Adagrad at 64 float32 columns), least used dropped: a missed unit is one page read and one
  written, where ``page_groups`` reads and writes a page in each file. ``interleaved_first_touch``: the same
  over rows placed by their first lookup.

Prints one JSON line per design and window of steps: units missed, pages read and written per step, and
the step's I/O time at ``--iops`` random 4 KiB operations a second (the floor a step cannot go under).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workload import Workload, make_batches


class LruUnits:
    """Least-recently-used units (of ``unit`` slots) with ``capacity`` units in memory; ``decay``: least
    used instead, each unit's looked-up ids counted with weight ``decay`` ** (steps since) (embtables' cache)."""

    def __init__(self, slots: int, unit: int, capacity: int, decay: float | None = None) -> None:
        self.unit, self.capacity, self.decay = unit, capacity, decay
        self.resident = np.zeros(-(-slots // unit), dtype=bool)
        self.last = np.full(self.resident.size, -1, dtype=np.int64)
        self.uses = np.zeros(self.resident.size)
        self.count = 0

    def step(self, slots: np.ndarray, t: int) -> int:
        """Admit the units of ``slots`` (with repeats: each id looked up); returns how many were not in memory."""
        units, counts = np.unique(slots // self.unit, return_counts=True)
        missed = int((~self.resident[units]).sum())
        self.count += missed
        if self.decay is not None:
            self.uses[units] = self.uses[units] * self.decay ** (t - self.last[units]) + counts
        self.resident[units] = True
        self.last[units] = t
        over = self.count - self.capacity
        if over > 0:
            held = np.nonzero(self.resident & (self.last < t))[0]
            key = self.last[held] if self.decay is None else self.uses[held] * self.decay ** (t - self.last[held])
            victims = held[np.argpartition(key, over)[:over]]
            self.resident[victims] = False
            self.count -= victims.size
        return missed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--cache-rows", type=int, default=600_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--files", type=int, default=2, help="files a row lives in: weights and each slot (Adagrad: 2)")
    ap.add_argument("--ids", default="zipf", choices=["zipf", "uniform"])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--window", type=int, default=40, help="steps a printed line averages")
    ap.add_argument("--iops", type=float, default=66_000.0, help="the disk's random 4 KiB operations a second")
    args = ap.parse_args(argv)
    wl = Workload(args.ids, 1, args.rows, args.dim, 4096, 20, ids=args.ids, num_batches=args.steps)
    group = max(1, 4096 // (args.dim * 4))
    designs = {
        "page_groups_lru": LruUnits(args.rows, group, args.cache_rows // group),
        "page_groups": LruUnits(args.rows, group, args.cache_rows // group, decay=0.98),
        "rows": LruUnits(args.rows, 1, args.cache_rows),
        "first_touch_groups": LruUnits(args.rows, group, args.cache_rows // group),
    }
    mixed = max(1, group // args.files)  # rows a page of interleaved weights and slots holds
    for name in ("interleaved_groups", "interleaved_first_touch"):
        designs[name] = LruUnits(args.rows, mixed, args.cache_rows // mixed, decay=0.98)
    slot = np.full(args.rows, -1, dtype=np.int64)  # first_touch_groups: each row's place in the files
    placed = 0
    missed: dict[str, list[int]] = {name: [] for name in designs}
    for t, batch in enumerate(make_batches(wl)):
        ids = batch.ids[0]
        distinct, first = np.unique(ids, return_index=True)
        new = slot[distinct] < 0
        fresh = distinct[new][np.argsort(first[new])]
        slot[fresh] = np.arange(placed, placed + fresh.size)
        placed += fresh.size
        for name in ("page_groups_lru", "page_groups"):
            missed[name].append(designs[name].step(ids, t))
        missed["rows"].append(designs["rows"].step(distinct, t))
        missed["first_touch_groups"].append(designs["first_touch_groups"].step(slot[ids], t))
        missed["interleaved_groups"].append(designs["interleaved_groups"].step(ids, t))
        missed["interleaved_first_touch"].append(designs["interleaved_first_touch"].step(slot[ids], t))
    for name, counts in missed.items():
        files = 1 if name.startswith("interleaved") else args.files  # pages a missed unit reads (and writes)
        reads_per_unit = 2 * files if name == "rows" else files  # a row's write-back reads its page again
        for lo in range(0, args.steps, args.window):
            units = float(np.mean(counts[lo : lo + args.window]))
            reads, writes = units * reads_per_unit, units * files
            print(json.dumps({
                "bench": "offload_cache_model", "design": name, "ids": args.ids, "rows": args.rows,
                "cache_rows": args.cache_rows, "steps": f"{lo}-{min(lo + args.window, args.steps) - 1}",
                "unit_rows": 1 if name == "rows" else mixed if files == 1 else group,
                "missed_units_per_step": round(units),
                "pages_read_per_step": round(reads), "pages_written_per_step": round(writes),
                "io_floor_ms": round((reads + writes) / args.iops * 1e3, 1),
            }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
