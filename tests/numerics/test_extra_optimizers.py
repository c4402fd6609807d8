"""The TPUEstimator-era optimizers (ProximalAdagrad, Momentum, RMSProp, CenteredRMSProp, Adadelta,
ProximalYogi, FrequencyEstimator): validation, the two kernel paths bit for bit, FrequencyEstimator's
semantics step by step, and save/restore of their slots. The numerics against the float64 oracle are in
``tests/numerics/test_engine_vs_oracle.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import embtables as et
from embtables.kernels import native

EXTRA = [
    et.ProximalAdagrad(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.1),
    et.Momentum(0.1, momentum=0.8, use_nesterov=True),
    et.RMSProp(0.05, momentum=0.5),
    et.CenteredRMSProp(0.05, momentum=0.5, epsilon=1e-3),
    et.Adadelta(1.0),
    et.ProximalYogi(0.05, l1_regularization_strength=0.01, l2_regularization_strength=0.1),
]


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: et.ProximalAdagrad(initial_accumulator_value=0.0), ValueError),
        (lambda: et.ProximalAdagrad(l1_regularization_strength=-1.0), ValueError),
        (lambda: et.Momentum(momentum="0.9"), TypeError),
        (lambda: et.Momentum(use_nesterov=1), TypeError),
        (lambda: et.RMSProp(epsilon=0.0), ValueError),
        (lambda: et.RMSProp(rho=1.5), ValueError),
        (lambda: et.CenteredRMSProp(epsilon=-1e-3), ValueError),
        (lambda: et.Adadelta(rho=-0.1), ValueError),
        (lambda: et.ProximalYogi(beta_1=1.0), ValueError),
        (lambda: et.ProximalYogi(beta_2=-0.5), ValueError),
        (lambda: et.ProximalYogi(epsilon=0.0), ValueError),
        (lambda: et.ProximalYogi(l2_regularization_strength=-0.1), ValueError),
        (lambda: et.FrequencyEstimator(tau=2.0), ValueError),
        (lambda: et.FrequencyEstimator(max_delta=-1.0), ValueError),
        (lambda: et.Momentum(use_gradient_accumulation=False, clipvalue=1.0), ValueError),
    ],
)
def test_validation(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()


def test_slot_names_and_initial_values() -> None:
    assert et.CenteredRMSProp().slot_names == ("ms", "mom", "mg")
    assert et.ProximalYogi(initial_accumulator_value=0.5).slot_initial_values() == (0.5, 0.0)
    assert et.FrequencyEstimator().slot_names == ("last_hit_step",)
    assert et.ProximalAdagrad(initial_accumulator_value=0.2).slot_initial_values() == (0.2,)


def _train(opt: Any, steps: int = 4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    table = et.TableConfig(20, 5, name="t", optimizer=opt, combiner="sum")
    emb = et.DistributedEmbedding({"a": et.FeatureConfig(table), "b": et.FeatureConfig(table)})
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 20, (6, 3), generator=gen)
        out = emb({"a": ids, "b": ids[:, :2]})
        emb.apply_gradients({k: torch.randn(v.shape, generator=gen) for k, v in out.items()})
    return emb.embedding_tables["t"].clone(), {k: v.clone() for k, v in emb.slot_variables["t"].items()}


@pytest.mark.parametrize("opt", EXTRA, ids=lambda o: type(o).__name__)
def test_native_and_torch_paths_are_bit_identical(opt: Any) -> None:
    assert native.library() is not None
    try:
        native.set_enabled(True)
        w_native, s_native = _train(opt)
        native.set_enabled(False)
        w_torch, s_torch = _train(opt)
    finally:
        native.set_enabled(True)
    assert torch.equal(w_native, w_torch)
    assert s_native.keys() == s_torch.keys() == set(opt.slot_names)
    for k in s_native:
        assert torch.equal(s_native[k], s_torch[k]), k
    assert torch.isfinite(w_native).all()


def test_frequency_estimator_tracks_the_gap_between_hits(kernel_path: str) -> None:
    """Row 0 is hit at steps 1, 3, 5 (gap 2), row 1 at 1 and 9 (gap 8 >= outlier 2 * D: reset), row 2 at
    step 1 only. tau = 0.5, max_delta = 6: each update is checked against the spec §1.3 rule by hand."""
    step = [0]
    opt = et.FrequencyEstimator(lambda: float(step[0]), tau=0.5, max_delta=6.0, outlier_threshold=2.0)
    table = et.TableConfig(3, 1, name="freq", optimizer=opt, initializer=et.Constant(6.0), combiner="sum")
    emb = et.DistributedEmbedding({"ids": et.FeatureConfig(table)})
    hits = {1: [0, 1, 2], 3: [0], 5: [0], 9: [1]}
    for t in range(1, 10):
        step[0] = t
        ids = hits.get(t, [])
        out = emb({"ids": et.Ragged.from_lists([ids])})
        emb.apply_gradients({"ids": torch.zeros_like(out["ids"])})
    est = emb.embedding_tables["freq"][:, 0].tolist()
    last = emb.slot_variables["freq"]["last_hit_step"][:, 0].tolist()
    # row 0: t=1 delta 1 (6*0.5+1*0.5=3.5), t=3 delta 2 (1.75+1=2.75), t=5 delta 2 (1.375+1=2.375)
    # row 1: t=1 -> 3.5; t=9 delta 8 >= 2*3.5: outlier, D = min(8, 6) = 6
    # row 2: t=1 -> 3.5
    assert est == [2.375, 6.0, 3.5]
    assert last == [5.0, 9.0, 1.0]


@pytest.mark.parametrize("opt", [et.CenteredRMSProp(0.05, momentum=0.5), et.ProximalYogi(0.05)])
def test_checkpoint_round_trip_keeps_every_slot(opt: Any, tmp_path: Path) -> None:
    table = et.TableConfig(30, 4, name="t", optimizer=opt)
    a = et.DistributedEmbedding({"f": et.FeatureConfig(table)})
    out = a({"f": torch.tensor([[1, 2], [3, 1]])})
    a.apply_gradients({"f": torch.ones_like(out["f"])})
    a.save(tmp_path / "ckpt")
    b = et.DistributedEmbedding({"f": et.FeatureConfig(table)})
    b.restore(tmp_path / "ckpt")
    assert torch.equal(a.embedding_tables["t"], b.embedding_tables["t"])
    for k, v in a.slot_variables["t"].items():
        assert torch.equal(v, b.slot_variables["t"][k]), k
