"""The online loop, measured: a training job exporting into a served model while clients send requests.

    python -m embtables bench online [--rows 1000000] [--tables 8] [--dim 64] [--clients 8] [--small]

One run, three phases, all real processes on loopback:
1. ``embtables train --data`` (synthetic clicks: ``--tables`` identity features of ``--rows`` buckets each, Zipf ids,
   width ``--dim``; the standard table sizes by default) trains one epoch and exports the model artifact
   (``--export-to``): the first, whole export;
2. ``embtables serve`` serves it; ``--clients`` client threads (keep-alive HTTP connections, ``--request-rows`` rows
   a request) send requests for ``--idle-seconds``: requests a second, p50 / p99 latency while nothing changes;
3. the same job trains ``--more-epochs`` more epochs with ``--save-every N --incremental --export-to`` (every save
   adds a serving delta and the dense weights to the served artifact) while the clients go on: latency during
   updates, and the freshness of every saved step: seconds from its checkpoint's publication (seen by a watcher
   polling the model directory every 10 ms) to the first response computed at that step or later.
JSON lines on stdout, a table on stderr. On a 2-core machine the trainer, the server and the clients share the
cores: the latency during updates includes that contention (the ``loadavg`` of the env record says how busy).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import check_table_out, emit, emit_table, env_record


def _data(root: Path, examples: int, tables: int, rows: int, dim: int, seed: int = 0) -> tuple[Path, Path]:
    """A Parquet file of ``examples`` clicks (Zipf ids per table, a label that depends on them) and its schema."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    frame = {}
    signal = np.zeros(examples)
    for t in range(tables):
        ids = (rng.zipf(1.1, examples) - 1) % rows
        frame[f"f{t}"] = ids
        signal += np.where(ids % 7 < 3, 0.4, -0.3)
    frame["clicked"] = (rng.random(examples) < 1 / (1 + np.exp(-signal / np.sqrt(tables)))).astype(np.int8)
    data = root / "clicks.parquet"
    pd.DataFrame(frame).to_parquet(data)
    schema = {"label": "clicked", "task": "binary", "dim": dim,
              "features": {f"f{t}": {"type": "identity", "num_buckets": rows} for t in range(tables)}}  # fmt: skip
    (root / "schema.json").write_text(json.dumps(schema))
    return data, root / "schema.json"


def _train(data: Path, schema: Path, model_dir: Path, artifact: Path, epochs: int, args: argparse.Namespace) -> Any:
    cmd = [sys.executable, "-m", "embtables", "train", "--data", str(data), "--schema", str(schema),
           "--model-dir", str(model_dir), "--epochs", str(epochs), "--batch-size", str(args.batch),
           "--export-to", str(artifact), "--no-progress", "--threads", "1"]  # fmt: skip
    if epochs > 1:
        cmd += ["--save-every", str(args.save_every), "--incremental"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class _Clients:
    """``n`` threads sending ``body`` to ``/predict`` over keep-alive connections; each response's (time, step,
    latency) recorded."""

    def __init__(self, host: str, port: int, body: bytes, n: int) -> None:
        self.host, self.port, self.body = host, port, body
        self.records: list[tuple[float, int, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("POST", "/predict", self.body, headers)
                resp = conn.getresponse()
                doc = json.loads(resp.read())
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(str(exc))
                conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
                continue
            done = time.perf_counter()
            if resp.status != 200:
                self.failures.append(str(doc))
                continue
            self.records.append((time.time(), int(doc["step"]), done - start))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def take(self) -> list[tuple[float, int, float]]:
        out, self.records = self.records, []
        return out


def _latency(records: list[tuple[float, int, float]], seconds: float, phase: str) -> dict[str, Any]:
    lat = np.array([r[2] for r in records]) * 1e3
    return {
        "bench": "online", "phase": phase, "requests": len(records), "seconds": round(seconds, 2),
        "requests_per_s": round(len(records) / max(seconds, 1e-9), 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
    }  # fmt: skip


def _watch(model_dir: Path, seen: dict[int, float], stop: threading.Event) -> None:
    """The first time each ``ckpt-<step>`` of ``model_dir`` is seen (its publication: the save)."""
    while not stop.is_set():
        try:
            for p in model_dir.iterdir():
                if p.name.startswith("ckpt-") and p.name[5:].isdigit():
                    seen.setdefault(int(p.name[5:]), time.time())
        except OSError:
            pass
        time.sleep(0.01)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embtables bench online", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="buckets of each table (default 1,000,000)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--examples", type=int, default=200_000, help="rows of the training file")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--save-every", type=int, default=10, help="steps between saves (each a served update)")
    p.add_argument("--more-epochs", type=int, default=1, help="epochs trained while served")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--request-rows", type=int, default=16)
    p.add_argument("--idle-seconds", type=float, default=None, help="default 10 (--small: 3)")
    p.add_argument("--small", action="store_true", help="a smoke run: 4 x 20,000 x 16, 10,000 examples, batch 512")
    p.add_argument("--dir", default=None, help="where the data, model and artifact go (default: temporary)")
    p.add_argument("--out", default=None, help="also write the summary table here")
    args = p.parse_args(argv)
    check_table_out(p, args.out)
    if args.small:
        args.rows, args.tables, args.dim, args.examples, args.batch = 20_000, 4, 16, 10_000, 512
    if args.idle_seconds is None:
        args.idle_seconds = 3.0 if args.small else 10.0
    emit(env_record())
    root = Path(args.dir or tempfile.mkdtemp(prefix="embtables-bench-online-"))
    model_dir, artifact = root / "model", root / "served"
    server = None
    try:
        data, schema = _data(root, args.examples, args.tables, args.rows, args.dim)
        print(f"[online] {args.tables} x {args.rows:,} x {args.dim}, {args.examples:,} examples, batch {args.batch}: "
              "first epoch and whole export", file=sys.stderr, flush=True)  # fmt: skip
        start = time.perf_counter()
        first = _train(data, schema, model_dir, artifact, 1, args)
        log, _ = first.communicate()
        if first.returncode != 0:
            print(log[-3000:], file=sys.stderr)
            return 1
        emit(
            {"bench": "online", "phase": "first epoch + whole export", "seconds": round(time.perf_counter() - start, 2)}
        )
        cmd = [sys.executable, "-m", "embtables", "serve", str(artifact), "--port", "0", "--poll", "0.2"]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert server.stdout is not None
        line = server.stdout.readline()
        if " on http://" not in line:
            print(f"[online] the server did not start: {line}", file=sys.stderr)
            return 1
        host, port = line.split(" on http://")[1].split()[0].rsplit(":", 1)
        rng = np.random.default_rng(1)
        rows = {
            f"f{t}": [int(v) for v in (rng.zipf(1.1, args.request_rows) - 1) % args.rows] for t in range(args.tables)
        }
        body = json.dumps({"rows": rows}).encode()
        clients = _Clients(host, int(port), body, args.clients)
        print(f"[online] idle: {args.clients} clients for {args.idle_seconds:g} s", file=sys.stderr, flush=True)
        clients.start()
        time.sleep(1.0)  # connections made, first requests served
        clients.take()
        time.sleep(args.idle_seconds)
        idle = _latency(clients.take(), args.idle_seconds, "idle")
        emit(idle)
        print(f"[online] training {args.more_epochs} more epoch(s), saving and exporting every {args.save_every} steps",
              file=sys.stderr, flush=True)  # fmt: skip
        seen: dict[int, float] = {}
        stop_watch = threading.Event()
        watcher = threading.Thread(target=_watch, args=(model_dir, seen, stop_watch), daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        trainer = _train(data, schema, model_dir, artifact, 1 + args.more_epochs, args)
        log, _ = trainer.communicate()
        final = json.loads((artifact / "model.json").read_text())["step"]
        deadline = time.time() + 60
        while time.time() < deadline and not any(r[1] >= final for r in clients.records):
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        stop_watch.set()
        clients.stop()
        during = clients.take()
        last = _latency(during, seconds, "during updates")
        emit(last)
        steps = sorted(s for s in seen if s > min(seen, default=0))
        fresh = []
        for s in steps:
            hits = [t for t, step, _ in during if step >= s]
            if hits:
                fresh.append(min(hits) - seen[s])
        updates = len({r[1] for r in during})
        record = {
            "bench": "online", "phase": "freshness", "saves": len(steps), "steps_served": updates,
            "freshness_median_s": round(float(np.median(fresh)), 2) if fresh else None,
            "freshness_max_s": round(float(np.max(fresh)), 2) if fresh else None, "final_step": final,
            "failures": len(clients.failures), "trainer_rc": trainer.returncode,
        }  # fmt: skip
        emit(record)
        table = (
            "| phase | requests/s | p50 ms | p99 ms |\n| --- | --- | --- | --- |\n"
            f"| idle | {idle['requests_per_s']} | {idle['p50_ms']} | {idle['p99_ms']} |\n"
            f"| during updates | {last['requests_per_s']} | {last['p50_ms']} | {last['p99_ms']} |\n\n"
            f"freshness (save -> first response at that step): median {record['freshness_median_s']} s, "
            f"max {record['freshness_max_s']} s over {len(fresh)} saves; {args.tables} x {args.rows:,} x {args.dim}, "
            f"{args.clients} clients x {args.request_rows} rows"
        )
        emit_table(table, args.out)
        return 0 if trainer.returncode == 0 and not clients.failures else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
