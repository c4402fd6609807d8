"""Incremental checkpoints against full ones, in one run: rows, bytes and seconds per increment and per
full save, and the restore of a full checkpoint + its increments against the restore of one full checkpoint
of the same step. JSON lines on stdout, a table on stderr.

    python -m embtables bench incremental [--every 10,100,1000] [--increments 3] [--full-above 1.0] [--dir DIR]

The standard workload (8 tables x 1,000,000 x 64, Adagrad, batch 4096, 20 Zipf ids a bag, 2 threads), a
fresh batch every step (``benchmarks/workload.py`` with the step as the seed, made outside the timings), so
that the rows an increment holds grow with the steps between saves as they do in training. For each save
interval: a full save (the chain's first), then ``--increments`` increments, each after that many steps;
then a full save of the same state, and both restored into a fresh module (page cache warm for both).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit, progress
from benchmarks.workload import STANDARD, make_batches
from embtables.checkpoint import increments


def _module(wl: Any) -> et.DistributedEmbedding:
    features = {
        f"f{t}": et.FeatureConfig(et.TableConfig(wl.rows, wl.dim, name=f"t{t}", initializer=et.Constant(0.01)))
        for t in range(wl.tables)
    }
    return et.DistributedEmbedding(features, et.Adagrad(0.1, initial_accumulator_value=0.1))


def _peak_extra_mib(fn: Any) -> tuple[Any, float]:
    """``fn()`` and the peak resident memory it added (VmHWM after, less VmRSS before; the peak reset first)."""
    status = Path("/proc/self/status")

    def kib(field: str) -> int:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    before = kib("VmRSS")
    out = fn()
    return out, max(0, kib("VmHWM") - before) / 1024


def _emit(record: dict[str, Any]) -> dict[str, Any]:
    record = {"bench": "incremental", **record}
    emit(record)
    return record


def _serving(out: Path, wl: Any, seconds: float = 3.0) -> dict[str, Any]:
    """Lookups a second of one reader thread on the export at ``out`` (its deltas held back), idle and over
    a window of ``seconds`` in which the deltas are applied one by one (``ServingEmbedding.update``)."""
    held = out.parent / f"{out.name}-held"
    held.mkdir()
    deltas = sorted(out.glob("delta-*"))
    for d in deltas:
        shutil.move(str(d), held / d.name)
    serving = et.ServingEmbedding.load(out)
    (batch,) = make_batches(wl.with_(num_batches=1, seed=10**6))
    splits = torch.arange(0, wl.batch * wl.pooling + 1, wl.pooling)
    query = {f"f{t}": et.Ragged(torch.from_numpy(batch.ids[t]), splits) for t in range(wl.tables)}
    done = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            serving(query)
            done[0] += 1

    def rate(during: bool) -> float:
        stop.clear()
        done[0] = 0
        thread = threading.Thread(target=reader)
        t0 = time.perf_counter()
        thread.start()
        if during:
            time.sleep(seconds / (len(deltas) + 1))
            for d in deltas:
                shutil.move(str(held / d.name), out / d.name)
                t1 = time.perf_counter()
                serving.update()
                updates.append(time.perf_counter() - t1)
                time.sleep(seconds / (len(deltas) + 1))
        else:
            time.sleep(seconds)
        stop.set()
        thread.join()
        return done[0] / (time.perf_counter() - t0)

    updates: list[float] = []
    idle = rate(during=False)
    busy = rate(during=True)
    held.rmdir()
    return {
        "lookups_per_s_idle": round(idle, 2), "lookups_per_s_during_updates": round(busy, 2),
        "of_idle": round(busy / idle, 3), "update_seconds": [round(u, 3) for u in updates], "window_s": seconds,
    }  # fmt: skip


def _bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embtables bench incremental", description=__doc__.split("\n\n")[0])
    p.add_argument("--every", default="10,100,1000", help="steps between saves (comma-separated)")
    p.add_argument("--increments", type=int, default=3, help="increments after the chain's full save")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--full-above", type=float, default=None,
        help="a full checkpoint when more than this share of the rows changed (default: the library's, "
        f"{increments.FULL_ABOVE}; 1.0: always an increment)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.full_above is not None:
        increments.FULL_ABOVE = args.full_above
    torch.set_num_threads(args.threads)
    wl = STANDARD
    grad = {f"f{t}": torch.full((wl.batch, wl.dim), 1e-3) for t in range(wl.tables)}
    splits = torch.arange(0, wl.batch * wl.pooling + 1, wl.pooling)
    state_bytes = wl.tables * wl.rows * wl.dim * 4 * 2
    base = Path(args.dir or tempfile.mkdtemp(prefix="embtables-bench-incremental-"))
    step = 0

    def train(emb: et.DistributedEmbedding, steps: int, desc: str) -> None:
        nonlocal step
        for _ in progress(range(steps), steps, desc):
            (batch,) = make_batches(wl.with_(num_batches=1, seed=step))
            emb({f"f{t}": et.Ragged(torch.from_numpy(batch.ids[t]), splits) for t in range(wl.tables)})
            emb.apply_gradients(grad)
            step += 1

    rows_total = wl.tables * wl.rows
    lines = []
    try:
        intervals = [int(x) for x in args.every.split(",")]
        for every in intervals:
            emb = _module(wl)
            root = base / f"every-{every}"
            train(emb, every, f"every {every}: steps")
            t0 = time.perf_counter()
            first = emb.save(root, incremental=True)
            full_s = time.perf_counter() - t0
            record = {"bench": "incremental", "every": every, "kind": "full", "rows": rows_total, "fraction": 1.0,
                      "bytes": _bytes(first), "seconds": round(full_s, 3)}  # fmt: skip
            emit(record)
            lines.append(record)
            serve = base / f"serve-{every}" if every == intervals[0] else None
            if serve is not None:
                t0 = time.perf_counter()
                et.export(root, serve)
                lines.append(_emit({"every": every, "kind": "export", "seconds": round(time.perf_counter() - t0, 3),
                                    "bytes": _bytes(serve)}))  # fmt: skip
            links = 1  # the checkpoints a restore of the newest reads
            for k in range(args.increments):
                train(emb, every, f"every {every}: steps")
                changed = sum(int(r.numel()) for r in emb.changed_rows().values())
                t0 = time.perf_counter()
                where, extra_mib = _peak_extra_mib(functools.partial(emb.save, root, incremental=True))
                seconds = time.perf_counter() - t0
                chained = "chain" in json.loads((Path(where) / "manifest.json").read_text())
                links = links + 1 if chained else 1
                record = {
                    "bench": "incremental", "every": every, "kind": "increment" if chained else "full (policy)",
                    "index": k + 1, "rows": changed,
                    "fraction": round(changed / rows_total, 5), "bytes": _bytes(where), "seconds": round(seconds, 3),
                    "of_full_save": round(seconds / full_s, 4), "peak_extra_mib": round(extra_mib, 1),
                }  # fmt: skip
                emit(record)
                lines.append(record)
                if serve is not None:
                    t0 = time.perf_counter()
                    report = et.export(root, serve, incremental=True)
                    seconds = time.perf_counter() - t0
                    kind, written = ("delta", Path(report.delta)) if report.delta else ("export", serve)
                    lines.append(_emit({"every": every, "kind": kind, "index": k + 1, "seconds": round(seconds, 3),
                                        "bytes": _bytes(written)}))  # fmt: skip
            if serve is not None:
                lines.append(_emit({"every": every, "kind": "serving", **_serving(serve, wl)}))
                shutil.rmtree(serve, ignore_errors=True)
            t0 = time.perf_counter()
            full = emb.save(base / f"full-{every}")
            full_again_s = time.perf_counter() - t0
            del emb
            target = _module(wl)
            t0 = time.perf_counter()
            target.restore(root)
            chain_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            target.restore(full)
            full_restore_s = time.perf_counter() - t0
            record = {
                "bench": "incremental", "every": every, "kind": "restore", "links": links,
                "chain_seconds": round(chain_s, 3), "full_seconds": round(full_restore_s, 3),
                "full_save_seconds": round(full_again_s, 3), "state_bytes": state_bytes,
            }  # fmt: skip
            emit(record)
            lines.append(record)
            del target
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(base / f"full-{every}", ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("every  kind        rows changed   bytes (MiB)  seconds  of a full save", file=sys.stderr)
    for r in lines:
        if r["kind"] in ("export", "delta"):
            print(f"{r['every']:5d}  {r['kind']:10s} {'':20s} {r['bytes'] / 2**20:9.1f}  {r['seconds']:7.2f}",
                  file=sys.stderr)  # fmt: skip
        elif r["kind"] == "serving":
            print(f"{r['every']:5d}  serving     {r['lookups_per_s_idle']:.1f} lookups/s idle, "
                  f"{r['lookups_per_s_during_updates']:.1f} while {len(r['update_seconds'])} deltas were applied "
                  f"({r['of_idle']:.0%}; updates {r['update_seconds']} s)", file=sys.stderr)  # fmt: skip
        elif r["kind"] == "restore":
            print(f"{r['every']:5d}  restore     chain of {r['links']}: {r['chain_seconds']:.2f} s, "
                  f"one full checkpoint: {r['full_seconds']:.2f} s", file=sys.stderr)  # fmt: skip
        else:
            share = f"{r.get('of_full_save', 1.0):.1%}"
            print(f"{r['every']:5d}  {r['kind']:10s} {r['rows']:9d} ({r['fraction']:.2%}) {r['bytes'] / 2**20:9.1f}  "
                  f"{r['seconds']:7.2f}  {share}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
