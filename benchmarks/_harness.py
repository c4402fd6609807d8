"""Timing harness shared by every benchmark: warmup, median/p90, peak RSS, JSON lines, progress bar.

Contract for an implementation ("impl") under test, shared by the peers and by embtables itself:
a *factory* ``(workload, batches, optimizer_spec, mode) -> Impl`` builds the tables and returns an
:class:`Impl` whose ``run(i)`` performs one full step on ``batches[i % len(batches)]``: in ``"train"``
mode lookup + backward of ``(acts * fixed_grad).sum()`` + the fused optimizer update, in ``"lookup"``
mode the forward lookup only. A factory that cannot run (package missing, optimizer unsupported)
raises :class:`Skip` with a one-line reason; the runner prints it as a ``"skipped"`` JSON line.

Useful bytes per step (``useful_GBps`` = useful bytes / median step time), with ``row = dim * 4`` bytes:

* training:  ``sum_t [ N_t * row  +  U_t * 2 * (row + slot_bytes) ]``
* lookup:    ``sum_t   N_t * row``

where ``N_t = batch * pooling`` is the number of id occurrences of table t (rows gathered by the
lookup), ``U_t`` the number of *unique* rows of table t touched in the step (each read and written once
by the update), and ``slot_bytes`` the optimizer state bytes per row (elementwise Adagrad: ``row``;
Adam and FTRL: ``2 * row``; SGD: 0; FBGEMM's row-wise Adagrad: 4). The output activations, the
activation gradient and index traffic are deliberately *not* counted: this is the table traffic that a
perfect implementation cannot avoid, so ``useful_GBps`` can be compared against the memory probe
(``benchmarks/membw.py``). Repeated occurrences of hot ids hit the cache, so with Zipf ids a lookup's
``useful_GBps`` can exceed the probe's DRAM gather bandwidth.

``peak_rss_MB`` is the process RSS peak while the impl was built and timed, ``rss_before_MB`` the RSS
before it was built (what earlier impls left behind: TensorFlow keeps the memory of its freed variables,
so after a TF measurement this is several GB); their difference is the impl's own footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks.workload import Batch, Workload

T = TypeVar("T")


class Skip(Exception):
    """Raised by a factory that cannot run here; the message is the one-line reason."""


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and its hyper-parameters (TPU semantics unless an impl notes otherwise)."""

    name: str  # "adagrad" | "adam" | "sgd" | "ftrl"
    lr: float = 0.1
    initial_accumulator: float = 0.1  # Adagrad and FTRL
    eps: float = 1e-10  # torch Adagrad's default; TPU Adagrad has none (impls report what they use)
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_power: float = -0.5  # FTRL

    @property
    def slots(self) -> int:
        return {"adagrad": 1, "adam": 2, "ftrl": 2, "sgd": 0}[self.name]


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adagrad": OptimizerSpec("adagrad", lr=0.1, initial_accumulator=0.1),
    "adam": OptimizerSpec("adam", lr=0.001),
    "sgd": OptimizerSpec("sgd", lr=0.1),
    "ftrl": OptimizerSpec("ftrl", lr=0.1, initial_accumulator=0.1),
}


@dataclass
class Impl:
    """What a factory returns: the step callable plus what the report needs to know about it."""

    impl: str
    optimizer: str  # what really ran, e.g. "adagrad" or "adagrad_rowwise"
    run: Callable[[int], None]
    slot_bytes_per_row: int = 0
    value_bytes: int = 4  # bytes of one stored table value (2: a bfloat16 / float16 table)
    notes: str = ""
    read_weights: Callable[[], list[np.ndarray]] | None = None  # for the correctness check only
    set_weights: Callable[[list[np.ndarray]], None] | None = None  # for the correctness check only
    extra: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)  # semantics the oracle check must reproduce


Factory = Callable[[Workload, list[Batch], OptimizerSpec, str], Impl]


def useful_bytes(wl: Workload, batch: Batch, slot_bytes_per_row: int, mode: str, value_bytes: int = 4) -> int:
    """Bytes of table traffic one step cannot avoid (formula in the module docstring; a half-precision
    table's rows are ``dim * 2`` bytes)."""
    row = wl.dim * value_bytes
    gathered = wl.ids_per_step * row
    if mode == "lookup":
        return gathered
    return gathered + batch.total_unique * 2 * (row + slot_bytes_per_row)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class RssSampler:
    """Peak RSS during a ``with`` block, sampled every ``interval`` s by a thread (the process-wide
    ``ru_maxrss`` never goes down, so it cannot tell one impl's peak from the previous one's)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.start = self.peak = current_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())

    start: int = 0

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def _cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process) from /proc; (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return sum(v) - v[3] - v[4], int(own[11]) + int(own[12])  # minus idle, iowait; utime + stime
    except (OSError, IndexError, ValueError):
        return 0, 0


class OtherLoad:
    """CPUs kept busy by *other* processes during a ``with`` block (``other_cpus``). On this 2-core
    machine one busy neighbour (a test run) makes OpenMP barriers stall for tens of ms, so every
    record carries this number: treat a measurement with ``other_cpus`` above ~0.2 as contaminated."""

    def __enter__(self) -> OtherLoad:
        self._t0, (self._b0, self._s0) = time.perf_counter(), _cpu_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        b1, s1 = _cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        self.other_cpus = max(0.0, ((b1 - self._b0) - (s1 - self._s0)) / hz / max(wall, 1e-9))


BUSY_THRESHOLD = 0.2  # other processes' CPUs above which a measurement counts as contaminated


def wait_for_idle(max_wait_s: float, threshold: float = BUSY_THRESHOLD, sample_s: float = 1.0) -> float:
    """Wait (at most ``max_wait_s``) until other processes use < ``threshold`` CPUs; return the last load."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with OtherLoad() as load:
            time.sleep(sample_s)
        if load.other_cpus < threshold or time.perf_counter() >= deadline:
            return load.other_cpus
        print(
            f"[wait-idle] other processes use {load.other_cpus:.2f} CPUs; waiting",
            file=sys.stderr,
            flush=True,
        )


def progress(it: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """tqdm on stderr when installed and enabled, else one plain line per ~10% on stderr."""
    if os.environ.get("BENCH_PROGRESS", "1") == "0":
        yield from it
        return
    try:
        from tqdm import tqdm
    except ImportError:
        step = max(1, total // 10)
        for i, x in enumerate(it):
            if i % step == 0 or i == total - 1:
                print(f"[{desc}] {i + 1}/{total}", file=sys.stderr, flush=True)
            yield x
        return
    yield from tqdm(it, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def time_steps(fn: Callable[[int], None], warmup: int, steps: int, desc: str) -> list[float]:
    """Run ``fn(i)`` ``warmup`` times untimed, then ``steps`` times; return each step's ms."""
    for i in progress(range(warmup), warmup, f"{desc} warmup"):
        fn(i)
    times = []
    for i in progress(range(steps), steps, desc):
        t0 = time.perf_counter()
        fn(warmup + i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median wall time of ``reps`` calls of ``fn``, after one untimed call (page faults, code)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summarize(times_ms: list[float]) -> dict[str, float]:
    arr = np.asarray(times_ms)
    med = float(statistics.median(times_ms))
    return {
        "median_ms": round(med, 3),
        "p90_ms": round(float(np.percentile(arr, 90)), 3),
        "min_ms": round(float(arr.min()), 3),
        "steps_per_s": round(1e3 / med, 3) if med > 0 else float("inf"),
    }


RECORDS: list[dict[str, Any]] = []  # everything emitted in this process, for the report


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line on stdout (the machine-readable result stream) and keep it for the report."""
    RECORDS.append(record)
    print(json.dumps(record, sort_keys=False), flush=True)


def check_table_out(parser: argparse.ArgumentParser, out: str | None) -> None:
    """``parser.error`` (exit 2, one line) before a benchmark runs when ``--out FILE`` could not be written: a
    folder, a missing folder, or an existing file that is not a table a benchmark wrote (its first character is
    ``|``) (``cli/output_files``)."""
    if out:
        from embtables.cli.output_files import check_output

        try:
            check_output(Path(out), "--out", "a Markdown table a benchmark wrote", lambda head: head.startswith(b"|"),
                         overwrite=None)  # fmt: skip
        except (OSError, ValueError) as exc:
            parser.error(str(exc))


def emit_table(table: str, out: str | None) -> None:
    """A benchmark's Markdown summary table on stderr, and into ``out`` when given (``--out``, checked by
    ``check_table_out`` at the start), whole or not at all."""
    print(table, file=sys.stderr)
    if out:
        from embtables.checkpoint.owned_dirs import write_atomically

        write_atomically(Path(out), lambda f: f.write((table + "\n").encode()))


def emit_skip(bench: str, impl: str, reason: str, **fields: Any) -> None:
    print(f"[skip] {impl}: {reason}", file=sys.stderr, flush=True)
    emit({"bench": bench, "impl": impl, **fields, "skipped": reason})


_MALLOC_SETTING = "default"


def keep_freed_memory() -> str:
    """``embtables.cli.malloc.keep_freed_memory`` (glibc keeps freed memory: no fresh page faults for a
    step's [B, D] tensors), applied to every impl of the run alike and recorded in the ``env`` record;
    returns "kept" or why not."""
    global _MALLOC_SETTING
    from embtables.cli.malloc import keep_freed_memory as keep

    _MALLOC_SETTING = keep()
    return _MALLOC_SETTING


def env_record() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "bench": "env",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "malloc": _MALLOC_SETTING,
    }


def workload_fields(wl: Workload) -> dict[str, Any]:
    return {
        "workload": wl.name,
        "ids": wl.ids,
        "tables": wl.tables,
        "rows": wl.rows,
        "dim": wl.dim,
        "batch": wl.batch,
        "pooling": wl.pooling,
    }


def bench_impl(
    name: str,
    factory: Factory,
    wl: Workload,
    batches: list[Batch],
    opt: OptimizerSpec,
    mode: str,
    warmup: int,
    steps: int,
    wait_idle_s: float = 0.0,
    retries: int = 0,
) -> dict[str, Any] | None:
    """Build, time and report one impl on one workload; a :class:`Skip` becomes a skip line.

    With ``wait_idle_s`` > 0 the timing starts once other processes are idle, and is redone (up to
    ``retries`` times, same tables) when another process was busy during it; the attempt with the least
    ``other_cpus`` is reported."""
    import gc

    bench = "train_step" if mode == "train" else "lookup"
    base = {"optimizer": opt.name if mode == "train" else None, **workload_fields(wl)}
    with RssSampler() as rss:
        try:
            t0 = time.perf_counter()
            impl = factory(wl, batches, opt, mode)
            build_s = time.perf_counter() - t0
        except Skip as exc:
            emit_skip(bench, name, str(exc), **base)
            return None
        except Exception as exc:  # a broken peer must not end the one-process run
            emit_skip(bench, name, f"failed to build: {type(exc).__name__}: {str(exc)[:300]}", **base)
            return None
        best: tuple[float, list[float]] | None = None
        attempts = 0
        try:
            for attempts in range(1, retries + 2):  # noqa: B007 - reported below
                if wait_idle_s > 0:
                    wait_for_idle(wait_idle_s)
                with OtherLoad() as load:
                    t = time_steps(impl.run, warmup, steps, f"{name} {opt.name if mode == 'train' else 'lookup'}")
                if best is None or load.other_cpus < best[0]:
                    best = (load.other_cpus, t)
                if load.other_cpus < BUSY_THRESHOLD:
                    break
        except Exception as exc:
            emit_skip(bench, name, f"failed while stepping: {type(exc).__name__}: {str(exc)[:300]}", **base)
            del impl
            gc.collect()
            return None
    assert best is not None
    other_cpus, times = best
    stats = summarize(times)
    ub = statistics.mean(useful_bytes(wl, b, impl.slot_bytes_per_row, mode, impl.value_bytes) for b in batches)
    med_s = stats["median_ms"] / 1e3
    rec: dict[str, Any] = {
        "bench": bench,
        "impl": impl.impl,
        **base,
        "optimizer": impl.optimizer if mode == "train" else None,
        **stats,
        "ids_per_s": round(wl.ids_per_step / med_s),
        "useful_GBps": round(ub / med_s / 1e9, 3),
        "unique_rows_per_step": round(statistics.mean(b.total_unique for b in batches)),
        "peak_rss_MB": round(rss.peak_mb, 1),
        "rss_before_MB": round(rss.start / 2**20, 1),
        "build_s": round(build_s, 2),
        "other_cpus": round(other_cpus, 2),
        "attempts": attempts,
        "steps": steps,
        "warmup": warmup,
        **impl.extra,
    }
    if impl.notes:
        rec["notes"] = impl.notes
    emit(rec)
    del impl
    gc.collect()
    return rec
