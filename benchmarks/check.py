"""One training step of an impl against the float64 NumPy oracle (``tests/oracle``), per optimizer.

Runs on a small workload (2 tables x 1000 rows x dim 8, batch 16, pooling 4, Zipf ids, so rows
repeat) from identical weights and reports the max abs error of the weights after one step, next
to the largest update, so "wrong optimizer" (e.g. FBGEMM's row-wise Adagrad) is visible at once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from benchmarks._harness import Factory, OptimizerSpec, Skip, emit, emit_skip
from benchmarks.workload import Workload, activation_grad, initial_weights, make_batches

CHECK = Workload(name="check", tables=2, rows=1000, dim=8, batch=16, pooling=4, num_batches=1)


def _oracle_step(wl: Workload, opt: OptimizerSpec, w0: list[np.ndarray], how: dict[str, Any]) -> list[np.ndarray]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from oracle.np_engine import OracleEngine

    from benchmarks.impl_embtables import make_optimizer

    cfg = make_optimizer(opt)
    skip = ("learning_rate", "slot_variable_creation_fn")
    spec = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f not in skip}
    spec["name"] = type(cfg).__name__
    spec["use_gradient_accumulation"] = how.get("accumulate", True)
    seq = int(how.get("max_sequence_length", 0))
    batch = make_batches(wl)[0]
    grad = activation_grad(wl).astype(np.float64)
    tables = {f"t{t}": {"weights": w0[t], "combiner": "sum", "optimizer": spec} for t in range(wl.tables)}
    oracle = OracleEngine(tables, [{"table": f"t{t}", "max_sequence_length": seq} for t in range(wl.tables)])
    inputs = [(batch.ids[t].reshape(wl.batch, wl.pooling).tolist(), None) for t in range(wl.tables)]
    grads = how.get("grads") or [grad[:, t * wl.dim : (t + 1) * wl.dim] for t in range(wl.tables)]
    oracle.apply_gradients(inputs, grads, {name: float(np.float32(opt.lr)) for name in tables})
    return [oracle.tables[f"t{t}"] for t in range(wl.tables)]


def oracle_check(name: str, factory: Factory, opt: OptimizerSpec) -> dict[str, Any] | None:
    """Emit one ``oracle_check`` record for impl ``name`` and optimizer ``opt``."""
    try:
        impl = factory(CHECK, make_batches(CHECK), opt, "train")
    except Skip as exc:
        emit_skip("oracle_check", name, str(exc), optimizer=opt.name)
        return None
    except Exception as exc:
        emit_skip("oracle_check", name, f"failed to build: {type(exc).__name__}: {str(exc)[:200]}", optimizer=opt.name)
        return None
    if impl.set_weights is None or impl.read_weights is None:
        emit_skip("oracle_check", name, "impl exposes no set_weights/read_weights", optimizer=opt.name)
        return None
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if not os.path.isfile(os.path.join(tests, "oracle", "np_engine.py")):  # an installed wheel: no tests/
        emit_skip("oracle_check", name, "the float64 oracle ships with the source checkout (tests/oracle)",
                  optimizer=opt.name)  # fmt: skip
        return None
    w0 = [initial_weights(CHECK, t) for t in range(CHECK.tables)]
    impl.set_weights(w0)
    impl.run(0)
    got = impl.read_weights()
    ref = _oracle_step(CHECK, opt, [w.astype(np.float64) for w in w0], impl.check.get("oracle", {}))
    err = max(float(np.abs(g - r).max()) for g, r in zip(got, ref, strict=True))
    update = max(float(np.abs(r - w).max()) for r, w in zip(ref, w0, strict=True))
    rec = {
        "bench": "oracle_check",
        "impl": impl.impl,
        "optimizer": impl.optimizer,
        "max_abs_err": err,
        "max_update": update,
        "rel_err_of_update": err / update if update else float("inf"),
        "ok": err <= 1e-5 * max(1.0, update) + 1e-6,
    }
    emit(rec)
    return rec
