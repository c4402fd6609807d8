"""Launches and host synchronisations of the GPU step, counted on the CPU (no GPU needed).

    python -m embtables bench gpu-launches                      # T = 8 and 64 tables
    python -m embtables bench gpu-launches --tables 8,26,64 --batch 128
    python -m embtables bench gpu-launches --device cuda        # on a GPU: the CUDA runtime calls, profiled

The fused GPU kernels run on CPU tensors through Triton's interpreter; ``benchmarks/launch_count.py`` counts
every Triton launch, every torch operation a CUDA step would launch, and every operation that would make the
host wait (see its docstring). One JSON line per (errors, tables, what): a steady-state training step (lookup,
backward, ``apply_gradients``; after two warm-up steps) and an eval lookup, with the step's errors raised at
the next call (``deferred``, the default on a GPU: no sync) and in the call (``immediate``: one sync a call).
Counts only: nothing is timed.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Sequence
from typing import Any

if not any(a == "--device" or a.startswith("--device=") for a in sys.argv):  # on a GPU the real kernels run
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import emit, emit_skip
from benchmarks.launch_count import LaunchCounter


def _module(tables: int, optimizer: str, device: str = "cpu") -> Any:
    import embtables as et

    opt = {"adagrad": lambda: et.Adagrad(0.1), "sgd": lambda: et.SGD(0.1), "adam": lambda: et.Adam(0.01)}[optimizer]()
    features = {
        f"f{t}": et.FeatureConfig(et.TableConfig(500, 16, name=f"t{t}", initializer=et.TruncatedNormal(seed=t)))
        for t in range(tables)
    }
    return et.DistributedEmbedding(features, opt, concat_activations=True, device=device)


def _batch(tables: int, batch: int, pooling: int, step: int) -> dict[str, Any]:
    import embtables as et

    g = torch.Generator().manual_seed(step)
    return {
        f"f{t}": et.Ragged.from_lists(torch.randint(0, 500, (batch, pooling), generator=g).tolist())
        for t in range(tables)
    }


def count(tables: int, batch: int, pooling: int, optimizer: str, errors: str = "deferred") -> list[dict[str, Any]]:
    """The counts of one steady-state training step and one eval lookup over ``tables`` tables, the step's
    errors raised at the next call (``errors="deferred"``, the default) or in the call (``"immediate"``)."""
    from embtables.kernels import gpu, native
    from embtables.kernels.triton_interpreter import mend

    mend()
    native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=True)
    gpu.set_deferred_errors(errors == "deferred")
    try:
        if not gpu.usable(torch.device("cpu")):
            raise RuntimeError("the GPU kernels need Triton (3.6 or later) and TRITON_INTERPRET=1")
        emb = _module(tables, optimizer)
        grad = torch.ones((batch, 16 * tables))
        inputs = [_batch(tables, batch, pooling, s) for s in range(3)]
        for s in range(2):  # warm-up: the first steps build what later steps reuse
            emb(inputs[s])
            emb.apply_gradients(grad)
        train = LaunchCounter()
        with train.counting():
            emb(inputs[2])
            emb.apply_gradients(grad)
        emb.eval()
        lookup = LaunchCounter()
        with lookup.counting(), torch.no_grad():
            emb(inputs[0])
    finally:
        native.set_enabled(True)
        gpu.set_enabled(True)
        gpu.set_deferred_errors(None)
    common = {"bench": "gpu_launches", "tables": tables, "batch": batch, "pooling": pooling, "optimizer": optimizer,
              "errors": errors}  # fmt: skip
    return [{**common, "what": "train_step", **train.record()}, {**common, "what": "eval_lookup", **lookup.record()}]


# CUDA runtime and driver calls, by what they do (``count_on_device``)
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
_COPY_CALLS = ("cudaMemcpyAsync", "cudaMemsetAsync")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
_WAIT_CALLS = ("cudaEventSynchronize",)  # the read of an earlier call's posted flags


def count_on_device(
    tables: int, batch: int, pooling: int, optimizer: str, errors: str = "deferred", device: str = "cuda"
) -> list[dict[str, Any]]:
    """The same step on real CUDA tables, counted from the CUDA runtime calls ``torch.profiler`` records:
    kernel launches (torch's and Triton's), asynchronous copies and sets, host synchronisations (stream or
    device synchronisation, a blocking ``cudaMemcpy``), and event waits (an earlier call's flags). On a
    machine without CUDA every count is 0."""
    from torch.profiler import ProfilerActivity, profile

    from embtables.kernels import gpu

    gpu.set_deferred_errors(errors == "deferred")
    try:
        emb = _module(tables, optimizer, device)
        grad = torch.ones((batch, 16 * tables), device=device)
        inputs = [_batch(tables, batch, pooling, s) for s in range(4)]
        for s in range(3):  # warm-up: compiled kernels, allocator pools
            emb(inputs[s])
            emb.apply_gradients(grad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        records = []
        for what in ("train_step", "eval_lookup"):
            if what == "eval_lookup":
                emb.eval()
            with profile(activities=activities) as prof:
                if what == "train_step":
                    emb(inputs[3])
                    emb.apply_gradients(grad)
                else:
                    with torch.no_grad():
                        emb(inputs[0])
            names = collections.Counter(e.name for e in prof.events())
            records.append({
                "bench": "gpu_launches_device", "device": device, "tables": tables, "batch": batch, "pooling": pooling,
                "optimizer": optimizer, "errors": errors, "what": what,
                "launches": sum(names[n] for n in _LAUNCH_CALLS), "copies": sum(names[n] for n in _COPY_CALLS),
                "syncs": sum(names[n] for n in _SYNC_CALLS), "event_waits": sum(names[n] for n in _WAIT_CALLS),
                "by_call": {n: names[n] for n in (*_LAUNCH_CALLS, *_COPY_CALLS, *_SYNC_CALLS, *_WAIT_CALLS)
                            if names[n]},
            })  # fmt: skip
        return records
    finally:
        gpu.set_deferred_errors(None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embtables bench gpu-launches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--tables", default="8,64", help="comma list of table counts")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pooling", type=int, default=2, help="ids per bag")
    ap.add_argument("--optimizer", default="adagrad", choices=["adagrad", "sgd", "adam"])
    ap.add_argument("--errors", default="deferred,immediate", help="comma list: deferred (raised at the next call, "
                    "the default on a GPU), immediate (EMBTABLES_GPU_ERRORS=immediate)")  # fmt: skip
    ap.add_argument("--device", default="", help="cuda: count the CUDA runtime calls of the step on a real GPU "
                    "(torch.profiler) instead of the interpreter's launches")  # fmt: skip
    args = ap.parse_args(argv)
    if args.device:
        for errors in args.errors.split(","):
            for tables in (int(t) for t in args.tables.split(",")):
                for record in count_on_device(tables, args.batch, args.pooling, args.optimizer, errors, args.device):
                    emit(record)
                    sys.stderr.write(
                        f"{args.device} {errors:9s} T={tables:3d} {record['what']:12s} launches {record['launches']:4d}"
                        f", copies {record['copies']}, syncs {record['syncs']}, event waits {record['event_waits']}\n"
                    )
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        emit_skip("gpu_launches", "embtables", "Triton is not installed")
        return 0
    for errors in args.errors.split(","):
        for tables in (int(t) for t in args.tables.split(",")):
            for record in count(tables, args.batch, args.pooling, args.optimizer, errors):
                emit(record)
                sys.stderr.write(
                    f"{errors:9s} T={tables:3d} {record['what']:12s} launches {record['launches']:4d} (Triton "
                    f"{record['triton_launches']}, torch {record['torch_launches']}), syncs {record['syncs']}\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
