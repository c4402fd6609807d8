"""Checkpoint save and restore throughput next to the disk's own sequential bandwidth, and the peak
extra memory of a save. JSON lines on stdout.

    python -m benchmarks.bench_checkpoint [--gib 2] [--dir DIR]

The table set is 4 tables x (rows, 64) float32 with Adagrad (weights + accumulators), sized to
``--gib``. The disk figures come from the same directory in the same run: a file of the same size
written with the same chunked writes and an fsync, then read back. Reads come from the page cache,
for both the disk figure and the restore: dropping caches needs root. Peak extra memory is
VmHWM - VmRSS before the save, sampled by the kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import embtables as et


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _disk(path: Path, nbytes: int) -> tuple[float, float]:
    block = os.urandom(64 << 20)
    file = path / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(file, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        os.fsync(f.fileno())
    write = written / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with open(file, "rb") as f:
        while f.readinto(bytearray(64 << 20)):
            pass
    read = written / (time.perf_counter() - t0)
    file.unlink()
    return write, read


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    rows = int(args.gib * 2**30 / (4 * 64 * 4 * 2))
    tables = {
        f"f{i}": et.FeatureConfig(
            et.TableConfig(rows, 64, name=f"t{i}", initializer=et.Constant(0.01 * i), optimizer=et.Adagrad(0.1))
        )
        for i in range(4)
    }
    emb = et.DistributedEmbedding(tables)
    state_bytes = 4 * rows * 64 * 4 * 2
    root = Path(args.dir or tempfile.mkdtemp(prefix="embtables-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        disk_write, disk_read = _disk(root, state_bytes)
        _reset_peak()
        before = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        where = emb.save(root / "ckpts", progress=False)
        save_s = time.perf_counter() - t0
        peak_extra = (_rss_kib("VmHWM") - before) * 1024
        t0 = time.perf_counter()
        emb.restore(where, progress=False)
        restore_s = time.perf_counter() - t0
        record = {
            "bench": "checkpoint",
            "state_gib": round(state_bytes / 2**30, 3),
            "save_gbps": round(state_bytes / save_s / 1e9, 3),
            "disk_write_gbps": round(disk_write / 1e9, 3),
            "save_vs_disk": round(state_bytes / save_s / disk_write, 3),
            "restore_gbps": round(state_bytes / restore_s / 1e9, 3),
            "disk_read_gbps_page_cache": round(disk_read / 1e9, 3),
            "restore_vs_disk_read": round(state_bytes / restore_s / disk_read, 3),
            "save_peak_extra_mib": round(peak_extra / 2**20, 1),
            "save_peak_extra_share": round(peak_extra / state_bytes, 4),
            "restore_note": "restore stages this rank's rows before writing (all-or-nothing): +100% of the state",
        }
        print(json.dumps(record), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
