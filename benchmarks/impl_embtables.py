"""embtables in the benchmark harness: the same factory contract as the peers (``benchmarks.peers``).

Impls:

* ``embtables``: ``DistributedEmbedding`` over ``wl.tables`` tables (combiner sum), the TPU optimizer
  (Adagrad lr 0.1 / accumulator 0.1, lazy Adam, SGD, FTRL), inputs as ``embtables.Ragged`` built before
  timing. A step is ``emb(features)``, ``(acts * grad).sum().backward()``, ``emb.apply_gradients()``.
  Lookup-only runs the module in eval mode under ``no_grad``.
* ``embtables-noacc``: the same with ``use_gradient_accumulation=False`` (occurrences applied one at a
  time in order, spec §10.2). No peer has this mode.
* ``embtables-concat``: the same with ``concat_activations=True``: one activation [B, tables x D] and one
  gradient back, as FBGEMM's TBE gives (the harness step is ``(acts * grad).sum().backward()`` on it).
* ``embtables-seq``: sequence features (``max_sequence_length = pooling``): activations ``[B, M, D]``,
  one row per position, no combining. No peer has this mode.
* ``embtables-bf16-slots-nearest``: ``embtables-bf16-slots`` rounding to nearest (the stochastic rounding's own cost).
* ``embtables-bf16`` / ``embtables-bf16-slots``: the tables' rows (and the slots) stored in bfloat16,
  stochastically rounded (``TableConfig(dtype=torch.bfloat16, slot_dtype=...)``, spec §12).

Imports only embtables' public names.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import embtables as et
from benchmarks._harness import Factory, Impl, OptimizerSpec, Skip
from benchmarks.workload import Batch, Workload, activation_grad


def make_optimizer(opt: OptimizerSpec, *, accumulate: bool = True) -> et.config.Optimizer:
    """The TPU optimizer for a benchmark optimizer spec."""
    if opt.name == "adagrad":
        return et.Adagrad(
            opt.lr, initial_accumulator_value=opt.initial_accumulator, use_gradient_accumulation=accumulate
        )
    if opt.name == "adam":
        return et.Adam(
            opt.lr, beta_1=opt.beta1, beta_2=opt.beta2, epsilon=opt.adam_eps, use_gradient_accumulation=accumulate
        )
    if opt.name == "sgd":
        return et.SGD(opt.lr, use_gradient_accumulation=accumulate)
    if opt.name == "ftrl":
        return et.FTRL(
            opt.lr,
            learning_rate_power=opt.lr_power,
            initial_accumulator_value=opt.initial_accumulator,
            use_gradient_accumulation=accumulate,
        )
    raise Skip(f"no embtables optimizer for {opt.name!r}")


def _factory(variant: str) -> Factory:
    def factory(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
        if variant != "plain" and mode == "lookup":
            raise Skip(f"embtables-{variant} is a training-mode variation")
        seq = variant == "seq"
        half = torch.bfloat16 if variant.startswith("bf16") else None
        slot_half = torch.bfloat16 if variant.startswith("bf16-slots") else None
        rounding = "nearest" if variant.endswith("-nearest") else "stochastic"
        tables = [
            et.TableConfig(
                wl.rows, wl.dim, initializer=et.Constant(0.01), combiner="sum", name=f"t{t}", dtype=half,
                slot_dtype=slot_half, rounding=rounding,
            )
            for t in range(wl.tables)
        ]  # fmt: skip
        features = {
            f"f{t}": et.FeatureConfig(tables[t], max_sequence_length=wl.pooling if seq else 0) for t in range(wl.tables)
        }
        optimizer = make_optimizer(opt if mode == "train" else OptimizerSpec("sgd"), accumulate=variant != "noacc")
        emb = et.DistributedEmbedding(features, optimizer, concat_activations=variant == "concat")
        lengths = torch.full((wl.batch,), wl.pooling, dtype=torch.int64)
        inputs = [
            {f"f{t}": et.Ragged.from_lengths(torch.from_numpy(b.ids[t]), lengths) for t in range(wl.tables)}
            for b in batches
        ]
        nb = len(batches)
        slots = len(optimizer.slot_names)
        label = opt.name if mode == "train" else "none"
        notes = f"embtables.DistributedEmbedding({type(optimizer).__name__}"
        notes += ", use_gradient_accumulation=False" if variant == "noacc" else ""
        notes += f", max_sequence_length={wl.pooling}" if seq else ""
        notes += ", concat_activations=True" if variant == "concat" else ""
        notes += f", dtype=bfloat16{', slot_dtype=bfloat16' if slot_half else ''}" if half else ""
        notes += ") native CPU kernels"
        if mode == "lookup":
            emb.eval()

            @torch.no_grad()
            def lookup(i: int) -> None:
                emb(inputs[i % nb])

            return Impl(f"embtables{'' if variant == 'plain' else '-' + variant}", "none", lookup, notes=notes)
        full = torch.from_numpy(activation_grad(wl))
        grads = [g.contiguous() for g in full.split(wl.dim, dim=1)]
        if seq:  # one gradient row per position: [B, M, D]
            rng = np.random.default_rng(wl.seed + 2)
            grads = [
                torch.from_numpy(rng.normal(size=(wl.batch, wl.pooling, wl.dim)).astype(np.float32))
                for _ in range(wl.tables)
            ]

        def step(i: int) -> None:
            acts = emb(inputs[i % nb])
            loss: Any = sum((acts[f"f{t}"] * grads[t]).sum() for t in range(wl.tables))
            loss.backward()
            emb.apply_gradients()

        # the features' columns come in sorted-name order (f0, f1, f10, ...): the same gradient per feature
        columns = emb.activation_columns
        full_cat = torch.cat([grads[int(name[1:])] for name in columns], dim=1) if columns else full

        def concat_step(i: int) -> None:
            acts = emb(inputs[i % nb])  # [B, tables x D]
            (acts * full_cat).sum().backward()
            emb.apply_gradients()

        def read() -> list[np.ndarray]:
            return [emb.embedding_tables[f"t{t}"].float().numpy().copy() for t in range(wl.tables)]

        def set_weights(ws: list[np.ndarray]) -> None:
            for t, w in enumerate(ws):
                emb.embedding_tables[f"t{t}"].copy_(torch.from_numpy(w))

        return Impl(
            f"embtables{'' if variant == 'plain' else '-' + variant}",
            label,
            concat_step if variant == "concat" else step,
            slot_bytes_per_row=slots * wl.dim * (2 if slot_half else 4),
            value_bytes=2 if half else 4,
            notes=notes,
            read_weights=read,
            set_weights=set_weights,
            # what the oracle check must reproduce: accumulation, sequence length and the gradients used
            check={
                "oracle": {
                    "accumulate": variant != "noacc",
                    "max_sequence_length": wl.pooling if seq else 0,
                    "grads": [g.numpy().astype(np.float64) for g in grads],
                }
            },
        )

    return factory


EMBTABLES_IMPLS: dict[str, Factory] = {
    "embtables": _factory("plain"),
    "embtables-noacc": _factory("noacc"),
    "embtables-concat": _factory("concat"),
    "embtables-seq": _factory("seq"),
    "embtables-bf16": _factory("bf16"),
    "embtables-bf16-slots": _factory("bf16-slots"),
    "embtables-bf16-slots-nearest": _factory("bf16-slots-nearest"),
}
