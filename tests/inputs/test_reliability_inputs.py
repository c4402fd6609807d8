"""Issue 6, input and state classes: input structure (7), state keys (5), autograd leaks (8), unsigned and
float ids, duplicate feature names, variable-batch KJTs (11), contiguous tables (12), messages (13).

Every refused call names the feature or table and leaves every table and slot bit-identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from statecheck import assert_same, snapshot
from torch import Tensor, nn

import embtables as et


def make(combiner: str = "sum", **feature_kwargs: Any) -> et.DistributedEmbedding:
    t = et.TableConfig(20, 4, name="t", initializer=et.TruncatedNormal(seed=0), combiner=combiner)
    return et.DistributedEmbedding({"f": et.FeatureConfig(t, **feature_kwargs)}, et.Adagrad(0.1))


# ---------------------------------------------------------------------------------------------
# 7. Input structure.
# ---------------------------------------------------------------------------------------------
def test_narrowed_jagged_nested_tensor_reads_only_visible_elements(kernel_path: str) -> None:
    base = torch.tensor([[1, 2, 99, 99, 99], [3, 4, 5, 99, 99], [6, 99, 99, 99, 99], [99, 7, 8, 9, 10]])
    starts, lengths = torch.tensor([0, 0, 0, 1]), torch.tensor([2, 3, 1, 4])
    holes = torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    m = make()
    m.eval()
    got = m({"f": holes})["f"]  # 99 >= V=20 would raise if a hidden element were read
    want = m({"f": et.Ragged.from_lists([[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]])})["f"]
    assert torch.equal(got, want)


def test_sparse_indices_outside_the_shape_raise(kernel_path: str) -> None:
    m = make()
    before = snapshot(m)
    for idx in ([[0, 1], [0, 5]], [[0, 2], [0, 0]], [[0, -1], [0, 0]]):  # column 5 >= 3, row 2 >= 2, row -1
        bad = torch.sparse_coo_tensor(torch.tensor(idx), torch.tensor([1, 2]), (2, 3))
        with pytest.raises(ValueError, match=r"feature 'f'.*outside its shape \[2, 3\]"):
            m({"f": bad})
    assert_same(snapshot(m), before)


class DuckKJT:
    """The parts of TorchRec's ``KeyedJaggedTensor`` API that embtables reads (duck-typed)."""

    def __init__(
        self,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride_per_key: list[int] | None = None,
    ) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights
        self._spk = stride_per_key

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def stride(self) -> int:
        return max(self._spk) if self._spk else self._lengths.numel() // len(self._keys)

    def variable_stride_per_key(self) -> bool:
        return self._spk is not None

    def stride_per_key(self) -> list[int]:
        return self._spk if self._spk else [self.stride()] * len(self._keys)


def _two_features() -> et.DistributedEmbedding:
    t = et.TableConfig(20, 4, name="t", initializer=et.TruncatedNormal(seed=0), combiner="sum")
    return et.DistributedEmbedding({"a": et.FeatureConfig(t), "b": et.FeatureConfig(t)}, et.Adagrad(0.1))


def test_kjt_duplicate_keys_raise(kernel_path: str) -> None:
    m = _two_features()
    before = snapshot(m)
    kjt = DuckKJT(["a", "b", "a"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"duplicate keys \['a'\]"):
        m(kjt)
    assert_same(snapshot(m), before)


def test_kjt_variable_batch_is_split_per_key(kernel_path: str) -> None:
    m = _two_features()
    m.eval()
    # key a: batch 2 ([1, 2], [3]); key b: batch 3 ([4], [], [5, 6])
    kjt = DuckKJT(["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 1, 1, 0, 2]), stride_per_key=[2, 3])
    acts = m(kjt)
    assert tuple(acts["a"].shape) == (2, 4) and tuple(acts["b"].shape) == (3, 4)
    table = m.embedding_tables["t"]
    assert torch.equal(acts["b"][2], table[5] + table[6])
    assert torch.equal(acts["b"][1], torch.zeros(4))
    # A fixed-stride KJT whose lengths do not fit keys x stride is refused, never split wrongly.
    bad = DuckKJT(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="lengths"):
        m(bad)


def test_unsigned_ids(kernel_path: str) -> None:
    m = make()
    m.eval()
    want = m({"f": torch.tensor([[1, 2]])})["f"]
    for dtype in (torch.uint8, torch.uint16, torch.uint32):
        assert torch.equal(m({"f": torch.tensor([[1, 2]], dtype=dtype)})["f"], want)
    with pytest.raises(TypeError, match=r"feature 'f'.*uint64.*int64"):
        m({"f": torch.tensor([[1, 2]], dtype=torch.uint64)})


def test_float_ids_in_ragged_from_lists_are_refused() -> None:
    with pytest.raises(TypeError, match=r"1\.9"):
        et.Ragged.from_lists([[1, 1.9]])
    with pytest.raises(TypeError, match="True"):
        et.Ragged.from_lists([[True]])
    assert et.Ragged.from_lists([[0.5, 2.0]], dtype=torch.float32).values.dtype == torch.float32  # weights


def test_duplicate_feature_names_are_refused() -> None:
    t = et.TableConfig(5, 2, name="t")
    with pytest.raises(ValueError, match="two features are named 'clicks'"):
        et.DistributedEmbedding(
            {"a": et.FeatureConfig(t, name="clicks"), "b": et.FeatureConfig(t, name="clicks")}, et.SGD(0.1)
        )


# ---------------------------------------------------------------------------------------------
# 5. State keys cannot collide.
# ---------------------------------------------------------------------------------------------
def test_table_names_that_collide_with_slot_keys_are_refused() -> None:
    x = et.TableConfig(5, 2, name="x", optimizer=et.Adagrad(0.1))
    clash = et.TableConfig(5, 2, name="x/accumulators", optimizer=et.SGD(0.1))
    with pytest.raises(ValueError, match=r"'x/accumulators' is also the key of a slot or the row ids of table 'x'"):
        et.DistributedEmbedding({"a": et.FeatureConfig(x), "b": et.FeatureConfig(clash)})
    for bad in ("/x", "x/", "a//b"):
        with pytest.raises(ValueError, match="ambiguous"):
            et.DistributedEmbedding({"a": et.FeatureConfig(et.TableConfig(5, 2, name=bad))}, et.SGD(0.1))
    # A '/' that collides with nothing is fine, and every tensor has its own key.
    ok = et.TableConfig(5, 2, name="x/velocity_table", optimizer=et.SGD(0.1))
    m = et.DistributedEmbedding({"a": et.FeatureConfig(x), "b": et.FeatureConfig(ok)})
    assert sorted(m.state_dict()) == ["x", "x/accumulators", "x/velocity_table"]


# ---------------------------------------------------------------------------------------------
# 8, 12. Tables are plain, contiguous leaf storage of their own.
# ---------------------------------------------------------------------------------------------
def test_pretrained_parameter_initializer_does_not_leak_autograd(kernel_path: str) -> None:
    pretrained = nn.Parameter(torch.randn(10, 4))
    snapshot_of_pretrained = pretrained.detach().clone()
    t = et.TableConfig(10, 4, name="t", initializer=lambda shape, dtype: pretrained * 1.0)  # non-leaf with grad_fn
    t2 = et.TableConfig(10, 4, name="t2", initializer=lambda shape, dtype: pretrained)
    m = et.DistributedEmbedding({"a": et.FeatureConfig(t), "b": et.FeatureConfig(t2)}, et.Adagrad(0.1))
    for table in m.embedding_tables.values():
        assert table.grad_fn is None and not table.requires_grad and table.is_contiguous()
        assert table.data_ptr() != pretrained.data_ptr()
    for _ in range(3):
        acts = m({"a": torch.tensor([[1, 2]]), "b": torch.tensor([[3]])})
        (acts["a"].sum() + acts["b"].sum()).backward()
        m.apply_gradients()
    assert pretrained.grad is None
    assert torch.equal(pretrained.detach(), snapshot_of_pretrained)
    for table in m.embedding_tables.values():
        assert table.grad_fn is None


def test_transposed_initializer_gives_contiguous_tables() -> None:
    t = et.TableConfig(6, 4, name="t", initializer=lambda shape, dtype: torch.randn(shape[1], shape[0]).t())
    opt = et.Adagrad(0.1, slot_variable_creation_fn=lambda table, names, inits: {"accumulators": torch.ones(4, 6).t()})
    m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, opt)
    for tensor in m.state_dict().values():
        assert tensor.is_contiguous()
    m.to("cpu")
    for tensor in m.state_dict().values():
        assert tensor.is_contiguous()


# ---------------------------------------------------------------------------------------------
# 13. Messages.
# ---------------------------------------------------------------------------------------------
def test_huge_tables_get_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"table 'huge'.*TiB.*vocabulary_size"):
        et.DistributedEmbedding({"f": et.FeatureConfig(et.TableConfig(10**13, 64, name="huge"))}, et.SGD(0.1))


def test_sparse_gradient_gets_a_clear_error(kernel_path: str) -> None:
    m = make()
    before = snapshot(m)
    acts = m({"f": torch.tensor([[1, 2]])})
    with pytest.raises(TypeError, match=r"feature 'f'.*dense.*to_dense"):
        m.apply_gradients({"f": torch.ones_like(acts["f"]).to_sparse()})
    assert_same(snapshot(m), before)


def test_narrowed_jagged_nested_tensor_trains_like_its_ragged_twin(kernel_path: str) -> None:
    base = torch.tensor([[1, 2, 99], [3, 99, 99], [99, 4, 5]])
    holes = torch.nested.narrow(base, 1, torch.tensor([0, 0, 1]), torch.tensor([2, 1, 2]), layout=torch.jagged)
    twin = et.Ragged.from_lists([[1, 2], [3], [4, 5]])
    states = []
    for x in (holes, twin):
        m = make()
        acts = m({"f": x})
        m.apply_gradients({"f": torch.ones_like(acts["f"])})
        states.append(snapshot(m))
    assert_same(states[0], states[1])  # hidden elements (99 >= V) were never looked up or updated


def test_slot_creation_fn_outputs_are_detached_owned_storage() -> None:
    pretrained = nn.Parameter(torch.ones(6, 4))

    def make_slots(table: Tensor, names: list[str], inits: list[Any]) -> dict[str, Tensor]:
        return {"accumulators": pretrained * 0.5}  # a non-leaf with a grad_fn

    t = et.TableConfig(6, 4, name="t", initializer=et.Constant(0.1))
    m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1, slot_variable_creation_fn=make_slots))
    acc = m.slot_variables["t"]["accumulators"]
    assert acc.grad_fn is None and not acc.requires_grad and acc.is_contiguous()
    acts = m({"f": torch.tensor([[1, 2]])})
    acts["f"].sum().backward()
    m.apply_gradients()
    assert pretrained.grad is None and torch.equal(pretrained.detach(), torch.ones(6, 4))
