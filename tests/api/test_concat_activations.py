"""``concat_activations=True``: one [B, sum(D)] activation and one gradient, equal to the nest of activations.

Checked against the nest path (itself checked against the oracle): the same activations column for column,
and bit-identical tables and slots after several steps, on both kernel paths, synchronous and pipelined,
in one process and on two real gloo processes; bad gradients and batches are refused naming the rule and
change nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mp_world import run_world
from statecheck import assert_same, snapshot
from torch import Tensor

import embtables as et

ORDER = ["a", "b", "c", "d"]  # flattened (sorted) feature order: the column order


def _features() -> dict[str, et.FeatureConfig]:
    t0 = et.TableConfig(40, 4, name="t0", initializer=et.TruncatedNormal(seed=3), combiner="mean")
    t1 = et.TableConfig(30, 8, name="t1", initializer=et.TruncatedNormal(seed=4), combiner="sqrtn")
    t2 = et.TableConfig(20, 3, name="t2", initializer=et.Constant(0.25), combiner="sum", optimizer=et.SGD(0.3))
    return {"c": et.FeatureConfig(t2), "a": et.FeatureConfig(t0), "b": et.FeatureConfig(t1), "d": et.FeatureConfig(t0)}


def _make(concat: bool, pipelined: bool = False, **kwargs: Any) -> et.DistributedEmbedding:
    return et.DistributedEmbedding(
        _features(),
        et.Adagrad(0.2, initial_accumulator_value=0.1),
        pipeline_execution_with_tensor_core=pipelined,
        concat_activations=concat,
        **kwargs,
    )


def _batch(step: int, rows: int = 6) -> tuple[dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (rows,), generator=gen)
    n = int(lengths.sum())
    features = {
        "a": et.Ragged.from_lengths(torch.randint(0, 40, (n,), generator=gen), lengths),
        "b": torch.randint(0, 30, (rows, 3), generator=gen).to_sparse(),  # sparse [B, L]: one bag per row
        "c": torch.randint(0, 20, (rows,), generator=gen),  # dense [B]: one id per row
        "d": et.Ragged.from_lengths(torch.randint(0, 40, (n,), generator=gen), lengths),
    }
    weights = {
        "a": None,
        "b": None,
        "c": None,
        "d": et.Ragged.from_lengths(torch.rand(n, generator=gen) + 0.5, lengths),
    }
    return features, weights


def _gradient(step: int, rows: int, width: int) -> Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(100 + step))


def _columns(grad: Tensor, emb: et.DistributedEmbedding) -> dict[str, Tensor]:
    return {name: grad[:, start:stop] for name, (start, stop) in emb.activation_columns.items()}


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("through", ["backward", "explicit"])
def test_concat_equals_the_nest_of_activations(kernel_path: str, pipelined: bool, through: str) -> None:
    nest, cat = _make(False, pipelined), _make(True, pipelined)
    assert cat.activation_columns == {"a": (0, 4), "b": (4, 12), "c": (12, 15), "d": (15, 19)}
    assert nest.activation_columns == {}
    for step in range(4):
        features, weights = _batch(step)
        acts, joined = nest(features, weights), cat(features, weights)
        assert isinstance(joined, Tensor) and joined.shape == (6, 19) and joined.requires_grad
        assert torch.equal(joined, torch.cat([acts[k] for k in ORDER], dim=1))
        grad = _gradient(step, 6, 19)
        if through == "backward":
            (joined * grad).sum().backward()
            sum((acts[k] * g).sum() for k, g in _columns(grad, cat).items()).backward()
            cat.apply_gradients()
            nest.apply_gradients()
        else:
            cat.apply_gradients(grad)
            nest.apply_gradients({k: g.contiguous() for k, g in _columns(grad, cat).items()})
    assert_same(snapshot(cat), snapshot(nest))


def test_eval_lookups_are_concatenated_without_grad() -> None:
    emb = _make(True).eval()
    features, weights = _batch(0)
    with torch.no_grad():
        joined = emb(features, weights)
    assert joined.shape == (6, 19) and not joined.requires_grad


def test_a_bad_gradient_is_refused_and_changes_nothing(kernel_path: str) -> None:
    emb = _make(True)
    features, weights = _batch(1)
    joined = emb(features, weights)
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"gradient shape \[6, 18\].*concatenated activation shape \[6, 19\]"):
        emb.apply_gradients(torch.ones(6, 18))
    with pytest.raises(TypeError, match=r"one Tensor shaped like the concatenated activation \[B, 19\]"):
        emb.apply_gradients({"a": torch.ones(6, 4)})
    bad = torch.ones(6, 19)
    bad[2, 13] = float("nan")  # in table t2's columns (feature c)
    with pytest.raises(ValueError, match=r"table 't2'.*NaN or Inf"):
        emb.apply_gradients(bad)
    assert_same(snapshot(emb), before)
    emb.apply_gradients(torch.ones_like(joined))  # the lookup is still there: a good gradient applies
    assert not torch.equal(snapshot(emb)["t2"], before["t2"])


def test_no_gradient_is_a_logged_zero_gradient(caplog: pytest.LogCaptureFixture) -> None:
    emb = _make(True)
    features, weights = _batch(2)
    emb(features, weights)
    before = snapshot(emb)
    emb.apply_gradients()  # no backward reached the activation
    assert "no gradient reached the concatenated activation" in caplog.text
    after = snapshot(emb)
    assert torch.equal(after["t0"], before["t0"]) and torch.equal(after["t2"], before["t2"])


def test_features_that_do_not_pool_to_one_row_per_example_are_refused() -> None:
    seq = et.TableConfig(10, 4, name="s")
    with pytest.raises(ValueError, match=r"feature 'x'.*sequence feature.*concat_activations=False"):
        et.DistributedEmbedding(
            {"x": et.FeatureConfig(seq, max_sequence_length=3)}, et.SGD(0.1), concat_activations=True
        )
    with pytest.raises(ValueError, match=r"feature 'x'.*output_shape is \[2, 3\]"):
        et.DistributedEmbedding({"x": et.FeatureConfig(seq, output_shape=[2, 3])}, et.SGD(0.1), concat_activations=True)
    with pytest.raises(TypeError, match="concat_activations"):
        et.DistributedEmbedding({"x": et.FeatureConfig(seq)}, et.SGD(0.1), concat_activations=1)  # type: ignore[arg-type]


def test_features_of_different_batch_sizes_are_refused_at_enqueue() -> None:
    emb = _make(True)
    features, weights = _batch(3)
    features["c"] = torch.randint(0, 20, (5,))  # 5 examples where the others have 6
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"feature 'c'.*same batch.*gives \[6\] and this one \[5\]"):
        emb(features, weights)
    features["c"] = torch.randint(0, 20, (6, 2))  # dense [B, L]: every element its own lookup, [6, 2] bags
    with pytest.raises(ValueError, match=r"feature 'c'.*\[6, 2\]"):
        emb(features, weights)
    with pytest.raises(RuntimeError, match="nothing was enqueued"):
        emb.dequeue()
    assert_same(snapshot(emb), before)


def _sharded_concat(rank: int, world: int, strategy: str) -> None:
    """Each rank trains its half of the global batch; the concatenated module equals the nest one."""
    nest, cat = _make(False, sharding=strategy), _make(True, sharding=strategy)
    for step in range(3):
        features, weights = _batch(step * world + rank)
        acts, joined = nest(features, weights), cat(features, weights)
        assert torch.equal(joined, torch.cat([acts[k] for k in ORDER], dim=1))
        grad = _gradient(step * world + rank, 6, 19)
        cat.apply_gradients(grad)
        nest.apply_gradients({k: g.contiguous() for k, g in _columns(grad, cat).items()})
    # a bad gradient on rank 1 only is refused on every rank
    features, weights = _batch(99)
    joined = cat(features, weights)
    with pytest.raises(ValueError, match=r"gradient shape|rank 1"):
        cat.apply_gradients(torch.ones(6, 5) if rank == 1 else torch.ones_like(joined))
    cat.apply_gradients(torch.zeros_like(joined))
    nest.apply_gradients({k: torch.zeros_like(v) for k, v in nest(features, weights).items()})
    full_nest, full_cat = nest.state_dict(), cat.state_dict()
    for key in full_nest:
        assert torch.equal(full_nest[key], full_cat[key]), key


@pytest.mark.parametrize("strategy", ["div", "table"])
def test_sharded_concat_equals_the_nest_on_two_processes(strategy: str) -> None:
    run_world(_sharded_concat, 2, strategy)


def test_an_overflowing_lookup_names_its_feature(kernel_path: str) -> None:
    emb = _make(True).eval()
    state = emb.state_dict()
    state["t1"] = torch.full((30, 8), 3e38)
    emb.load_state_dict(state)
    features, weights = _batch(4)
    with pytest.raises(ValueError, match=r"feature 'b' \(table 't1'\).*overflow"):
        emb(features, weights)


def test_dynamic_tables_concatenate_like_fixed_ones() -> None:
    """A dynamic table's keys (any int64) pooled beside a fixed table's ids: the same as the nest."""

    def make(concat: bool) -> et.DistributedEmbedding:
        dynamic = et.DynamicVocabulary(admit_after=1, eviction="lru")
        keyed = et.TableConfig(20, 4, name="d", dynamic=dynamic, initializer=et.Constant(0.1))
        fixed = et.TableConfig(10, 3, name="u", initializer=et.Constant(0.2))
        features = {"k": et.FeatureConfig(keyed), "x": et.FeatureConfig(fixed)}
        return et.DistributedEmbedding(features, et.Adagrad(0.1), concat_activations=concat)

    nest, cat = make(False), make(True)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        features = {
            "k": torch.randint(-(2**62), 2**62, (6,), generator=gen),
            "x": torch.randint(0, 10, (6,), generator=gen),
        }
        acts, joined = nest(features), cat(features)
        assert torch.equal(torch.cat([acts["k"], acts["x"]], dim=1), joined)
        grad = torch.randn(6, 7, generator=gen)
        nest.apply_gradients({"k": grad[:, :4].contiguous(), "x": grad[:, 4:].contiguous()})
        cat.apply_gradients(grad)
    assert_same(snapshot(cat), snapshot(nest))
    assert torch.equal(cat.vocabulary("d")[0], nest.vocabulary("d")[0])


def test_a_module_pickled_before_concat_activations_existed_still_loads_and_trains() -> None:
    import pickle

    emb = _make(False)
    older = pickle.loads(pickle.dumps(emb))
    del older.__dict__["_concat"], older._pipeline.__dict__["concat"]  # what an earlier version pickled
    revived = pickle.loads(pickle.dumps(older))
    assert revived.activation_columns == {}
    features, weights = _batch(5)
    acts = revived(features, weights)
    revived.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})


def test_a_concatenated_module_pickled_before_column_blocks_still_trains_the_same_bits() -> None:
    import pickle

    emb = _make(True)
    older = pickle.loads(pickle.dumps(emb))
    del older._concat.__dict__["starts"]  # what an earlier version pickled
    revived = pickle.loads(pickle.dumps(older))
    assert revived._concat.starts == emb._concat.starts
    for step in range(2):
        features, weights = _batch(step)
        for module in (emb, revived):
            joined = module(features, weights)
            module.apply_gradients(_gradient(step, joined.shape[0], joined.shape[1]))
    assert_same(snapshot(emb), snapshot(revived))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_gradient_is_refused_naming_the_feature() -> None:
    """The gradient checks' fast path must not reach a nested tensor's (missing) shape: the refusal names the
    feature and the fix, and nothing changes."""
    emb = _make(False)
    features, weights = _batch(6)
    acts = emb(features, weights)
    before = snapshot(emb)
    grads: dict[str, Any] = {k: torch.ones_like(v) for k, v in acts.items()}
    grads["b"] = torch.nested.nested_tensor([torch.ones(8)] * 6)
    with pytest.raises(TypeError, match=r"feature 'b'.*dense \(strided\) tensor.*nested"):
        emb.apply_gradients(grads)
    assert_same(snapshot(emb), before)


def test_every_layout_of_the_concatenated_gradient_trains_the_same_bits() -> None:
    """A float32 CPU gradient with unit column stride is checked whole and phase 1 reads its column blocks; a
    transposed one, float64, or one that requires grad goes through the per-feature check (copies as needed).
    Every form trains the same bits."""
    results = []
    for form in ("contiguous", "wide_buffer", "transposed", "float64", "requires_grad"):
        emb = _make(True)
        for step in range(3):
            features, weights = _batch(step)
            joined = emb(features, weights)
            grad = _gradient(step, joined.shape[0], joined.shape[1])
            if form == "wide_buffer":  # rows 25 floats apart: a column slice of a wider buffer
                grad = torch.cat([grad, torch.zeros(grad.shape[0], 6)], dim=1)[:, : joined.shape[1]]
            elif form == "transposed":
                grad = grad.t().contiguous().t()
            elif form == "float64":
                grad = grad.double()
            elif form == "requires_grad":
                grad = grad.clone().requires_grad_(True)
            emb.apply_gradients(grad)
        results.append(snapshot(emb))
    for other in results[1:]:
        assert_same(results[0], other)
