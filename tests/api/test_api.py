"""DistributedEmbedding behaviour: nests, input shapes, pipelining, state_dict, dynamic rates."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import embtables as et


def _tables() -> tuple[et.TableConfig, et.TableConfig]:
    a = et.TableConfig(20, 4, initializer=et.TruncatedNormal(stddev=0.5, seed=1), combiner="sum", name="a")
    b = et.TableConfig(7, 3, initializer=et.TruncatedNormal(stddev=0.5, seed=2), combiner="mean", name="b")
    return a, b


def test_nested_feature_config_round_trips_the_nest() -> None:
    a, b = _tables()
    cfg = {"user": (et.FeatureConfig(a), [et.FeatureConfig(b)]), "item": et.FeatureConfig(a)}
    emb = et.DistributedEmbedding(cfg, et.SGD(0.1))
    feats = {
        "user": (et.Ragged.from_lists([[1], [2, 3]]), [et.Ragged.from_lists([[0], []])]),
        "item": torch.tensor([4, 5]),
    }
    out = emb(feats)
    assert isinstance(out, dict) and isinstance(out["user"], tuple) and isinstance(out["user"][1], list)
    assert out["user"][0].shape == (2, 4) and out["user"][1][0].shape == (2, 3) and out["item"].shape == (2, 4)
    torch.testing.assert_close(out["item"], emb.embedding_tables["a"][[4, 5]])
    assert torch.equal(out["user"][1][0][1], torch.zeros(3)), "an empty sample is a zero vector"


def test_dense_inputs_of_any_rank_and_output_shape() -> None:
    a, _ = _tables()
    emb = et.DistributedEmbedding(
        {"d1": et.FeatureConfig(a), "d3": et.FeatureConfig(a), "reshaped": et.FeatureConfig(a, output_shape=[2, 3])},
        et.SGD(0.1),
    )
    ids3 = torch.randint(0, 20, (2, 3, 2))
    out = emb({"d1": torch.tensor([1, 2, 3]), "d3": ids3, "reshaped": et.Ragged.from_lists([[i] for i in range(6)])})
    assert out["d1"].shape == (3, 4) and out["d3"].shape == (2, 3, 2, 4) and out["reshaped"].shape == (2, 3, 4)
    torch.testing.assert_close(out["d3"], emb.embedding_tables["a"][ids3])
    torch.testing.assert_close(out["reshaped"].reshape(6, 4), emb.embedding_tables["a"][:6])


def test_sparse_rank3_is_combined_over_its_last_dim() -> None:
    a, _ = _tables()
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(a)}, et.SGD(0.1))
    idx = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 2]])
    sp = torch.sparse_coo_tensor(idx, torch.tensor([3, 4, 5, 6]), (2, 2, 3))
    out = emb({"f": sp})["f"]
    t = emb.embedding_tables["a"]
    assert out.shape == (2, 2, 4)
    torch.testing.assert_close(out[0, 0], t[3])
    torch.testing.assert_close(out[1, 1], t[5] + t[6])
    assert torch.equal(out[1, 0], torch.zeros(4))


def test_whole_keyed_jagged_tensor_splits_by_key() -> None:
    from scenarios import DuckKJT

    a, b = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a), "y": et.FeatureConfig(b)}, et.SGD(0.1))
    kjt = DuckKJT(
        ["y", "x"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 1, 2, 1]), torch.tensor([1.0, 2, 3, 1, 1])
    )
    out = emb(kjt)
    t_a, t_b = emb.embedding_tables["a"], emb.embedding_tables["b"]
    torch.testing.assert_close(out["y"][0], t_b[1])
    torch.testing.assert_close(out["x"][0], 3 * t_a[3] + 1 * t_a[4])  # sum combiner with weights
    torch.testing.assert_close(out["x"][1], t_a[5])


def test_pipelining_reads_tables_one_step_stale() -> None:
    """spec §6 / 10.9: the lookup of step t+1 reads the tables before the update of step t."""
    a, b = _tables()
    cfg = {"x": et.FeatureConfig(a), "y": et.FeatureConfig(b)}
    sync = et.DistributedEmbedding(cfg, et.Adagrad(0.5))
    piped = et.DistributedEmbedding(cfg, et.Adagrad(0.5), pipeline_execution_with_tensor_core=True)
    batches = [{"x": et.Ragged.from_lists([[1, 2], [2]]), "y": et.Ragged.from_lists([[3], [3, 4]])} for _ in range(4)]
    grads = [{"x": torch.randn(2, 4), "y": torch.randn(2, 3)} for _ in range(4)]
    snapshots = [copy.deepcopy(sync).eval()]
    for feats, g in zip(batches, grads):
        sync(feats)
        sync.apply_gradients(g)
        snapshots.append(copy.deepcopy(sync).eval())
    for t, (feats, g) in enumerate(zip(batches, grads)):
        acts = piped(feats)
        expected = snapshots[max(t - 1, 0)](feats)  # tables after step t-1's update are not yet visible
        for k in acts:
            torch.testing.assert_close(acts[k].detach(), expected[k])
        if t >= 1:
            stale_free = snapshots[t](feats)
            assert not torch.allclose(acts["x"].detach(), stale_free["x"]), "ids repeat, so staleness must show"
        piped.apply_gradients(g)
    # Updates still apply in step order: after the last one lands, the tables equal the synchronous run.
    for name, table in piped.embedding_tables.items():
        assert torch.equal(table, sync.embedding_tables[name])
        for slot, value in piped.slot_variables[name].items():
            assert torch.equal(value, sync.slot_variables[name][slot])


def test_state_dict_round_trip_through_a_file(tmp_path: Path) -> None:
    a, b = _tables()
    cfg = {"x": et.FeatureConfig(a), "y": et.FeatureConfig(b)}
    emb = et.DistributedEmbedding(cfg, et.Adam(0.1))
    emb({"x": torch.tensor([1, 2]), "y": torch.tensor([0, 6])})
    emb.apply_gradients({"x": torch.ones(2, 4), "y": torch.ones(2, 3)})
    sd = emb.state_dict()
    assert sorted(sd) == ["a", "a/momenta", "a/velocities", "b", "b/momenta", "b/velocities"]
    path = tmp_path / "emb.pt"
    torch.save(sd, path)
    other = et.DistributedEmbedding(
        {
            "x": et.FeatureConfig(et.TableConfig(20, 4, name="a", combiner="sum")),
            "y": et.FeatureConfig(et.TableConfig(7, 3, name="b")),
        },
        et.Adam(0.1),
    )
    other.load_state_dict(torch.load(path))
    for k, v in emb.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def test_state_dict_keys_are_prefixed_inside_a_parent_module() -> None:
    a, _ = _tables()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = et.DistributedEmbedding({"x": et.FeatureConfig(a)}, et.Adagrad(0.1))
            self.head = torch.nn.Linear(4, 1)

    m = Model()
    keys = set(m.state_dict())
    assert {"emb.a", "emb.a/accumulators", "head.weight", "head.bias"} == keys
    assert all(p is not m.emb.embedding_tables["a"] for p in m.parameters()), "tables are not nn.Parameters"
    m2 = Model()
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.emb.embedding_tables["a"], m.emb.embedding_tables["a"])


def test_shared_dynamic_learning_rate_is_evaluated_once_per_step() -> None:
    calls = []

    def lr() -> float:
        calls.append(1)
        return 0.1

    a = et.TableConfig(5, 2, name="a", optimizer=et.SGD(lr))
    b = et.TableConfig(5, 2, name="b", optimizer=et.Adagrad(lr))
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a), "y": et.FeatureConfig(b)})
    for step in range(3):
        emb({"x": torch.tensor([1]), "y": torch.tensor([2])})
        emb.apply_gradients({"x": torch.ones(1, 2), "y": torch.ones(1, 2)})
        assert len(calls) == step + 1


def test_none_gradient_is_a_zero_gradient_that_still_touches_rows(caplog: pytest.LogCaptureFixture) -> None:
    table = et.TableConfig(5, 2, name="t", initializer=et.Constant(1.0))
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(table)}, et.Adam(0.1, weight_decay_factor=0.5))
    emb({"x": torch.tensor([3])})
    with caplog.at_level(logging.WARNING, logger="embtables"):
        emb.apply_gradients({"x": None})
    assert "zero gradient" in caplog.text
    t = emb.embedding_tables["t"]
    assert torch.equal(t[3], torch.full((2,), 0.5)), "touched row decays (w - 0.5 w) even with a zero gradient"
    assert torch.equal(t[0], torch.ones(2)), "untouched rows stay"


def test_unused_activation_gets_zero_gradient_via_autograd() -> None:
    table = et.TableConfig(5, 2, name="t", initializer=et.Constant(1.0))
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(table), "y": et.FeatureConfig(table)}, et.SGD(1.0))
    out = emb({"x": torch.tensor([1]), "y": torch.tensor([2])})
    out["x"].sum().backward()  # y is not used by the loss
    emb.apply_gradients()
    t = emb.embedding_tables["t"]
    assert torch.equal(t[1], torch.zeros(2)) and torch.equal(t[2], torch.ones(2))


def test_module_to_and_device_argument() -> None:
    table = et.TableConfig(5, 2, name="t")
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(table)}, et.Adagrad(0.1), device="cpu")
    assert emb.device == torch.device("cpu")
    moved = emb.to("cpu")
    assert moved is emb and emb.embedding_tables["t"].device.type == "cpu"


@pytest.mark.parametrize("fmt", ["ragged", "nested", "sparse", "kjt"])
def test_every_input_format_gives_the_same_activations(fmt: str) -> None:
    from scenarios import FeatureSpec, Scenario, torch_inputs

    ids, w = [[1, 2, 2], [], [0]], [[1.0, 0.5, 2.0], [], [3.0]]
    sc = Scenario(
        tables=[(5, 3, "sqrtn")], features=[FeatureSpec(0, "pooled", fmt, True, True, 0, 1)], steps=[], init=[]
    )
    table = et.TableConfig(5, 3, combiner="sqrtn", name="t", initializer=et.RowIdInitializer(1.0))
    emb = et.DistributedEmbedding({"f0": et.FeatureConfig(table)}, et.SGD(0.1))
    feats, weights = torch_inputs(sc, [(ids, w)])
    out: Any = emb(feats, weights)["f0"]
    den0 = (1 + 0.25 + 4) ** 0.5
    torch.testing.assert_close(out[0], torch.full((3,), (1 * 2 + 0.5 * 3 + 2 * 3) / den0))
    assert torch.equal(out[1], torch.zeros(3))
    torch.testing.assert_close(out[2], torch.full((3,), 1.0))


def test_table_config_objects_work_as_keys_like_tf() -> None:
    a, b = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a), "y": et.FeatureConfig(b)}, et.Adagrad(0.1))
    assert emb.embedding_tables[a] is emb.embedding_tables["a"]
    assert b in emb.slot_variables and emb.slot_variables[b]["accumulators"].shape == (7, 3)
    other = et.TableConfig(20, 4, name="a")  # equal-looking but a different object: not this module's table
    assert emb.embedding_tables.get(other) is None


def test_build_follows_tf_rules(caplog: pytest.LogCaptureFixture) -> None:
    a, _ = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a)}, et.SGD(0.1))
    with pytest.raises(ValueError, match="not both"):
        emb.build(per_replica_input_shapes={"x": [2]}, per_replica_batch_size=2)
    emb.build(per_replica_batch_size=2)
    with caplog.at_level(logging.WARNING, logger="embtables"):
        emb.build()
    assert "already built" in caplog.text


def test_unapplied_training_lookup_warns(caplog: pytest.LogCaptureFixture) -> None:
    a, _ = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a)}, et.SGD(0.1))
    emb({"x": torch.tensor([1])})
    with caplog.at_level(logging.WARNING, logger="embtables"):
        emb({"x": torch.tensor([2])})
    assert "never applied" in caplog.text


def test_deepcopy_and_pickle_of_a_trained_module(tmp_path: Path) -> None:
    """Native scratch workspaces are per object: copies and pickles never share or double-free them."""
    a, _ = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a)}, et.Adagrad(0.1))
    for _ in range(2):
        emb({"x": et.Ragged.from_lists([[1, 2], [2, 3]])})
        emb.apply_gradients({"x": torch.ones(2, 4)})
    twin = copy.deepcopy(emb)
    torch.save(emb, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for m in (emb, twin, loaded):
        m({"x": et.Ragged.from_lists([[4], [1]])})
        m.apply_gradients({"x": torch.ones(2, 4)})
    assert torch.equal(twin.embedding_tables["a"], emb.embedding_tables["a"])
    assert torch.equal(loaded.embedding_tables["a"], emb.embedding_tables["a"])
    del twin, loaded


def test_native_phase1_equals_torch_dedup_sum() -> None:
    """The C dedup + float32 sums give exactly torch's ``dedup_sum`` (same rows, same order of addition)."""
    from embtables.kernels import native
    from embtables.kernels.lookup import occurrence_gradients
    from embtables.kernels.segments import dedup_sum, segments_from_offsets

    assert native.library() is not None
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 50, (40,), generator=gen), torch.randint(0, 50, (25,), generator=gen)]
    offsets = [torch.tensor([0, 10, 10, 25, 40]), torch.tensor([0, 5, 25])]
    coeffs = [torch.rand(40, generator=gen), None]
    grads = [torch.randn(4, 6, generator=gen), torch.randn(2, 6, generator=gen)]
    ws = native.Workspace(6)
    (status,) = native.prepare_many([(ws, 50, list(zip(ids, offsets, coeffs, grads)))])
    assert status == 0
    rows, sums = ws.rows_and_grads()
    per_id = torch.cat(
        [occurrence_gradients(g, segments_from_offsets(o), c) for g, o, c in zip(grads, offsets, coeffs)]
    )
    ref_rows, ref_sums = dedup_sum(torch.cat(ids), per_id)
    order = torch.argsort(rows)  # C keeps first-occurrence order, torch.unique sorts
    assert torch.equal(rows[order], ref_rows)
    assert torch.equal(sums[order], ref_sums)


def test_non_contiguous_gradients_take_the_native_path() -> None:
    a, _ = _tables()
    emb = et.DistributedEmbedding({"x": et.FeatureConfig(a)}, et.Adagrad(0.1))
    emb({"x": torch.tensor([1, 2, 3])})
    grad = torch.randn(4, 3).t()  # [3, 4], not contiguous
    assert not grad.is_contiguous()
    (checked,) = emb._engine.check_gradients(emb._pipeline.last.batches, [grad])  # type: ignore[union-attr]
    assert checked is not None and checked.is_contiguous() and torch.equal(checked, grad)
    emb.apply_gradients({"x": grad})
