"""Checkpoint save and restore throughput next to the disk's own sequential bandwidth, and the peak
extra memory of a save and of a restore. JSON lines on stdout.

    python -m benchmarks.bench_checkpoint [--gib 2] [--dir DIR]

The table set is 4 tables x (rows, 64) float32 with Adagrad (weights + accumulators), sized to
``--gib``. The disk figures come from the same directory in the same run: a file of the same size
written with the same chunked writes and an fsync, then read back. Reads are measured twice: cold
(the benchmark drops the pages of the files it wrote with ``posix_fadvise(DONTNEED)`` first, for the
disk probe and for the checkpoint alike) and warm (from the page cache). Peak extra memory is
VmHWM - VmRSS before the operation, sampled by the kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _drop_pages(path: Path) -> None:
    """Evict ``path``'s (a file's, or every file's under a directory) pages from the page cache."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(file: Path) -> float:
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    n = 0
    with open(file, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n / (time.perf_counter() - t0)


def _disk(path: Path, nbytes: int) -> tuple[float, float, float]:
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
    _drop_pages(file)
    cold = _read_all(file)
    warm = _read_all(file)
    file.unlink()
    return write, cold, warm


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
        disk_write, disk_cold, disk_warm = _disk(root, state_bytes)
        _reset_peak()
        before = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        where = emb.save(root / "ckpts", progress=False)
        save_s = time.perf_counter() - t0
        peak_extra = (_rss_kib("VmHWM") - before) * 1024
        restore_s = {}
        restore_extra = 0
        for kind in ("cold", "warm"):
            if kind == "cold":
                _drop_pages(Path(where))
            _reset_peak()
            before = _rss_kib("VmRSS")
            t0 = time.perf_counter()
            emb.restore(where, progress=False)
            restore_s[kind] = time.perf_counter() - t0
            restore_extra = max(restore_extra, (_rss_kib("VmHWM") - before) * 1024)
        record = {
            "bench": "checkpoint",
            "state_gib": round(state_bytes / 2**30, 3),
            "save_gbps": round(state_bytes / save_s / 1e9, 3),
            "disk_write_gbps": round(disk_write / 1e9, 3),
            "save_vs_disk": round(state_bytes / save_s / disk_write, 3),
            "save_peak_extra_mib": round(peak_extra / 2**20, 1),
            "save_peak_extra_share": round(peak_extra / state_bytes, 4),
            "restore_cold_gbps": round(state_bytes / restore_s["cold"] / 1e9, 3),
            "disk_read_cold_gbps": round(disk_cold / 1e9, 3),
            "restore_cold_vs_disk_read": round(state_bytes / restore_s["cold"] / disk_cold, 3),
            "restore_warm_gbps": round(state_bytes / restore_s["warm"] / 1e9, 3),
            "disk_read_warm_gbps": round(disk_warm / 1e9, 3),
            "restore_warm_vs_disk_read": round(state_bytes / restore_s["warm"] / disk_warm, 3),
            "restore_peak_extra_mib": round(restore_extra / 2**20, 1),
            "restore_peak_extra_share": round(restore_extra / state_bytes, 4),
            "restore_note": "two passes (verify, then copy into place) over the same open files",
        }
        emit(record)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
