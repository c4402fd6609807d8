"""The seven TPUEstimator-era optimizers: one training step (lookup + fused update) on the native
kernels, on the pure-torch kernels, and plain PyTorch (``nn.EmbeddingBag`` + the ``torch.optim``
class with the same rule, dense gradients: those optimizers take no sparse gradients), same run.

    python3 benchmarks/bench_extra_optimizers.py [--rows 200000] [--dim 64] [--batch 4096] [--steps 10]

JSON lines on stdout. Workload: 4 tables of --rows x --dim, batch --batch, 20 Zipf ids per sample, sum.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embtables as et
from benchmarks._harness import emit, env_record, summarize, time_steps
from embtables.kernels import native

OPTIMIZERS: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.optim.Optimizer] | None]] = {
    "ProximalAdagrad": (lambda: et.ProximalAdagrad(0.1, l1_regularization_strength=1e-4), None),
    "Momentum": (lambda: et.Momentum(0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "RMSProp": (lambda: et.RMSProp(0.01, momentum=0.9), lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9)),
    "CenteredRMSProp": (
        lambda: et.CenteredRMSProp(0.01, momentum=0.9),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
    ),
    "Adadelta": (lambda: et.Adadelta(1.0), lambda p: torch.optim.Adadelta(p, lr=1.0)),
    "ProximalYogi": (lambda: et.ProximalYogi(0.01), None),
    "FrequencyEstimator": (lambda: et.FrequencyEstimator(lambda: 5.0), None),
}


def zipf_ids(rows: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    ids = rng.zipf(1.05, n) - 1
    return torch.from_numpy(np.where(ids < rows, ids, rng.integers(0, rows, n)).astype(np.int64))


def timed(step: Callable[[int], None], steps: int, desc: str) -> dict[str, float]:
    """The harness's summary (median, p90, min) of ``steps`` steps after one warm-up (and the native build)."""
    return summarize(time_steps(step, 1, steps, desc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    per = 20
    batches = [[zipf_ids(args.rows, args.batch * per, rng) for _ in range(args.tables)] for _ in range(4)]
    offsets = torch.arange(0, args.batch * per + 1, per)
    shape = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "tables": args.tables, "ids_per_sample": per}
    emit({**env_record(), **shape})
    for name in args.optimizers.split(","):
        make, torch_opt = OPTIMIZERS[name]
        for path in ("native", "torch-path"):
            native.set_enabled(path == "native")
            tables = [et.TableConfig(args.rows, args.dim, name=f"t{i}", combiner="sum") for i in range(args.tables)]
            emb = et.DistributedEmbedding({f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}, make())

            def step(i: int, emb: Any = emb) -> None:
                ids = batches[i % len(batches)]
                feats = {f"f{t}": et.Ragged(ids[t], offsets) for t in range(args.tables)}
                out = emb(feats)
                emb.apply_gradients({k: torch.full_like(v, 1e-3) for k, v in out.items()})

            summary = timed(step, args.steps, f"{name} embtables-{path}")
            emit(
                {
                    "bench": "train_step",
                    "optimizer": name,
                    "impl": f"embtables-{path}",
                    "ms": summary["median_ms"],
                    **summary,
                }
            )
            del emb
        native.set_enabled(True)
        if torch_opt is not None:
            bags = [torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum") for _ in range(args.tables)]
            opt = torch_opt([b.weight for b in bags])

            def torch_step(i: int, bags: Any = bags, opt: Any = opt) -> None:
                ids = batches[i % len(batches)]
                loss = sum((b(ids[t], offsets[:-1]) * 1e-3).sum() for t, b in enumerate(bags))
                opt.zero_grad()
                loss.backward()  # type: ignore[union-attr]
                opt.step()

            summary = timed(torch_step, args.steps, f"{name} torch.optim")
            emit(
                {
                    "bench": "train_step",
                    "optimizer": name,
                    "impl": "torch.optim (dense)",
                    "ms": summary["median_ms"],
                    **summary,
                }
            )
            del bags, opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
