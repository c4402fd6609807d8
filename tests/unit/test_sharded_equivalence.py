"""Issue 7 groundwork: ``ShardedEmbeddingCollection`` on real gloo processes equals a single-process
``DistributedEmbedding`` run on the concatenated global batch (SPEC 10.7, 10.8).

Activations are bit-identical (the same rows pooled in the same order); tables and slots are equal to
float32 rounding of the gradient sums, which the sharded run adds per rank first.
"""

from __future__ import annotations

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding.sharded_collection import ShardedEmbeddingCollection
from embtables.tables.inputs import InputConverter

OPTIMIZERS = {
    "sgd": lambda: et.SGD(0.3),
    "adagrad": lambda: et.Adagrad(0.2, clipvalue=1.5),
    "adam": lambda: et.Adam(0.05),
    "adam-non-lazy": lambda: et.Adam(0.05, lazy_adam=False),
    "ftrl": lambda: et.FTRL(0.2, l1_regularization_strength=0.01),
    "momentum": lambda: et.AdagradMomentum(0.1, momentum=0.9),
}
GLOBAL_BATCH = 6


def _config(opt_name: str) -> dict[str, et.FeatureConfig]:
    opt = OPTIMIZERS[opt_name]()
    ta = et.TableConfig(11, 4, name="ta", combiner="mean", initializer=et.TruncatedNormal(seed=1), optimizer=opt)
    tb = et.TableConfig(2, 3, name="tb", combiner="sum", initializer=et.TruncatedNormal(seed=2), optimizer=opt)
    return {
        "a": et.FeatureConfig(ta),  # pooled, weighted, shares table ta
        "b": et.FeatureConfig(tb),  # V = 2 < W = 3: a rank holds no rows of tb
        "s": et.FeatureConfig(ta, max_sequence_length=2),  # sequence feature on the shared table
    }


def _global_step(step: int) -> tuple[dict[str, list[list[int]]], dict[str, list[list[float]]]]:
    g = torch.Generator().manual_seed(100 + step)
    ids = {
        "a": [
            torch.randint(0, 11, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
            for _ in range(GLOBAL_BATCH)
        ],
        "b": [torch.randint(0, 2, (2,), generator=g).tolist() for _ in range(GLOBAL_BATCH)],
        "s": [torch.randint(0, 11, (3,), generator=g).tolist() for _ in range(GLOBAL_BATCH)],
    }
    weights = {"a": [[0.5 + 0.25 * k for k in range(len(row))] for row in ids["a"]]}
    return ids, weights


def _inputs(
    ids: dict[str, list[list[int]]], weights: dict[str, list[list[float]]], lo: int, hi: int
) -> tuple[dict[str, object], dict[str, object]]:
    feats = {k: et.Ragged.from_lists(v[lo:hi]) for k, v in ids.items()}
    w = {"a": et.Ragged.from_lists(weights["a"][lo:hi], dtype=torch.float32), "b": None, "s": None}
    return feats, w


def _scenarios(rank: int, world: int, cases: list[tuple[str, str]]) -> None:
    per_rank = GLOBAL_BATCH // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    for opt_name, strategy in cases:
        ref = et.DistributedEmbedding(_config(opt_name))
        resolved = ref.resolved_config
        sharded = ShardedEmbeddingCollection(
            resolved, torch.device("cpu"), {t.name: strategy for t in resolved.tables}, {"ta": 1 % world, "tb": 0}
        )
        converters = [InputConverter(f, resolved.tables[f.table_index]) for f in resolved.features]
        names = [f.name for f in resolved.features]
        for step in range(3):
            ids, weights = _global_step(step)
            ref_acts = ref(*_inputs(ids, weights, 0, GLOBAL_BATCH))
            gen = torch.Generator().manual_seed(7 + step)
            grads = {k: torch.randn(v.shape, generator=gen) for k, v in ref_acts.items()}
            feats, w = _inputs(ids, weights, lo, hi)
            batches = [conv.convert(feats[n], w[n], torch.device("cpu")) for conv, n in zip(converters, names)]
            acts = sharded.lookup(batches)
            for n, a in zip(names, acts):
                if step == 0:  # same rows, pooled in the same order: bit-identical
                    assert torch.equal(a, ref_acts[n][lo:hi]), (opt_name, strategy, step, n)
                else:  # the tables differ by float32 rounding of the per-rank gradient sums
                    torch.testing.assert_close(a, ref_acts[n][lo:hi], rtol=2e-5, atol=2e-6)
            checked = [sharded.check_gradient(i, b, grads[n][lo:hi]) for i, (b, n) in enumerate(zip(batches, names))]
            table_grads = sharded.table_gradients(batches, checked)
            sharded.apply(table_grads, sharded.learning_rates())
            ref.apply_gradients(grads)
        got, want = sharded.full_state(), ref.state_dict()
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-6, msg=f"{opt_name} {strategy} {key}")


CASES = [(o, s) for o in OPTIMIZERS for s in ("div", "mod", "table")]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_tables_equal_a_single_process_run(world: int) -> None:
    run_world(_scenarios, world, CASES)


def test_no_accumulation_is_refused_until_it_is_sharded() -> None:
    opt = et.SGD(0.1, use_gradient_accumulation=False)
    cfg = {"a": et.FeatureConfig(et.TableConfig(5, 2, name="t", optimizer=opt))}
    resolved = et.DistributedEmbedding(cfg).resolved_config
    with pytest.raises(NotImplementedError, match="use_gradient_accumulation=False"):
        ShardedEmbeddingCollection(resolved, torch.device("cpu"), {"t": "div"})
