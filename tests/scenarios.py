"""Hypothesis strategies for engine-vs-oracle scenarios, and converters to both sides' inputs.

A scenario is a set of tables and features (pooled, sequence or dense; Ragged, sparse COO,
nested jagged or KeyedJaggedTensor-shaped input; weighted or not; validating or not) and a few
steps of batches with activation gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from conftest import TEST_DEVICE
from hypothesis import strategies as st

import embtables as et


@dataclasses.dataclass
class FeatureSpec:
    table: int
    kind: str  # "pooled" | "sequence" | "dense"
    fmt: str  # "ragged" | "sparse" | "nested" | "kjt" | "dense"
    weighted: bool
    validate: bool
    max_sequence_length: int
    dense_len: int


@dataclasses.dataclass
class Scenario:
    tables: list[tuple[int, int, str]]  # (V, D, combiner)
    features: list[FeatureSpec]
    steps: list[tuple[list[tuple[list[list[int]], list[list[float]] | None]], list[np.ndarray | None]]]
    init: list[np.ndarray]


class DuckKJT:
    """The part of TorchRec's KeyedJaggedTensor that embtables reads (duck typing)."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None):
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        return int(self._lengths.numel()) // max(len(self._keys), 1)


@st.composite
def scenarios(draw: Any, num_steps: int = 3, allow_nonpositive_weights: bool = True) -> Scenario:
    n_tables = draw(st.integers(1, 3))
    tables = [
        (draw(st.integers(1, 12)), draw(st.integers(1, 4)), draw(st.sampled_from(["sum", "mean", "sqrtn"])))
        for _ in range(n_tables)
    ]
    features = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["pooled", "pooled", "sequence", "dense"]))
        if kind == "dense":
            fmt = "dense"
        elif kind == "sequence":
            fmt = draw(st.sampled_from(["ragged", "sparse", "nested"]))
        else:
            fmt = draw(st.sampled_from(["ragged", "sparse", "nested", "kjt"]))
        features.append(
            FeatureSpec(
                table=draw(st.integers(0, n_tables - 1)),
                kind=kind,
                fmt=fmt,
                weighted=kind == "pooled" and draw(st.booleans()),
                validate=draw(st.booleans()),
                max_sequence_length=draw(st.integers(1, 4)) if kind == "sequence" else 0,
                dense_len=draw(st.integers(1, 3)),
            )
        )
    batch = draw(st.integers(1, 5))
    steps = []
    for _ in range(num_steps):
        inputs: list[tuple[list[list[int]], list[list[float]] | None]] = []
        grads: list[np.ndarray | None] = []
        for f in features:
            vocab, dim, _ = tables[f.table]
            low = -1 if f.validate else 0
            row_len = st.just(f.dense_len) if f.kind == "dense" else st.integers(0, 5)
            ids = [
                draw(st.lists(st.integers(low, vocab - 1), min_size=n, max_size=n))
                for n in [draw(row_len) for _ in range(batch)]
            ]
            weights = None
            if f.weighted:
                choices = [0.25, 0.5, 1.0, 1.5, 3.0]
                if f.validate and allow_nonpositive_weights:
                    choices += [0.0, -1.0]
                weights = [[draw(st.sampled_from(choices)) for _ in row] for row in ids]
            inputs.append((ids, weights))
            if f.kind == "pooled":
                shape: tuple[int, ...] = (batch, dim)
            elif f.kind == "sequence":
                shape = (batch, f.max_sequence_length, dim)
            else:
                shape = (batch, f.dense_len, dim)
            seed = draw(st.integers(0, 2**31 - 1))
            zero_grad = draw(st.integers(0, 9)) == 0
            grads.append(None if zero_grad else np.random.default_rng(seed).normal(size=shape).astype(np.float32))
        steps.append((inputs, grads))
    init_seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(init_seed)
    init = [(rng.normal(size=(v, d)) * 0.5).astype(np.float32) for v, d, _ in tables]
    return Scenario(tables=tables, features=features, steps=steps, init=init)


def oracle_optimizer(opt: et.config.Optimizer) -> dict[str, Any]:
    """An embtables optimizer config as the oracle's plain dict (TF argument names + "name")."""
    out = {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}
    out.pop("learning_rate")
    out.pop("slot_variable_creation_fn", None)
    out["name"] = type(opt).__name__
    return out


def build_engine(sc: Scenario, optimizer: et.config.Optimizer) -> et.DistributedEmbedding:
    tables = [
        et.TableConfig(v, d, initializer=_FromArray(sc.init[i]), combiner=c, name=f"t{i}")
        for i, (v, d, c) in enumerate(sc.tables)
    ]
    feats = {
        f"f{i}": et.FeatureConfig(
            tables[f.table], max_sequence_length=f.max_sequence_length, validate_weights_and_indices=f.validate
        )
        for i, f in enumerate(sc.features)
    }
    return et.DistributedEmbedding(feats, optimizer, device=TEST_DEVICE)


@dataclasses.dataclass(frozen=True, eq=False)
class _FromArray:
    array: np.ndarray

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        assert tuple(shape) == self.array.shape
        return torch.from_numpy(self.array.copy()).to(dtype)


def build_oracle(sc: Scenario, optimizer: et.config.Optimizer) -> Any:
    from oracle.np_engine import OracleEngine

    opt = oracle_optimizer(optimizer)
    tables = {
        f"t{i}": {"weights": sc.init[i].astype(np.float64), "combiner": c, "optimizer": opt}
        for i, (_, _, c) in enumerate(sc.tables)
    }
    features = [
        {
            "table": f"t{f.table}",
            "max_sequence_length": f.max_sequence_length
            if f.kind == "sequence"
            else (f.dense_len if f.kind == "dense" else 0),
            "validate": f.validate,
        }
        for f in sc.features
    ]
    # Features are listed in the engine's flatten order: dict keys sorted as strings (f0, f1, ...).
    order = sorted(range(len(sc.features)), key=lambda i: f"f{i}")
    assert order == list(range(len(sc.features))), "scenarios keep at most 10 features"
    return OracleEngine(tables, features)


def torch_inputs(
    sc: Scenario, step_inputs: list[tuple[list[list[int]], list[list[float]] | None]], seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step's inputs in each feature's input format; weights in the matching format (or None)."""
    rng = np.random.default_rng(seed)
    features: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for i, (f, (ids, w)) in enumerate(zip(sc.features, step_inputs)):
        key = f"f{i}"
        weights[key] = None
        if f.fmt == "dense":
            features[key] = torch.tensor(ids, dtype=torch.int64).reshape(len(ids), f.dense_len)
            continue
        if f.fmt == "ragged":
            features[key] = et.Ragged.from_lists(ids)
            if w is not None:
                weights[key] = et.Ragged.from_lists(w, dtype=torch.float32)
        elif f.fmt == "nested":
            features[key] = torch.nested.nested_tensor(
                [torch.tensor(r, dtype=torch.int64) for r in ids], layout=torch.jagged
            )
            if w is not None:
                weights[key] = torch.nested.nested_tensor(
                    [torch.tensor(r, dtype=torch.float32) for r in w], layout=torch.jagged
                )
        elif f.fmt == "kjt":
            lengths = torch.tensor([len(r) for r in ids], dtype=torch.int64)
            values = torch.tensor([x for r in ids for x in r], dtype=torch.int64)
            wv = None if w is None else torch.tensor([x for r in w for x in r], dtype=torch.float32)
            features[key] = DuckKJT([key], values, lengths, wv)
        elif f.fmt == "sparse":
            coords = [(b, j) for b, r in enumerate(ids) for j in range(len(r))]
            perm = rng.permutation(len(coords))  # uncoalesced, shuffled: the engine must sort
            width = max([len(r) for r in ids] + [1])
            idx = torch.tensor([coords[p] for p in perm], dtype=torch.int64).reshape(-1, 2).T
            vals = torch.tensor([ids[coords[p][0]][coords[p][1]] for p in perm], dtype=torch.int64)
            features[key] = torch.sparse_coo_tensor(idx, vals, (len(ids), width))
            if w is not None:
                wvals = torch.tensor([w[coords[p][0]][coords[p][1]] for p in perm], dtype=torch.float32)
                weights[key] = torch.sparse_coo_tensor(idx, wvals, (len(ids), width))
    return features, weights
