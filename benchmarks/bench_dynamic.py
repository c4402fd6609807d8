"""Dynamic vocabularies (issue 18): what a step costs when tables are keyed by any 64-bit id.

The standard workload (8 tables of 1M x 64, batch 4096, 20 Zipf ids per bag, Adagrad) in one process:

* ``fixed``: embtables with ids in [0, V) (the reference);
* ``dynamic``: the same ids scrambled over the whole int64 range (a bijection per table), looked up in
  dynamic tables of the same capacity (admit at first sight, LRU): after the first batches every key
  has a row, the steady state of a table large enough for its keys;
* ``dynamic-evicting``: the same keys in tables of 1/25 of the capacity (40k rows at 1M): more rows than a
  batch's distinct keys (about 26k per table), fewer than the 4 batches' (about 77k), so every step evicts;
* ``fbgemm``: FBGEMM's TBE on the fixed ids, and ``torchrec-mch``: TorchRec's managed-collision remap
  (``MCHManagedCollisionModule``, LRU, evicting every step) of the same keys alone, without the
  embedding step; ``torchrec-mch + fbgemm`` adds the two, what a TorchRec user pays per step.

    python -m embtables bench dynamic                       # JSON lines on stdout, a table on stderr
    python -m embtables bench dynamic --rows 100000 --steps 10

Each measurement is a ``train_step`` JSON line as ``embtables bench`` prints them; then one
``dynamic_summary`` line with every median and the ratios to ``fixed``, and, per dynamic variant, its
vocabulary statistics after the run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import (
    OPTIMIZERS,
    Factory,
    Impl,
    OptimizerSpec,
    Skip,
    bench_impl,
    check_table_out,
    emit,
    emit_table,
    env_record,
)
from benchmarks.impl_embtables import make_optimizer
from benchmarks.peers import IMPLS
from benchmarks.workload import Batch, Workload, activation_grad, make_batches, variation

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection of the 64-bit integers


def scrambled(ids: np.ndarray, table: int) -> np.ndarray:
    """Ids [N] in [0, V) as keys spread over the whole int64 range (one bijection per table)."""
    with np.errstate(over="ignore"):
        z = (ids.astype(np.uint64) + np.uint64(table * 0x1000003)) * _MULT
    return z.view(np.int64)


_STATS: dict[str, dict[str, Any]] = {}  # per impl, the vocabulary statistics after its run


def _embtables(kind: str) -> Factory:
    def factory(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
        if mode != "train":
            raise Skip("a training benchmark")
        policy = None if kind == "fixed" else et.DynamicVocabulary(admit_after=1, eviction="lru")
        capacity = max(1, wl.rows // 25) if kind == "dynamic-evicting" else wl.rows
        tables = [
            et.TableConfig(
                capacity, wl.dim, initializer=et.Constant(0.01), combiner="sum", name=f"t{t}", dynamic=policy
            )
            for t in range(wl.tables)
        ]
        emb = et.DistributedEmbedding(
            {f"f{t}": et.FeatureConfig(tables[t]) for t in range(wl.tables)}, make_optimizer(opt)
        )
        lengths = torch.full((wl.batch,), wl.pooling, dtype=torch.int64)
        keys = (lambda ids, t: ids) if kind == "fixed" else scrambled
        inputs = [
            {f"f{t}": et.Ragged.from_lengths(torch.from_numpy(keys(b.ids[t], t)), lengths) for t in range(wl.tables)}
            for b in batches
        ]
        grads = [g.contiguous() for g in torch.from_numpy(activation_grad(wl)).split(wl.dim, dim=1)]

        def step(i: int) -> None:
            acts = emb(inputs[i % len(inputs)])
            loss: Any = sum((acts[f"f{t}"] * grads[t]).sum() for t in range(wl.tables))
            loss.backward()
            emb.apply_gradients()
            if policy is not None:
                stats = emb.vocabulary_statistics().values()
                _STATS[kind] = {k: sum(s[k] for s in stats) for k in ("admitted", "evicted", "rejected", "live")}

        return Impl(kind, opt.name, step, slot_bytes_per_row=wl.dim * 4, notes=f"capacity {capacity} per table")

    return factory


def _torchrec_mch(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.mc_modules import (
            LRU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as exc:
        raise Skip(f"torchrec is not installed ({exc}); bash scripts/install_bench_peers.sh") from None
    cpu = torch.device("cpu")
    names = [f"f{t}" for t in range(wl.tables)]
    configs = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=wl.dim, num_embeddings=wl.rows, feature_names=[names[t]])
        for t in range(wl.tables)
    ]
    modules = {
        f"t{t}": MCHManagedCollisionModule(
            zch_size=wl.rows,
            device=cpu,
            eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=1,
            input_hash_size=(1 << 63) - 1,
        )
        for t in range(wl.tables)
    }
    mcc = ManagedCollisionCollection(modules, configs).train()
    lengths = torch.full((wl.batch * wl.tables,), wl.pooling, dtype=torch.int64)
    kjts = [
        KeyedJaggedTensor.from_lengths_sync(
            names, torch.cat([torch.from_numpy(scrambled(b.ids[t], t)) for t in range(wl.tables)]), lengths
        )
        for b in batches
    ]

    @torch.no_grad()
    def step(i: int) -> None:
        mcc(kjts[i % len(kjts)])

    return Impl("torchrec-mch", "remap only", step, notes="MCHManagedCollisionModule, LRU, eviction_interval=1")


FACTORIES: dict[str, Factory] = {
    "fixed": _embtables("fixed"),
    "dynamic": _embtables("dynamic"),
    "dynamic-evicting": _embtables("dynamic-evicting"),
    "fbgemm": IMPLS["fbgemm"],
    "torchrec-mch": _torchrec_mch,
}


def summary_table(s: dict[str, Any]) -> str:
    ms, lines = s["median_ms"], ["| impl | ms per step | / fixed |", "| --- | --- | --- |"]
    for name, v in ms.items():
        ratio = s["ratio_to_fixed"].get(name)
        lines.append(f"| {name} | {v:.1f} | {'—' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embtables bench dynamic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--impls", default=",".join(FACTORIES), help=f"comma list of {', '.join(FACTORIES)}")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--ids", default="zipf", choices=["uniform", "zipf"])
    ap.add_argument("--optimizer", default="adagrad", choices=sorted(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=6, help="at least --num-batches, so every key was seen")
    ap.add_argument("--out", help="also write the Markdown table here")
    args = ap.parse_args(argv)
    check_table_out(ap, args.out)
    emit(env_record())
    wl = variation("standard", ids=args.ids, rows=args.rows, batch=args.batch, name="dynamic")
    batches = make_batches(wl)
    medians: dict[str, float] = {}
    for name in [n for n in args.impls.split(",") if n]:
        if name not in FACTORIES:
            raise SystemExit(f"unknown impl {name!r} (known: {', '.join(FACTORIES)})")
        rec = bench_impl(
            name, FACTORIES[name], wl, batches, OPTIMIZERS[args.optimizer], "train", args.warmup, args.steps
        )
        if rec is not None:
            medians[name] = float(rec["median_ms"])
        gc.collect()
    if "torchrec-mch" in medians and "fbgemm" in medians:
        medians["torchrec-mch + fbgemm"] = medians["torchrec-mch"] + medians["fbgemm"]
    fixed = medians.get("fixed")
    summary = {
        "bench": "dynamic_summary",
        "tables": wl.tables, "rows": wl.rows, "dim": wl.dim, "batch": wl.batch, "pooling": wl.pooling,
        "ids": wl.ids, "optimizer": args.optimizer, "threads": torch.get_num_threads(),
        "median_ms": medians,
        "ratio_to_fixed": {k: round(v / fixed, 3) for k, v in medians.items() if fixed and k != "fixed"},
        "vocabulary": _STATS,
    }  # fmt: skip
    emit(summary)
    emit_table(summary_table(summary), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
