"""Sharded training on this machine: W = 1 vs W = 2 at the same global batch, bytes exchanged, the
pipelined overlap, and TorchRec ``DistributedModelParallel`` as the peer. JSON lines on stdout.

    python -m benchmarks.bench_sharded            # the standard workload (8 x 1M x 64, B 4096, L 20)
    python -m benchmarks.bench_sharded --quick    # a small one (smoke)

Configurations (each in fresh processes, the global batch split evenly over the ranks):

- ``embtables`` W=1: one process with 2 threads (the single-process engine);
- ``embtables`` W=2: two processes with 1 thread each in a gloo group on localhost (per-step exchanges
  through shared memory, ``sharding/shm_channel.py``), ``sharding`` div, table and mod;
- the pipelined pairs: W=2 div with a dense stand-in as long as the W=2 div embedding step between the
  lookup and ``apply_gradients``, synchronous vs ``pipeline_execution_with_tensor_core`` with the next
  batch enqueued before the dense compute, so its lookup (and the previous update) can overlap it. The
  stand-in runs on a "device" (a sleep: the CPU is left to the embedding, as with a dense model on a GPU
  or a TPU's TensorCore; the exchange thread asked for with ``EMBTABLES_PIPELINE_THREAD=background``) or on
  the CPU (the same count of matmuls in every run, on the rank's one thread, competing with the embedding),
  pipelined where the module chooses (in place: no core is left over) and on the exchange thread; every
  case in ``--rounds`` interleaved rounds, the dense part's own time per rank reported beside the step;
- ``torchrec-dmp`` W=2: TorchRec's ``DistributedModelParallel`` (Adagrad fused into the backward,
  planned by its ``EmbeddingShardingPlanner``), table-wise; row-wise is reported as unavailable when
  TorchRec's planner offers no row-wise sharding on CPU.

Timing, summaries, the ``env`` line, ``other_cpus`` and ``--wait-idle`` come from the one benchmark
harness (``benchmarks/_harness.py``). Every line carries ``step_ms``, the median step time of the
slowest rank (``slowest_rank``: its median/p90/min), and for embtables the bytes each rank sent to the
others per step (ids, rows, gradient sums).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from benchmarks._harness import (
    OtherLoad,
    env_record,
    keep_freed_memory,
    summarize,
    time_steps,
    wait_for_idle,
    workload_fields,
)
from benchmarks._harness import emit as harness_emit
from benchmarks.workload import Workload, activation_grad, make_batches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dense_reps(batch: int, ms: float) -> int:
    """How many [batch, 256] x [256, 256] products (each through a tanh) take about ``ms`` milliseconds on one
    thread here: measured once, in the parent, so every run of a comparison computes the same dense part."""
    torch.set_num_threads(1)
    a, w = torch.randn(batch, 256), torch.randn(256, 256)
    torch.tanh(torch.mm(a, w))
    t0 = time.perf_counter()
    for _ in range(10):
        torch.tanh(torch.mm(a, w))
    return max(1, round(ms / 1e3 / ((time.perf_counter() - t0) / 10)))


def _dense_standin(batch: int, ms: float, where: str = "cpu", reps: int = 0) -> Any:
    """The dense model's stand-in, about ``ms`` milliseconds: on the CPU, ``reps`` matmuls (``_dense_reps``)
    on the rank's one thread; on a "device" (a GPU or a TPU's TensorCore computing while the host runs the
    embedding), a sleep that leaves the CPU to the embedding work."""
    if where == "device":
        return lambda: time.sleep(ms / 1e3)
    a = torch.randn(batch, 256)
    w = torch.randn(256, 256)
    reps = reps or _dense_reps(batch, ms)

    def run() -> None:
        x = a
        for _ in range(reps):
            x = torch.tanh(torch.mm(x, w))

    return run


def _join(rank: int, world: int, spec: dict[str, Any]) -> None:
    """Set this rank's threads (and glibc's freed-memory policy, every impl alike) and join the gloo group
    on localhost (nothing to join when W = 1)."""
    torch.set_num_threads(spec["threads"])
    if spec.get("malloc", "keep") == "keep":
        keep_freed_memory()
    if world > 1:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )


def _embtables_rank(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    os.environ.update(spec.get("env", {}))  # before the module is built (the fork server's environment is older)
    import embtables as et
    from embtables.sharding import comm
    from embtables.tables import phase_profile

    _join(rank, world, spec)
    wl = Workload(**spec["workload"])
    local = wl.batch // world
    batches = make_batches(wl)
    grad_full = torch.from_numpy(activation_grad(wl))  # [B, T * D]
    opt = et.Adagrad(0.1, initial_accumulator_value=0.1)
    cfg = {
        f"f{t}": et.FeatureConfig(
            et.TableConfig(wl.rows, wl.dim, name=f"t{t}", combiner="sum", optimizer=opt, initializer=et.Constant(0.01))
        )
        for t in range(wl.tables)
    }
    pipelined = spec.get("pipelined", False)
    emb = et.DistributedEmbedding(cfg, sharding=spec["sharding"], pipeline_execution_with_tensor_core=pipelined)
    inputs = []
    for b in batches:
        lo, hi = rank * local * wl.pooling, (rank + 1) * local * wl.pooling
        lengths = torch.full((local,), wl.pooling, dtype=torch.int64)
        feats = {
            f"f{t}": et.Ragged.from_lengths(torch.from_numpy(np.ascontiguousarray(b.ids[t][lo:hi])), lengths)
            for t in range(wl.tables)
        }
        inputs.append(feats)
    rows = slice(rank * local, (rank + 1) * local)
    grad = {f"f{t}": grad_full[rows, t * wl.dim : (t + 1) * wl.dim].contiguous() for t in range(wl.tables)}
    dense = None
    if spec.get("dense_ms"):
        dense = _dense_standin(local, spec["dense_ms"], spec.get("dense_on", "cpu"), spec.get("dense_reps", 0))
    nb = len(inputs)
    steps = spec["warmup"] + spec["steps"]
    dense_s: list[float] = []  # each step's dense part as the rank measured it (longer when the CPU is shared)
    if rank != 0:
        os.environ["BENCH_PROGRESS"] = "0"  # one progress bar, rank 0's
    if pipelined:
        emb.enqueue(inputs[0])

    def step(i: int) -> None:
        if pipelined:
            emb.dequeue()
            if i + 1 < steps:
                emb.enqueue(inputs[(i + 1) % nb])  # its exchange overlaps the dense compute below
        else:
            emb(inputs[i % nb])
        if dense is not None:
            t0 = time.perf_counter()
            dense()
            dense_s.append(time.perf_counter() - t0)
        emb.apply_gradients(grad)

    time_steps(step, spec["warmup"], 0, f"W={world} warmup")
    comm.barrier()
    comm.bytes_sent.clear()
    comm.phase_checks = 0
    # per-phase times (exclusive of nested phases), bytes and messages; off where a dense part is compared
    phase_profile.enable(not pipelined and not dense)
    with OtherLoad() as load:
        timed = time_steps(lambda i: step(spec["warmup"] + i), 0, spec["steps"], f"W={world} {spec['sharding']}")
    phases = phase_profile.snapshot(spec["steps"])
    phase_profile.enable(False)
    emb.local_shards()  # pipelined: the last update lands (the exchange thread is idle) before the bench's own messages
    sent = sum(comm.bytes_sent.values()) / spec["steps"]
    headers = comm.phase_checks / spec["steps"]
    # The phase headers' cost (issue 15): the same header exchanged back to back, median of 5 x 100.
    header_s = 0.0
    if world > 1:
        per_call = []
        for _ in range(5):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(100):
                comm.check_phase("lookup", 0, 0)
            per_call.append((time.perf_counter() - t0) / 100)
        header_s = statistics.median(per_call)
    if dense_s:
        phases = {"dense part": {"ms": round(statistics.median(dense_s[spec["warmup"] :]) * 1e3, 3)}}
    everyone = comm.all_gather_object((summarize(timed), sent, load.other_cpus, phases))
    if rank == 0:
        slowest = max((summary for summary, _, _, _ in everyone), key=lambda x: x["median_ms"])
        step_s = slowest["median_ms"] / 1e3
        Path(out).write_text(
            json.dumps({"step_s": step_s, "slowest_rank": slowest, "bytes": [b for _, b, _, _ in everyone],
                        "other_cpus": max(o for _, _, o, _ in everyone), "phases": [p for *_, p in everyone],
                        "headers_per_step": headers,
                        "header_us": header_s * 1e6, "phase_check_share": headers * header_s / step_s})
        )  # fmt: skip
    if world > 1:
        torch.distributed.destroy_process_group()


def _torchrec_rank(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    _join(rank, world, spec)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    wl = Workload(**spec["workload"])
    local = wl.batch // world
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=wl.dim, num_embeddings=wl.rows, feature_names=[f"f{t}"], pooling=PoolingType.SUM
        )
        for t in range(wl.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1, "eps": 0.0})
    constraints = {f"t{t}": ParameterConstraints(sharding_types=[spec["torchrec_sharding"]]) for t in range(wl.tables)}
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    error = None
    try:
        plan = planner.collective_plan(ebc, sharders, torch.distributed.GroupMember.WORLD)
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    if error is not None:
        if rank == 0:
            Path(out).write_text(json.dumps({"skip": error}))
        torch.distributed.destroy_process_group()
        return
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders)
    keys = [f"f{t}" for t in range(wl.tables)]
    lengths = torch.full((wl.tables * local,), wl.pooling, dtype=torch.int64)
    kjts = []
    for b in make_batches(wl):
        lo, hi = rank * local * wl.pooling, (rank + 1) * local * wl.pooling
        values = torch.from_numpy(np.concatenate([b.ids[t][lo:hi] for t in range(wl.tables)]))
        kjts.append(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths))
    grad = torch.from_numpy(activation_grad(wl))[rank * local : (rank + 1) * local]
    if rank != 0:
        os.environ["BENCH_PROGRESS"] = "0"

    def step(i: int) -> None:
        kt = dmp(kjts[i % len(kjts)])
        kt = kt.wait() if hasattr(kt, "wait") else kt
        (kt.values() * grad).sum().backward()

    with OtherLoad() as load:
        timed = time_steps(step, spec["warmup"], spec["steps"], f"torchrec W={world}")
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, (summarize(timed), load.other_cpus))
    if rank == 0:
        slowest = max((summary for summary, _ in everyone), key=lambda x: x["median_ms"])
        other = max(o for _, o in everyone)
        Path(out).write_text(
            json.dumps({"step_s": slowest["median_ms"] / 1e3, "slowest_rank": slowest, "other_cpus": other})
        )
    torch.distributed.destroy_process_group()


def _start_method() -> str:
    """The ranks come from a fork server that imported torch and embtables once: each configuration's
    processes start in milliseconds, not seconds of imports each (they are still fresh processes: the server
    imports and runs nothing else). "spawn" where the platform has no fork server."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    preload = ["torch", "torch.distributed", "numpy", "embtables"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        preload + ([__name__] if __name__ != "__main__" else [])
    )
    return "forkserver"


def _launch(fn: Any, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {**spec, "port": _free_port()}
        mp.start_processes(fn, args=(world, spec, out), nprocs=world, start_method=_start_method())
        return json.loads(Path(out).read_text())  # type: ignore[no-any-return]


def _torchrec_run(base: dict[str, Any], sharding: str) -> dict[str, Any]:
    """One TorchRec DMP run at W = 2 (``{"skip": why}`` when the peer is missing or refuses the plan)."""
    try:
        return _launch(_torchrec_rank, 2, {**base, "threads": 1, "torchrec_sharding": sharding})
    except Exception as exc:  # an uninstalled or broken peer is reported, not fatal
        return {"skip": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _median_round(got: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose step is the median (the lower middle one for an even count)."""
    ranked = sorted(got, key=lambda g: float(g["step_s"]))
    return ranked[(len(ranked) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small workload (2 x 100k x 32, B 1024)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ids", choices=("zipf", "uniform"), default="zipf")
    ap.add_argument("--no-torchrec", action="store_true")
    ap.add_argument("--w3", action="store_true", help="also W = 3 (div): three processes on this machine's cores")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of every configuration (each reports its median)"
    )
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S", help="wait up to S s for a quiet machine")
    ap.add_argument(
        "--malloc",
        default="keep",
        choices=["keep", "default"],
        help="keep: glibc keeps freed memory in every rank of every configuration (see _harness.keep_freed_memory)",
    )
    args = ap.parse_args(argv)
    wl = Workload(ids=args.ids)
    if args.quick:
        wl = wl.with_(tables=2, rows=100_000, dim=32, batch=1024, name="quick")
    base = {"workload": asdict(wl), "steps": args.steps, "warmup": args.warmup, "malloc": args.malloc}
    if args.malloc == "keep":
        keep_freed_memory()  # recorded in the env record (the ranks apply it themselves)

    if args.wait_idle:
        wait_for_idle(args.wait_idle)
    harness_emit(env_record())

    def emit(record: dict[str, Any]) -> None:
        harness_emit({"bench": "sharded", **workload_fields(wl), **record})

    results: dict[str, float] = {}
    runs = [
        ("embtables W=1 (1 proc x 2 threads)", 1, {"threads": 2, "sharding": "div"}),
        ("embtables W=2 div (2 procs x 1 thread)", 2, {"threads": 1, "sharding": "div"}),
        ("embtables W=2 table (2 procs x 1 thread)", 2, {"threads": 1, "sharding": "table"}),
        ("embtables W=2 mod (2 procs x 1 thread)", 2, {"threads": 1, "sharding": "mod"}),
    ]
    if args.w3:
        runs.append(("embtables W=3 div (3 procs x 1 thread, 2 cores)", 3, {"threads": 1, "sharding": "div"}))
    # Every configuration runs ``--rounds`` times, the rounds interleaved (this VM drifts by 20-30% over
    # minutes); each reports its median round, with every round's step beside it.
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
    peer_rounds: list[dict[str, Any]] = []
    for _ in range(max(1, args.rounds)):
        for label, world, extra in runs:
            rounds[label].append(_launch(_embtables_rank, world, {**base, **extra}))
        if not args.no_torchrec:
            peer_rounds.append(_torchrec_run(base, "table_wise"))
    for label, world, extra in runs:
        got = _median_round(rounds[label])
        results[label] = got["step_s"]
        emit(
            {
                "impl": "embtables",
                "config": label,
                "world": world,
                "sharding": extra["sharding"],
                "step_ms": round(got["step_s"] * 1e3, 2),
                "rounds_ms": [round(g["step_s"] * 1e3, 2) for g in rounds[label]],
                "slowest_rank": got["slowest_rank"],
                "other_cpus": round(got["other_cpus"], 3),
                "sent_mb_per_step_per_rank": [round(b / 2**20, 3) for b in got["bytes"]],
                "global_batch": wl.batch,
                "phase_headers_per_step": got["headers_per_step"],
                "phase_header_us": round(got["header_us"], 1),
                "phase_check_share_of_step": round(got["phase_check_share"], 5),
                "phases_per_rank": got["phases"],
            }
        )
    w1 = results[runs[0][0]]
    for label, _, _ in runs[1:]:
        emit({"impl": "embtables", "summary": f"{label} / W=1", "ratio": round(results[label] / w1, 3)})
    # Pipelining (issue 17, item 4; issue 58): a dense stand-in as long as the W = 2 div embedding step,
    # computed on a "device" (a sleep: it stands for a GPU, so the exchange thread is asked for) or on the
    # rank's one CPU core (the same products in every run: ``_dense_reps``), synchronous and pipelined; on the
    # CPU pipelined twice, where the module chooses (``auto``: in place, no core is left over) and on the
    # exchange thread. Interleaved rounds; each case's median round.
    emb_ms = results[runs[1][0]] * 1e3
    reps = _dense_reps(wl.batch // 2, emb_ms)
    cases = [
        ("device", False, "auto"), ("device", True, "background"),
        ("cpu", False, "auto"), ("cpu", True, "auto"), ("cpu", True, "background"),
    ]  # fmt: skip
    piped_rounds: dict[tuple[str, bool, str], list[dict[str, Any]]] = {c: [] for c in cases}
    for _ in range(max(1, args.rounds)):
        for dense_on, pipelined, thread in cases:
            spec = {**base, "threads": 1, "sharding": "div", "dense_ms": emb_ms, "pipelined": pipelined}
            extra = {"dense_on": dense_on, "dense_reps": reps, "env": {"EMBTABLES_PIPELINE_THREAD": thread}}
            piped_rounds[(dense_on, pipelined, thread)].append(_launch(_embtables_rank, 2, {**spec, **extra}))
    for (dense_on, pipelined, thread), got_rounds in piped_rounds.items():
        got = _median_round(got_rounds)
        results[f"dense {dense_on} pipelined={pipelined} {thread}"] = got["step_s"]
        emit(
            {
                "impl": "embtables",
                "config": f"W=2 div + dense stand-in on the {dense_on}",
                "dense_ms": round(emb_ms, 1),
                "dense_on": dense_on,
                "pipelined": pipelined,
                "pipeline_thread": thread,
                "step_ms": round(got["step_s"] * 1e3, 2),
                "rounds_ms": [round(g["step_s"] * 1e3, 2) for g in got_rounds],
                "dense_part_ms_per_rank": [p.get("dense part", {}).get("ms") for p in got["phases"]],
            }
        )
    for dense_on, pipelined, thread in cases:
        if not pipelined:
            continue
        sync = results[f"dense {dense_on} pipelined=False auto"]
        piped = results[f"dense {dense_on} pipelined=True {thread}"]
        what = f"dense on the {dense_on}, pipelined work {thread}"
        emit({"impl": "embtables", "summary": f"pipelining speed-up, {what}", "ratio": round(sync / piped, 3)})
        emit(
            {
                "impl": "embtables",
                "summary": f"pipelined step / longer part ({what})",
                "ratio": round(piped * 1e3 / emb_ms, 3),
            }
        )
    if not args.no_torchrec:
        for sharding in ("table_wise", "row_wise"):
            if sharding == "table_wise":
                skipped = [g for g in peer_rounds if "skip" in g]
                got = skipped[0] if skipped else _median_round(peer_rounds)
            else:
                got = _torchrec_run(base, sharding)
            if "skip" in got:
                emit({"impl": "torchrec-dmp", "sharding": sharding, "world": 2, "skip": got["skip"]})
                continue
            ours = results["embtables W=2 table (2 procs x 1 thread)" if sharding == "table_wise" else runs[1][0]]
            emit(
                {
                    "impl": "torchrec-dmp",
                    "sharding": sharding,
                    "world": 2,
                    "step_ms": round(got["step_s"] * 1e3, 2),
                    "rounds_ms": [round(g["step_s"] * 1e3, 2) for g in peer_rounds] if sharding == "table_wise" else [],
                    "slowest_rank": got["slowest_rank"],
                    "other_cpus": round(got["other_cpus"], 3),
                    "torchrec_over_embtables": round(got["step_s"] / ours, 3),
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
