"""Exactness of dynamic tables (spec §11): an admitted key's row follows exactly the trajectory of a fixed
table's row, for every optimizer and both kernel paths.

The reference is a fixed table fed the rows that the Python key map (tests/oracle/py_key_map.py) gives the
keys, with keys that have no row left out of the input; the rows it hands to new keys get the dynamic
table's fresh initial values. Tables, slots and activations must match bit for bit at every step.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from oracle.py_key_map import PyKeyMap

import embtables as et
from embtables.kernels import native

OPTIMIZERS = [
    et.SGD(0.1),
    et.Adagrad(0.1),
    et.AdagradMomentum(0.1, momentum=0.9),
    et.Adam(0.05),
    et.Adam(0.05, lazy_adam=False),
    et.FTRL(0.1, l1_regularization_strength=0.01),
    et.ProximalAdagrad(0.1),
    et.Momentum(0.1),
    et.RMSProp(0.1),
    et.CenteredRMSProp(0.1),
    et.Adadelta(1.0),
    et.ProximalYogi(0.1),
    et.FrequencyEstimator(0.1),
]
CAPACITY, DIM, BATCH = 5, 3, 4
POOL = [3, -3, 2**63 - 1, -(2**63), 10**15, 0, 77, 78, 79, -1000, 5, 6]


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def kernel_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    native.set_enabled(request.param)
    yield request.param
    native.set_enabled(True)


def _modules(optimizer: et.config.Optimizer, pipelined: bool, policy: et.DynamicVocabulary) -> tuple[
    et.DistributedEmbedding, et.DistributedEmbedding
]:  # fmt: skip
    dyn = et.TableConfig(CAPACITY, DIM, name="t", combiner="mean", dynamic=policy)
    fixed = et.TableConfig(CAPACITY, DIM, name="t", combiner="mean")
    kw = {"pipeline_execution_with_tensor_core": pipelined}
    d = et.DistributedEmbedding({"a": et.FeatureConfig(dyn), "b": et.FeatureConfig(dyn)}, optimizer, **kw)
    f = et.DistributedEmbedding({"a": et.FeatureConfig(fixed), "b": et.FeatureConfig(fixed)}, optimizer, **kw)
    f.load_state_dict({"t": d.embedding_tables["t"], **{f"t/{s}": v for s, v in d.slot_variables["t"].items()}})
    return d, f


def _run(optimizer: et.config.Optimizer, pipelined: bool, policy: et.DynamicVocabulary, steps: int = 8) -> dict[
    str, int
]:  # fmt: skip
    rng = random.Random(7)
    d, f = _modules(optimizer, pipelined, policy)
    ref = PyKeyMap(CAPACITY, policy.admit_after, policy.eviction, policy.ttl_steps)
    for step in range(1, steps + 1):
        bags = [[rng.choice(POOL) for _ in range(rng.randint(1, 3))] for _ in range(BATCH)]
        weights = [[rng.uniform(0.5, 2.0) for _ in bag] for bag in bags]
        singles = [rng.choice(POOL) for _ in range(BATCH)]
        # the key map's order: sample-major, then feature (a before b), then position
        ordered = [k for b in range(BATCH) for k in (*bags[b], singles[b])]
        rows, reset = ref.train(ordered, step, step - 1 if pipelined else step)
        it = iter(rows)
        row_bags, row_singles = [], []
        for b in range(BATCH):
            row_bags.append([next(it) for _ in bags[b]])
            row_singles.append(next(it))
        acts_d = d({"a": et.Ragged.from_lists(bags), "b": torch.tensor(singles)},
                   {"a": et.Ragged.from_lists(weights, dtype=torch.float32), "b": None})  # fmt: skip
        # the rows given to new keys: the fixed table takes the dynamic table's fresh initial values
        if reset:
            idx = torch.tensor(reset)
            with torch.no_grad():
                f.embedding_tables["t"][idx] = d.embedding_tables["t"][idx]
                for s, v in d.slot_variables["t"].items():
                    f.slot_variables["t"][s][idx] = v[idx]
        kept = [[(r, w) for r, w in zip(rb, wb) if r >= 0] for rb, wb in zip(row_bags, weights)]
        acts_f = f(
            {"a": et.Ragged.from_lists([[r for r, _ in k] for k in kept]),
             "b": et.Ragged.from_lists([[r] if r >= 0 else [] for r in row_singles])},
            {"a": et.Ragged.from_lists([[w for _, w in k] for k in kept], dtype=torch.float32), "b": None},
        )  # fmt: skip
        for name in ("a", "b"):
            assert torch.equal(acts_d[name], acts_f[name]), (step, name)
        grads = {name: torch.randn(BATCH, DIM) for name in ("a", "b")}
        d.apply_gradients(grads)
        f.apply_gradients(grads)
        assert torch.equal(d.embedding_tables["t"], f.embedding_tables["t"]), step
        for s, v in d.slot_variables["t"].items():
            assert torch.equal(v, f.slot_variables["t"][s]), (step, s)
    keys, live_rows = d.vocabulary("t")
    assert sorted(zip(live_rows.tolist(), keys.tolist())) == sorted((r, k) for k, r in ref.row_of.items())
    stats = d.vocabulary_statistics()["t"]
    assert {k: stats[k] for k in ref.stats} == ref.stats
    return stats


def _name(o: et.config.Optimizer) -> str:
    return type(o).__name__ + ("" if getattr(o, "lazy_adam", True) else "-dense")


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=_name)
def test_admitted_rows_follow_the_fixed_table(optimizer: et.config.Optimizer, kernel_path: bool) -> None:
    stats = _run(optimizer, pipelined=False, policy=et.DynamicVocabulary(admit_after=2, eviction="lru"))
    assert stats["admitted"] > CAPACITY and stats["evicted"] > 0  # rows were reused, so resets were exercised


@pytest.mark.parametrize(
    "policy",
    [
        et.DynamicVocabulary(admit_after=1, eviction="lfu"),
        et.DynamicVocabulary(admit_after=3, eviction=None, ttl_steps=2),
        et.DynamicVocabulary(admit_after=1, eviction="lru", ttl_steps=1),
    ],
    ids=["lfu", "none-ttl", "lru-ttl"],
)
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_every_policy_and_pipelining(policy: et.DynamicVocabulary, pipelined: bool) -> None:
    _run(et.Adagrad(0.1), pipelined=pipelined, policy=policy, steps=10)
