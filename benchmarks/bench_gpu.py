"""The engine on a CUDA GPU against plain PyTorch, in one process, with the device's copy bandwidth.

    python -m embtables bench --device cuda                 # standard + large workloads, 4 optimizers
    python -m embtables bench gpu --workloads large-uniform --optimizers adagrad --steps 10

Impls: ``embtables`` (the fused Triton kernels), ``embtables-torch``
(the same module on the torch kernels, ``EMBTABLES_GPU_KERNELS=0``'s path) and ``torch``
(``nn.EmbeddingBag(mode="sum", sparse=True)`` per table + ``torch.optim`` Adagrad / SparseAdam / SGD; no
sparse FTRL in torch). Every step feeds the same ids: ``[B, L]`` per table, uniform or Zipf(1.05) over the
rows. Modes: ``forward`` (the lookup alone, no autograd) and ``train`` (lookup,
``(acts * grad).sum().backward()``, the sparse update).

Useful bytes (each input read once, each output written once): forward = ids + looked-up rows + the
activations; train = forward + the activation gradient + every distinct row's weights and slots read and
written. Printed as JSON lines (``env``, one per measurement) with GB/s and the fraction of the copy
bandwidth measured in the same run (``torch.clone`` of 2 GiB, bytes read + written).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit
from embtables.kernels import gpu

WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"tables": 3, "rows": 1000, "dim": 16, "batch": 64, "pool": 4, "ids": "zipf"},  # a smoke run
    "standard": {"tables": 8, "rows": 1_000_000, "dim": 64, "batch": 4096, "pool": 20, "ids": "zipf"},
    "large-uniform": {"tables": 32, "rows": 1_000_000, "dim": 64, "batch": 65536, "pool": 20, "ids": "uniform"},
    "large-zipf": {"tables": 32, "rows": 1_000_000, "dim": 64, "batch": 65536, "pool": 20, "ids": "zipf"},
}
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, elements: int) -> float:
    """Bytes read + written per second by a device-to-device copy of ``elements`` floats (median of 10)."""
    x = torch.empty(elements, dtype=torch.float32, device=device).uniform_()
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del x, y
    return 2 * 4 * elements / sorted(times)[len(times) // 2]


def warm_up(device: torch.device, seconds: float) -> None:
    """Keep the device busy for ``seconds`` (copies), so that the first timing does not run while its clocks
    ramp up (an idle H200 reads 405 MHz on its SMs)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            y.copy_(x)
        sync(device)
    del x, y


def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def make_ids(wl: dict[str, Any], device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)  # ids made on the device: no host copy
    shape = (wl["batch"], wl["pool"])
    if wl["ids"] == "uniform":
        return [torch.randint(0, wl["rows"], shape, device=device, generator=gen) for _ in range(wl["tables"])]
    ranks = torch.arange(1, wl["rows"] + 1, device=device, dtype=torch.float64)
    cdf = torch.cumsum(ranks**-1.05, 0)
    cdf /= cdf[-1].clone()
    out = []
    for t in range(wl["tables"]):
        u = torch.rand(shape, device=device, generator=gen, dtype=torch.float64)
        ranked = torch.searchsorted(cdf, u).clamp_(max=wl["rows"] - 1)
        out.append((ranked * 2654435761 + 97 * t) % wl["rows"])  # hot ranks spread over the table
    return out


HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def storage(spec: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``--dtypes`` entry -> (rows' dtype, slots' dtype): float32, bfloat16, float16, or either half type
    with ``+slots`` (its slots too)."""
    name, _, slots = spec.partition("+")
    if name not in ("float32", *HALF) or slots not in ("", "slots") or (name == "float32" and slots):
        raise ValueError(f"--dtypes: {spec!r} is not float32, bfloat16, float16, bfloat16+slots or float16+slots")
    rows = HALF.get(name)
    return rows, rows if slots else None


def useful_bytes(
    wl: dict[str, Any], ids: list[torch.Tensor], slots: int, mode: str, row_bytes: int = 4, slot_bytes: int = 4
) -> int:
    n = sum(i.numel() for i in ids)
    acts = wl["batch"] * wl["tables"] * wl["dim"] * 4
    forward = n * 8 + n * wl["dim"] * row_bytes + acts
    if mode == "forward":
        return forward
    distinct = sum(int(torch.unique(i).numel()) for i in ids)
    return forward + acts + distinct * wl["dim"] * 2 * (row_bytes + slots * slot_bytes)


def embtables_step(
    wl: dict[str, Any], opt: str, ids: list[torch.Tensor], mode: str, device: torch.device, dtypes: str = "float32"
) -> Callable[[], None]:
    optimizer = {
        "adagrad": lambda: et.Adagrad(0.1, initial_accumulator_value=0.1),
        "adam": lambda: et.Adam(0.001),
        "sgd": lambda: et.SGD(0.1),
        "ftrl": lambda: et.FTRL(0.1, initial_accumulator_value=0.1),
    }[opt]()
    rows, slots = storage(dtypes)
    tables = [
        et.TableConfig(
            wl["rows"],
            wl["dim"],
            initializer=et.Constant(0.01),
            combiner="sum",
            name=f"t{t}",
            dtype=rows,
            slot_dtype=slots,
        )
        for t in range(wl["tables"])
    ]
    emb = et.DistributedEmbedding(
        {f"f{t}": et.FeatureConfig(table) for t, table in enumerate(tables)},
        optimizer,
        device=device,
        concat_activations=True,
    )
    b, pool = wl["batch"], wl["pool"]
    splits = torch.arange(0, b * pool + 1, pool, device=device)
    feats = {f"f{t}": et.Ragged(i.reshape(-1), splits) for t, i in enumerate(ids)}  # B bags of L ids
    grad = torch.full((wl["batch"], wl["tables"] * wl["dim"]), 1e-3, device=device)
    if mode == "forward":
        emb.eval()

        def forward() -> None:
            with torch.no_grad():
                emb(feats)

        return forward

    def train() -> None:
        acts = emb(feats)
        (acts * grad).sum().backward()
        emb.apply_gradients()

    return train


def torch_step(
    wl: dict[str, Any], opt: str, ids: list[torch.Tensor], mode: str, device: torch.device
) -> Callable[[], None]:
    if opt == "ftrl":
        raise LookupError("torch has no sparse FTRL")
    bags = torch.nn.ModuleList(
        torch.nn.EmbeddingBag(wl["rows"], wl["dim"], mode="sum", sparse=True) for _ in range(wl["tables"])
    ).to(device)
    for b in bags:
        torch.nn.init.constant_(b.weight, 0.01)
    params = list(bags.parameters())
    optim = {
        "adagrad": lambda: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1),
        "adam": lambda: torch.optim.SparseAdam(params, lr=0.001),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
    }[opt]()
    grad = torch.full((wl["batch"], wl["tables"] * wl["dim"]), 1e-3, device=device)
    if mode == "forward":

        def forward() -> None:
            with torch.no_grad():
                torch.cat([b(i) for b, i in zip(bags, ids)], dim=1)

        return forward

    def train() -> None:
        optim.zero_grad(set_to_none=True)
        acts = torch.cat([b(i) for b, i in zip(bags, ids)], dim=1)
        (acts * grad).sum().backward()
        optim.step()

    return train


def time_step(step: Callable[[], None], steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def profile(step: Callable[[], None], title: str) -> None:
    """Two steps under torch.profiler: the top operators by device time and by host time, on stderr."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"## profile: {title} (2 steps)", file=sys.stderr)
    print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48), file=sys.stderr)
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48), file=sys.stderr)


def host_profile(step: Callable[[], None], title: str, steps: int = 20) -> None:
    """``steps`` steps under cProfile (the host's Python time, the device synchronized once at the end): the
    top functions by own time and by cumulative time, on stderr."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    print(f"## host profile: {title} ({steps} steps)", file=sys.stderr)
    print(out.getvalue(), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embtables bench --device cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--workloads", default="standard,large-uniform,large-zipf")
    p.add_argument("--optimizers", default="adagrad,adam,sgd,ftrl")
    p.add_argument("--impls", default="embtables,embtables-torch,torch")
    p.add_argument("--modes", default="forward,train")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warm-seconds", type=float, default=3.0, help="busy the GPU this long before timing")
    p.add_argument("--tiles", default="", help="also time the fused kernels with these FLOATSxUNROLL[xWARPS] tiles")
    p.add_argument("--lookups", default="", help="also time the lookup with these FLOATSxWARPS[xBLOCK_N] shapes")
    p.add_argument("--knobs", default="",
                   help="also time the fused kernels with these kernels/gpu.py settings, e.g. _ALIGN_HINTS=0 "
                   "(variants separated by commas, settings of one variant by +)")  # fmt: skip
    p.add_argument("--dtypes", default="float32",
                   help="also time the fused kernels with half-precision tables: float32,bfloat16,bfloat16+slots,"
                   "float16,float16+slots (impls embtables[bfloat16] ...; bytes counted at their size)")  # fmt: skip
    p.add_argument("--immediate", action="store_true",
                   help="also time the fused kernels with each error raised in its call (EMBTABLES_GPU_ERRORS="
                   "immediate: one host sync a call) beside the default (raised at the next call: none)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table of each embtables step")
    p.add_argument("--host-profile", action="store_true", help="print cProfile's tables of 20 embtables steps")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("embtables bench --device cuda: no CUDA device on this machine", file=sys.stderr)
        return 2
    on_cuda = device.type == "cuda"
    if on_cuda:
        warm_up(device, args.warm_seconds)
    bandwidth = copy_bandwidth(device, (1 << 29) if on_cuda else (1 << 24))
    emit(
        {
            "env": True,
            "device": torch.cuda.get_device_properties(device).name if on_cuda else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": driver_version() if on_cuda else None,
            "copy_GBps": round(bandwidth / 1e9, 1),
            "gpu_kernels": gpu.usable(device),
        }
    )
    makers = {
        "embtables": embtables_step,
        "embtables-torch": embtables_step,
        "torch": torch_step,
    }
    # --tiles 2048x4,1024x2x2 / --lookups 4096x2,2048x1x16: the fused kernels once per variant, as impls
    # "embtables[tiles 2048x4]" ... (the default stays "embtables"); each sets knobs of kernels/gpu.py
    knobs = {
        "tiles": ("_TILE_FLOATS", "SUMS_UNROLL", "_TILE_WARPS"),
        "lookup": ("_LOOKUP_FLOATS", "_LOOKUP_WARPS", "_LOOKUP_BLOCK_N"),
    }
    defaults = {name: getattr(gpu, name) for names in knobs.values() for name in names}
    variants: dict[str, dict[str, int]] = {}
    for kind, specs in (("tiles", args.tiles), ("lookup", args.lookups)):
        for spec in filter(None, specs.split(",")):
            values = [int(v) for v in spec.split("x")]
            variants[f"embtables[{kind} {spec}]"] = dict(zip(knobs[kind], values))
    for spec in filter(None, args.knobs.split(",")):
        settings = dict(item.split("=", 1) for item in spec.split("+"))
        for name in settings:
            if name not in defaults:
                defaults[name] = getattr(gpu, name)  # AttributeError: no such knob
        variants[f"embtables[{spec}]"] = {name: int(value) for name, value in settings.items()}
    if args.immediate:
        variants["embtables[immediate]"] = {}
    dtype_of: dict[str, str] = {}
    for spec in filter(None, args.dtypes.split(",")):
        storage(spec)  # refused here, before anything runs
        if spec != "float32":
            dtype_of[f"embtables[{spec}]"] = spec
            variants[f"embtables[{spec}]"] = {}
    impls = args.impls.split(",")
    if "embtables" in impls:
        at = impls.index("embtables") + 1
        impls[at:at] = list(variants)
    for wname in args.workloads.split(","):
        wl = WORKLOADS[wname]
        ids = make_ids(wl, device, seed=0)
        for opt in args.optimizers.split(","):
            for mode in args.modes.split(","):
                base = None
                for impl in impls:
                    gpu.set_enabled(impl != "embtables-torch")
                    gpu.set_deferred_errors(impl != "embtables[immediate]")
                    for name, value in {**defaults, **variants.get(impl, {})}.items():
                        setattr(gpu, name, value)  # read at each launch
                    spec = dtype_of.get(impl, "float32")
                    rows, slots = storage(spec)
                    nbytes = useful_bytes(wl, ids, SLOTS[opt], mode, 2 if rows else 4, 2 if slots else 4)
                    try:
                        maker = makers[impl.split("[")[0]]
                        step = maker(wl, opt, ids, mode, device, spec) if spec != "float32" else maker(
                            wl, opt, ids, mode, device)  # fmt: skip
                    except LookupError as exc:
                        emit({"skipped": impl, "workload": wname, "optimizer": opt, "mode": mode, "why": str(exc)})
                        continue
                    seconds = time_step(step, args.steps, args.warmup, device)
                    if args.profile and impl == "embtables":
                        profile(step, f"{wname} {opt} {mode}")
                    if args.host_profile and impl == "embtables":
                        host_profile(step, f"{wname} {opt} {mode}")
                    del step
                    gc.collect()  # the module's tables (GBs) go now, not when a cycle collector gets to them
                    if on_cuda:
                        torch.cuda.empty_cache()
                    rec = {
                        "impl": impl,
                        "workload": wname,
                        "optimizer": opt,
                        "mode": mode,
                        "ms": round(seconds * 1e3, 3),
                        "useful_GBps": round(nbytes / seconds / 1e9, 1),
                        "of_copy_bw": float(f"{nbytes / seconds / bandwidth:.3g}"),  # 3 significant digits, never 0
                    }
                    if impl == "embtables":
                        base = seconds
                    elif base is not None:
                        rec["embtables_speedup"] = round(seconds / base, 2)
                    emit(rec)
                    print(
                        f"{wname:14s} {opt:8s} {mode:8s} {impl:16s} {rec['ms']:9.3f} ms  "
                        f"{rec['of_copy_bw']:.1%} of copy bw",
                        file=sys.stderr,
                        flush=True,
                    )
    gpu.set_enabled(True)
    for name, value in defaults.items():
        setattr(gpu, name, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
