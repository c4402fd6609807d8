"""Offloaded tables against the same tables in memory (issue 42; docs/offload.md), side by side in one run:

    python -m embtables bench offload                                  # 8 x 1M x 64 Adagrad, B 4096, 20 Zipf ids
    python -m embtables bench offload --rows 6000000 --cache-rows 2000000 --directory /nvme/bench
    python -m embtables bench offload --tables 2 --cases zipf --read-ahead   # also with the next batch staged early

(a) **Zipf** (the standard workload's ids): the step time (lookup + apply_gradients) of the offloaded tables
with ``--cache-rows`` rows each in memory, against the in-memory step of the same tables, measured in the same
run; the cache's hit rate, rows read and written a step, the time a step waits for the disk, and the process's
resident memory (peak, sampled). Tables that do not fit in half the machine's memory run in memory scaled down
to fit (fewer rows, the same batches: ``rows`` and ``scaled_from_rows`` in its record).

(b) **uniform ids**: rows the disk served per second (looked-up rows not in memory) and 4 KiB pages read per
second (a row's record, its weights and slots, is one read) against the disk's random 4 KiB read rate,
measured in the same run on a file in the same directory (``O_DIRECT`` reads, the page cache bypassed, at queue
depth 1 and 32: one thread, then 32, each with one read in flight).

For every case, the **disk-bound floor** of a step (the 4 KiB pages it read, at the QD32 rate: what a step
costs when the disk alone is the limit) and the hit rate of an **ideal LFU** of the same capacity in rows,
replayed on the same ids (every id's count over the whole run, a batch's rows admitted whole, the least
counted others evicted): how much of a hit rate the cache's policy gives away.

Prints JSON lines: ``env``, ``disk_probe``, ``offload_step`` per case and an ``offload_summary``. The tables'
files go under ``--directory`` (a fresh subdirectory; removed at the end) after checking its free space.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import itertools
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import RssSampler, current_rss_bytes, emit, env_record
from benchmarks.workload import Batch, Workload, iter_batches, make_batches


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=20)
    ap.add_argument("--cache-rows", type=int, default=250_000, help="rows of each table in memory at once")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing (the cache fills)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--directory", default=None, help="where the files go (default: the temp directory)")
    ap.add_argument("--cases", default="zipf,uniform")
    ap.add_argument("--probe-seconds", type=float, default=3.0, help="at each queue depth")
    ap.add_argument("--probe-mib", type=int, default=1024, help="the probe file's size (larger than the drive's cache)")
    ap.add_argument(
        "--batches", type=int, default=8,
        help="distinct batches the steps cycle through (warm-up + steps or more: every step a fresh batch)",
    )  # fmt: skip
    ap.add_argument(
        "--cold", action="store_true",
        help="after the warm-up, write the tables' files back and drop them from the page cache: the timed steps "
        "read what they miss from the disk",
    )  # fmt: skip
    ap.add_argument(
        "--cold-every-step", action="store_true",
        help="as --cold, and again after every timed step, inside its time (its dirty pages written back, then "
        "dropped): a table far larger than the page cache, where nothing a step wrote or read stays cached",
    )  # fmt: skip
    ap.add_argument(
        "--read-ahead", action="store_true",
        help="also time the offloaded tables with the next batch staged (enqueue) before each apply_gradients",
    )  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(env_record())
    root = tempfile.mkdtemp(prefix="embtables-bench-offload-", dir=args.directory)
    try:
        need = args.tables * args.rows * args.dim * 4 * 2 + (args.probe_mib << 20)  # rows, an Adagrad slot, the probe
        free = shutil.disk_usage(root).free
        if free < need:
            print(f"[offload] {root}: {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed", file=sys.stderr)
            return 1
        probe = _disk_probe(root, args.probe_seconds, args.probe_mib << 20)
        emit({"bench": "disk_probe", **probe})
        results = {}
        for ids in args.cases.split(","):
            wl = Workload(
                ids, args.tables, args.rows, args.dim, args.batch, args.pooling, ids=ids, num_batches=args.batches
            )
            results[ids] = _case(wl, args, os.path.join(root, ids), probe)
        summary: dict[str, Any] = {"bench": "offload_summary"}
        if "zipf" in results and "in_memory_ms" in results["zipf"]:
            zipf = results["zipf"]
            summary["zipf_step_vs_in_memory"] = round(zipf["offloaded_ms"] / zipf["in_memory_ms"], 3)
        for ids, got in results.items():
            if "floor_ms" in got:
                summary[f"{ids}_step_vs_disk_bound_floor"] = round(got["offloaded_ms"] / max(got["floor_ms"], 1e-9), 3)
            if got.get("ideal_lfu_hit_rate"):
                summary[f"{ids}_hit_rate_vs_ideal_lfu"] = round(got["hit_rate"] / got["ideal_lfu_hit_rate"], 3)
        if "missed_rows_per_s" in results.get("uniform", {}):
            rate = probe["random_4k_reads_per_s"]
            summary["uniform_missed_rows_per_s_vs_disk_4k_reads_per_s"] = round(
                results["uniform"]["missed_rows_per_s"] / rate, 3
            )
            summary["uniform_pages_read_per_s_vs_disk_4k_reads_per_s"] = round(
                results["uniform"]["pages_read_per_s"] / rate, 3
            )
        emit(summary)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _disk_probe(root: str, seconds: float, size: int = 1 << 30) -> dict[str, Any]:
    """Random 4 KiB reads per second from a file of ``size`` bytes in ``root`` (O_DIRECT: from the disk, not the
    page cache) at queue depth 1 and 32 (threads, one read each in flight; ``seconds`` each), and its sequential
    write rate. ``random_4k_reads_per_s`` is the QD32 rate."""
    path = os.path.join(root, "probe.bin")
    block = bytes(random.getrandbits(8) for _ in range(1 << 16)) * 16  # 1 MiB, not all zeros
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_mb_s = size / 2**20 / (time.perf_counter() - start)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    pages = size // 4096

    def rate(depth: int) -> float:
        deadline = time.perf_counter() + seconds

        def reader(seed: int) -> int:
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
            rng = random.Random(seed)
            n = 0
            while time.perf_counter() < deadline:
                os.preadv(fd, [buf], rng.randrange(pages) * 4096)
                n += 1
            return n

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(depth) as pool:
            reads = sum(pool.map(reader, range(depth)))
        return reads / (time.perf_counter() - t0)

    try:
        qd1, qd32 = rate(1), rate(32)
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "random_4k_reads_per_s": round(qd32),
        "random_4k_reads_per_s_qd1": round(qd1),
        "random_4k_reads_per_s_qd32": round(qd32),
        "o_direct": bool(getattr(os, "O_DIRECT", 0)),
        "sequential_write_MB_s": round(write_mb_s),
    }


def ideal_lfu_hit_rate(wl: Workload, capacity: int, warmup: int, steps: int) -> float:
    """The hit rate (distinct rows of a step found in memory, as the engine counts them) of an LFU cache of
    ``capacity`` rows per table that knows every id's count since the run began, replayed on the ids of
    ``warmup`` + ``steps`` steps (batches cycled as the timed run does; the timed steps counted): a step's rows
    are all admitted (its lookup needs them), then the least counted other rows leave until ``capacity``
    remain (a batch larger than the cache keeps only its own). A row's first lookup is a miss here (compulsory),
    as it is for the engine's cache of rows."""
    looked = hits = 0
    counts = [np.zeros(wl.rows, dtype=np.int64) for _ in range(wl.tables)]
    held_by = [np.zeros(wl.rows, dtype=bool) for _ in range(wl.tables)]
    for i, batch in zip(range(warmup + steps), _batches(wl, warmup + steps)):
        for t in range(wl.tables):
            resident = held_by[t]
            rows, occurrences = np.unique(batch.ids[t], return_counts=True)
            if i >= warmup:
                looked += rows.size
                hits += int(resident[rows].sum())
            counts[t][rows] += occurrences
            resident[rows] = True
            held = np.flatnonzero(resident)
            over = held.size - max(capacity, rows.size)
            if over > 0:
                others = held[~np.isin(held, rows, assume_unique=True)]
                resident[others[np.argpartition(counts[t][others], over - 1)[:over]]] = False
    return hits / max(1, looked)


def _batches(wl: Workload, needed: int) -> Iterator[Batch]:
    """The run's batches in order, ``needed`` of them or more: ``wl.num_batches`` kept and cycled when fewer than
    ``needed``, else made one at a time (every step a fresh batch; their ids are never all in memory at once,
    so the resident memory measured is the module's, not the benchmark's)."""
    if wl.num_batches >= needed:
        return iter_batches(wl)
    return itertools.cycle(make_batches(wl))


def _module(wl: Workload, offload: et.Offload | None) -> et.DistributedEmbedding:
    tables = [et.TableConfig(wl.rows, wl.dim, name=f"t{i}", combiner="sum", offload=offload) for i in range(wl.tables)]
    return et.DistributedEmbedding({f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}, et.Adagrad(0.01))


def _drop_page_cache(directory: str) -> None:
    """Write the row files (and write logs) under ``directory`` back to the disk and drop their pages from the
    page cache."""
    for root, _, names in os.walk(directory):
        for name in names:
            if name.endswith((".rows", ".log")):
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _run(
    emb: et.DistributedEmbedding,
    wl: Workload,
    args: argparse.Namespace,
    read_ahead: bool = False,
    directory: str | None = None,
) -> tuple[list[float], int, dict[str, float]]:
    """Step times (ms) after the warm-up, the peak resident bytes while timing, and the offloaded tables'
    counters over the timed steps (summed over the tables; empty for tables in memory). ``read_ahead``: each
    step stages the next batch (``enqueue``, which starts reading its rows) before ``apply_gradients``.
    ``directory`` (with ``--cold``): the tables' files, dropped from the page cache after the warm-up."""
    lengths = torch.full((wl.batch,), wl.pooling, dtype=torch.int64)
    source = _batches(wl, args.warmup + args.steps + 1)
    grad = {f"f{i}": torch.full((wl.batch, wl.dim), 1e-3) for i in range(wl.tables)}
    times = []

    def next_input() -> dict[str, et.Ragged]:
        """The next batch as the module's input (made before a step's time starts)."""
        b = next(source)
        return {f"f{i}": et.Ragged.from_lengths(torch.from_numpy(ids), lengths) for i, ids in enumerate(b.ids)}

    def step(batch: dict[str, et.Ragged]) -> None:
        """One training step on ``batch`` (with read-ahead: ``batch`` is staged, the one before it trained)."""
        if read_ahead:
            emb.dequeue()
            emb.enqueue(batch)
        else:
            emb(batch)
        emb.apply_gradients(grad)

    if read_ahead:
        emb.enqueue(next_input())
    for _ in range(args.warmup):
        step(next_input())
    every = bool(getattr(args, "cold_every_step", False)) and directory is not None
    if (args.cold or every) and directory is not None:
        _drop_page_cache(directory)
    before = emb.offload_statistics()
    with RssSampler() as rss:
        for _ in range(args.steps):
            batch = next_input()
            start = time.perf_counter()
            step(batch)
            if every and directory is not None:
                _drop_page_cache(directory)  # the step's writes reach the disk within its time
            times.append((time.perf_counter() - start) * 1e3)
    after = emb.offload_statistics()
    counters = {k: sum(after[t][k] - before[t][k] for t in after) for k in next(iter(after.values()), {})}
    return times, rss.peak, counters


def _case(wl: Workload, args: argparse.Namespace, directory: str, probe: dict[str, Any]) -> dict[str, Any]:
    """The offloaded tables first (the resident memory it measures is the process's own, not what an earlier
    module left to the allocator), with ``--read-ahead`` again staging each next batch early, then the same
    tables in memory (scaled down to fit in half the machine's memory when they do not)."""
    out: dict[str, Any] = {}
    table_bytes = wl.tables * wl.rows * wl.dim * 4 * 2
    fields = {"tables": wl.tables, "rows": wl.rows, "dim": wl.dim, "batch": wl.batch, "pooling": wl.pooling,
              "ids": wl.ids, "threads": args.threads, "table_and_slot_GB": round(table_bytes / 1e9, 2),
              "cold": bool(args.cold), "cold_every_step": bool(args.cold_every_step)}  # fmt: skip
    base_rss = current_rss_bytes()
    emb = _module(wl, et.Offload(directory, args.cache_rows))
    try:
        times, peak, diff = _run(emb, wl, args, directory=directory)
    except et.InputError as exc:  # the cache cannot hold a batch's rows: say so, with the rows it needs
        emit({"bench": "offload_step", "impl": "offloaded", **fields, "cache_rows": args.cache_rows,
              "skipped": str(exc)})  # fmt: skip
        return out
    emb.close()  # its tables are in reference cycles: collected now, so the next case's memory is its own
    del emb
    gc.collect()
    steps = args.steps
    out["offloaded_ms"] = statistics.median(times)
    seconds = max(sum(times) / 1e3, 1e-9)
    out["missed_rows_per_s"] = (diff["rows_looked_up"] - diff["hits"]) / seconds  # rows the disk served
    # a row read is one random read of its record (the weights and the Adagrad slot side by side: 512 bytes at
    # D 64, never straddling a page)
    pages = diff["rows_read"]
    out["pages_read_per_s"] = pages / seconds
    out["floor_ms"] = pages / steps / probe["random_4k_reads_per_s_qd32"] * 1e3
    out["hit_rate"] = diff["hits"] / max(1, diff["rows_looked_up"])
    out["ideal_lfu_hit_rate"] = ideal_lfu_hit_rate(wl, args.cache_rows, args.warmup, args.steps)
    record = {"bench": "offload_step", "impl": "offloaded", **fields, "cache_rows": args.cache_rows,
              "ms": round(out["offloaded_ms"], 3),
              "hit_rate": round(out["hit_rate"], 4), "ideal_lfu_hit_rate": round(out["ideal_lfu_hit_rate"], 4),
              "disk_bound_floor_ms": round(out["floor_ms"], 3),
              "rows_read_per_step": round(diff["rows_read"] / steps),
              "rows_written_per_step": round(diff["rows_written"] / steps), "log_merges": diff.get("log_merges", 0),
              "disk_wait_ms_per_step": round(diff["disk_wait_s"] * 1e3 / steps, 3),
              "missed_rows_per_s": round(out["missed_rows_per_s"]), "pages_read_per_s": round(out["pages_read_per_s"]),
              "peak_rss_MB": round(peak / 2**20), "rss_before_MB": round(base_rss / 2**20),
              "cache_MB": round(wl.tables * args.cache_rows * wl.dim * 4 * 2 / 2**20)}  # fmt: skip
    if args.read_ahead:  # the same tables again, in files of their own, each step staging the next batch first
        ahead = _module(wl, et.Offload(directory + "-read-ahead", args.cache_rows))
        times, peak, diff = _run(ahead, wl, args, read_ahead=True, directory=directory + "-read-ahead")
        ahead.close()
        del ahead
        gc.collect()
        out["read_ahead_ms"] = statistics.median(times)
        ms = out["read_ahead_ms"]
        emit({"bench": "offload_step", "impl": "offloaded-read-ahead", **fields, "cache_rows": args.cache_rows,
              "ms": round(ms, 3), "vs_offloaded": round(ms / out["offloaded_ms"], 3),
              "hit_rate": round(diff["hits"] / max(1, diff["rows_looked_up"]), 4),
              "rows_prefetched_per_step": round(diff["rows_prefetched"] / steps),
              "disk_wait_ms_per_step": round(diff["disk_wait_s"] * 1e3 / steps, 3),
              "peak_rss_MB": round(peak / 2**20)})  # fmt: skip
    # the same tables in memory; where they do not fit in half the machine's memory, scaled down to fit (fewer
    # rows a table, the same batches' shape and id distribution: a step's work is the batch's, not the table's)
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fit = wl if table_bytes < total_memory // 2 else wl.with_(rows=total_memory // 2 // (wl.tables * wl.dim * 8))
    mem = _module(fit, None)
    mem_times, mem_peak, _ = _run(mem, fit, args)
    del mem
    gc.collect()
    out["in_memory_ms"] = statistics.median(mem_times)
    emit({"bench": "offload_step", "impl": "in_memory", **fields, "rows": fit.rows, "scaled_from_rows": wl.rows,
          "table_and_slot_GB": round(fit.tables * fit.rows * fit.dim * 8 / 1e9, 2), "ms": round(out["in_memory_ms"], 3),
          "peak_rss_MB": round(mem_peak / 2**20)})  # fmt: skip
    record["vs_in_memory"] = round(out["offloaded_ms"] / out["in_memory_ms"], 3)
    emit(record)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
