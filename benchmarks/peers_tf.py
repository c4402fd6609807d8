"""TensorFlow CPU peer (skipped with one line when ``import tensorflow`` fails).

Configuration: one ``tf.Variable`` [rows, dim] per table; lookup ``tf.nn.embedding_lookup_sparse(var,
SparseTensor ids, None, combiner="sum")`` (which unique-s the ids, gathers, and segment-sums); gradient by
``tf.GradientTape`` (an ``IndexedSlices``), duplicates summed with ``tf.unique`` +
``tf.math.unsorted_segment_sum`` (as TF's optimizers do before a sparse apply, and as the TPU does), then
one fused sparse kernel per table, all inside one ``tf.function``:

* adagrad: ``tf.raw_ops.ResourceSparseApplyAdagradV2(epsilon=0)``: exactly TPU Adagrad
  (acc += g^2; w -= lr g / sqrt(acc)), accumulator initialised to 0.1.
* ftrl: ``tf.raw_ops.ResourceSparseApplyFtrlV2`` (l1 = l2 = 0, lr_power -0.5, accumulator 0.1).
* sgd: ``ResourceVariable.scatter_sub``.
* adam: lazy Adam (only touched rows) with ``tf.gather`` + ``scatter_update``/``scatter_sub``,
  bias-corrected like ``tf.compat.v1.train.AdamOptimizer``; TF has no fused sparse Adam kernel.

TensorFlow is not installed into the main environment by ``scripts/install_bench_peers.sh`` (it adds ~20
packages); it runs from a ``--system-site-packages`` venv that sees torch and numpy unchanged
(``BENCH_INSTALL_TF=1`` creates it; run the benchmark with that venv's python).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from benchmarks._harness import Impl, OptimizerSpec, Skip
from benchmarks.workload import Batch, Workload, activation_grad


def _import_tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except Exception as exc:
        raise Skip(
            f"tensorflow not importable ({type(exc).__name__}: {str(exc)[:120]}); "
            "BENCH_INSTALL_TF=1 scripts/install_bench_peers.sh makes a venv with it"
        ) from None
    try:
        import torch

        tf.config.threading.set_intra_op_parallelism_threads(torch.get_num_threads())
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass  # already initialised by an earlier TF peer in this process
    return tf


def tensorflow_factory(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
    tf = _import_tf()
    if mode == "train" and opt.name not in ("adagrad", "ftrl", "sgd", "adam"):
        raise Skip(f"optimizer {opt.name} not implemented for tensorflow")
    n = wl.batch * wl.pooling
    sp_index = tf.constant(
        np.stack([np.repeat(np.arange(wl.batch), wl.pooling), np.tile(np.arange(wl.pooling), wl.batch)], axis=1)
    )
    shape = tf.constant([wl.batch, wl.pooling], dtype=tf.int64)
    sp_ids = [[tf.SparseTensor(sp_index, tf.constant(x), shape) for x in b.ids] for b in batches]
    assert all(x.size == n for b in batches for x in b.ids)
    init = tf.random_uniform_initializer(-0.05, 0.05, seed=wl.seed)
    weights = [tf.Variable(init((wl.rows, wl.dim)), name=f"t{t}") for t in range(wl.tables)]
    nb = len(batches)

    def lookup_fn(ids: list[Any]) -> list[Any]:
        return [tf.nn.embedding_lookup_sparse(w, sp, None, combiner="sum") for w, sp in zip(weights, ids, strict=True)]

    if mode == "lookup":
        lookup_tf = tf.function(lookup_fn)

        def lookup(i: int) -> None:
            lookup_tf(sp_ids[i % nb])

        return Impl("tensorflow", "none", lookup, notes=f"tf {tf.__version__} embedding_lookup_sparse in tf.function")

    grads = [tf.constant(g) for g in np.split(activation_grad(wl), wl.tables, axis=1)]
    lr = tf.constant(opt.lr, tf.float32)
    slots: list[list[Any]] = []
    if opt.name in ("adagrad", "ftrl"):
        slots.append([tf.Variable(tf.fill((wl.rows, wl.dim), opt.initial_accumulator)) for _ in weights])
    if opt.name in ("ftrl", "adam"):
        slots.append([tf.Variable(tf.zeros((wl.rows, wl.dim))) for _ in weights])
    if opt.name == "adam":
        slots.insert(0, [tf.Variable(tf.zeros((wl.rows, wl.dim))) for _ in weights])
    step_var = tf.Variable(0.0)

    def apply(t: int, rows: Any, g: Any) -> None:
        w = weights[t]
        if opt.name == "adagrad":
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=w.handle,
                accum=slots[0][t].handle,
                lr=lr,
                epsilon=0.0,
                grad=g,
                indices=rows,
                update_slots=True,
            )
        elif opt.name == "ftrl":
            z = tf.constant(0.0)
            tf.raw_ops.ResourceSparseApplyFtrlV2(
                var=w.handle,
                accum=slots[0][t].handle,
                linear=slots[1][t].handle,
                grad=g,
                indices=rows,
                lr=lr,
                l1=z,
                l2=z,
                l2_shrinkage=z,
                lr_power=tf.constant(opt.lr_power),
            )
        elif opt.name == "sgd":
            w.scatter_sub(tf.IndexedSlices(lr * g, rows))
        else:
            m_var, v_var = slots[0][t], slots[1][t]
            m = opt.beta1 * tf.gather(m_var, rows) + (1 - opt.beta1) * g
            v = opt.beta2 * tf.gather(v_var, rows) + (1 - opt.beta2) * g * g
            m_var.scatter_update(tf.IndexedSlices(m, rows))
            v_var.scatter_update(tf.IndexedSlices(v, rows))
            lr_t = lr * tf.sqrt(1 - opt.beta2**step_var) / (1 - opt.beta1**step_var)
            w.scatter_sub(tf.IndexedSlices(lr_t * m / (tf.sqrt(v) + opt.adam_eps), rows))

    @tf.function
    def train(ids: list[Any]) -> None:
        with tf.GradientTape() as tape:
            acts = lookup_fn(ids)
            loss = tf.add_n([tf.reduce_sum(a * g) for a, g in zip(acts, grads, strict=True)])
        step_var.assign_add(1.0)
        for t, gs in enumerate(tape.gradient(loss, weights)):
            rows, pos = tf.unique(gs.indices)
            apply(t, rows, tf.math.unsorted_segment_sum(gs.values, pos, tf.shape(rows)[0]))

    def step(i: int) -> None:
        train(sp_ids[i % nb])

    def set_weights(ws: list[np.ndarray]) -> None:
        for v, w in zip(weights, ws, strict=True):
            v.assign(w)

    kernel = {
        "adagrad": "ResourceSparseApplyAdagradV2(epsilon=0)",
        "ftrl": "ResourceSparseApplyFtrlV2",
        "sgd": "scatter_sub",
        "adam": "lazy Adam via gather/scatter_update",
    }[opt.name]
    return Impl(
        "tensorflow",
        opt.name,
        step,
        slot_bytes_per_row=wl.dim * 4 * opt.slots,
        notes=f"tf {tf.__version__}: embedding_lookup_sparse + GradientTape + {kernel} in one tf.function",
        read_weights=lambda: [v.numpy().copy() for v in weights],
        set_weights=set_weights,
    )
