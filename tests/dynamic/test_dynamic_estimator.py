"""A hashed feature column without a bucket count feeds a dynamic table through the Estimator: it learns,
and resuming from model_dir continues exactly (spec §11)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import embtables as et
from embtables import estimator as est
from embtables.errors import ConfigError

N = 3000


def _data() -> tuple[dict[str, Any], np.ndarray]:
    rng = np.random.default_rng(0)
    users = rng.integers(0, 150, N)  # 150 users for 128 rows: evictions happen
    bias = rng.normal(size=150)
    y = (bias[users] + 0.3 * rng.normal(size=N) > 0).astype(np.float32)
    return {"user": [f"user-{u}" for u in users]}, y


def _input_fn(features: dict[str, Any], y: np.ndarray, skip: int = 0) -> Any:
    def fn() -> Any:
        for i, s in enumerate(range(0, N, 100)):
            if i >= skip:
                yield {k: v[s : s + 100] for k, v in features.items()}, y[s : s + 100]

    return fn


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(8, 1)

    def forward(self, activations: dict[str, torch.Tensor], features: Any) -> torch.Tensor:
        return self.out(activations["user_embedding"]).squeeze(1)


def _estimator(model_dir: Path) -> est.Estimator:
    column = est.embedding_column(
        est.categorical_column_with_hash_bucket("user", None),  # the whole 64-bit digest is the key
        8,
        initializer=et.TruncatedNormal(stddev=0.1, seed=1),
        dynamic=et.DynamicVocabulary(admit_after=1, eviction="lfu"),
        capacity=128,
    )
    spec = est.EmbeddingConfigSpec(feature_columns=[column], optimization_parameters=est.AdagradParameters(0.5))
    torch.manual_seed(0)
    return est.Estimator(
        _Model(), spec, model_dir, dense_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        loss_fn=nn.functional.binary_cross_entropy_with_logits, predictions_fn=torch.sigmoid,
        eval_metrics={"auc": est.auc}, progress=False,
    )  # fmt: skip


def test_hashed_keys_feed_a_dynamic_table_and_resume_exactly(tmp_path: Path) -> None:
    features, y = _data()
    straight = _estimator(tmp_path / "straight")
    straight.train(_input_fn(features, y), steps=30)
    stats = straight.embedding.vocabulary_statistics()["user_embedding"]
    assert stats["live"] == 128 and stats["evicted"] > 0
    half = _estimator(tmp_path / "resumed")
    half.train(_input_fn(features, y), steps=14)
    half.close()
    again = _estimator(tmp_path / "resumed")
    again.train(_input_fn(features, y, skip=14), steps=16)
    a, b = straight.embedding.state_dict(), again.embedding.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    before = _estimator(tmp_path / "fresh").evaluate(_input_fn(features, y))["auc"]
    assert straight.evaluate(_input_fn(features, y))["auc"] > before + 0.05


def test_a_column_without_buckets_needs_a_dynamic_table() -> None:
    with pytest.raises(ConfigError, match="needs a dynamic table"):
        est.embedding_column(est.categorical_column_with_hash_bucket("user", None), 8)
    with pytest.raises(ConfigError, match="pass `dynamic=` too"):
        est.embedding_column(est.categorical_column_with_hash_bucket("user", 10), 8, capacity=5)
