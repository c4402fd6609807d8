"""Dynamic tables on the small-batch fast path (spec §11; ``dynamic_vocabularies.Vocabularies.translate``).

A step staged whole (unweighted int64 inputs) whose every key of a dynamic table has a row gets the rows
written over the keys in the staging arena, the batches staying the staged ones, so the fast path's one native
call a phase serves it; a step where some key has no row takes the general path. Either way the bits are those
of the general native path and of the torch reference, and a staged step translated again reads its keys as
staged.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from statecheck import assert_paths_agree

import embtables as et
from embtables.kernels import native_library
from embtables.tables.backends.native_fast_path import NativeFastPath

KEYS = [3, 2**62 + 7, 10**15, 0, 77, 78, 79, 1000, 5, 6, 2**40, 123456789]
BATCH = 6


def _module(admit_after: int, pipelined: bool = False) -> et.DistributedEmbedding:
    policy = et.DynamicVocabulary(admit_after=admit_after, eviction="lru")
    shared = et.TableConfig(16, 4, name="shared", combiner="mean", dynamic=policy, initializer=et.Constant(0.1))
    own = et.TableConfig(20, 6, name="own", combiner="sum", dynamic=policy, initializer=et.Constant(-0.2))
    fixed = et.TableConfig(30, 5, name="fixed", combiner="sum", initializer=et.Constant(0.3))
    features = {
        "a": et.FeatureConfig(shared),
        "b": et.FeatureConfig(shared),
        "c": et.FeatureConfig(own),
        "d": et.FeatureConfig(fixed),
    }
    optimizer = et.Adagrad(0.1, initial_accumulator_value=0.1)
    return et.DistributedEmbedding(features, optimizer, pipeline_execution_with_tensor_core=pipelined)


def _inputs(step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Unweighted int64 inputs (staged whole natively): a ragged feature, dense ones, and their gradients."""
    rng = random.Random(step)
    g = torch.Generator().manual_seed(step)
    bags = [[rng.choice(KEYS) for _ in range(rng.randint(1, 3))] for _ in range(BATCH)]
    features = {
        "a": et.Ragged.from_lists(bags),
        "b": torch.tensor([rng.choice(KEYS) for _ in range(BATCH)]),
        "c": torch.tensor([rng.choice(KEYS) for _ in range(BATCH)]),
        "d": torch.tensor([rng.randrange(30) for _ in range(BATCH)]),
    }
    grads = {"a": torch.randn(BATCH, 4, generator=g), "b": torch.randn(BATCH, 4, generator=g),
             "c": torch.randn(BATCH, 6, generator=g), "d": torch.randn(BATCH, 5, generator=g)}  # fmt: skip
    return features, grads


def _train(emb: et.DistributedEmbedding, steps: int) -> list[torch.Tensor]:
    seen = []
    for step in range(steps):
        features, grads = _inputs(step)
        acts = emb(features)
        seen += [acts[k].detach().clone() for k in sorted(acts)]
        emb.apply_gradients(grads)
    emb.flush()  # a pipelined module's held-back update lands
    return seen


@pytest.mark.parametrize("admit_after", [1, 2])
def test_dynamic_steps_take_the_fast_path_with_the_general_paths_bits(
    admit_after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """admit_after=1: every key gets a row, every step takes the fast path. admit_after=2: a step where some key
    is not admitted yet takes the general path (keys without a row leave their bags), the others the fast one."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    served: list[bool] = []
    real_apply = NativeFastPath.apply

    def recorded(self: NativeFastPath, *args: Any) -> bool:
        served.append(real_apply(self, *args))
        return served[-1]

    monkeypatch.setattr(NativeFastPath, "apply", recorded)
    fast = _module(admit_after)
    seen_fast = _train(fast, 8)
    if admit_after == 1:
        assert served == [True] * 8
    else:
        assert served[0] is False and served[-1] is True  # keys pending at first, every one admitted by the end
    reference = assert_paths_agree(
        lambda: _module(admit_after), lambda emb: _train(emb, 8), fast, seen_fast, monkeypatch
    )
    for name in ("shared", "own"):
        assert [torch.equal(x, y) for x, y in zip(fast.vocabulary(name), reference.vocabulary(name))] == [True] * 2


def test_a_staged_step_translated_again_reads_its_keys_as_staged() -> None:
    """The rows written over a staged step's keys are undone before it is translated again (the keys are kept
    beside the arena): both translations give the same rows, in the staged batches themselves."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    emb = _module(1)
    _train(emb, 3)  # every key of _inputs(0) has a row now
    features, _ = _inputs(0)
    batches = emb._inputs.stage(features, None, torch.device("cpu"), set())
    assert batches[0].staged is not None  # staged whole: the in-place translation applies
    keys = [b.ids.clone() for b in batches]
    vocabularies = emb._engine.local.vocabularies
    first, _ = vocabularies.translate(batches, False, 3, 3)
    rows = [b.ids.clone() for b in first]
    assert all(x is y for x, y in zip(first, batches))  # the staged batches, holding rows now
    assert not all(torch.equal(r, k) for r, k in zip(rows[:3], keys[:3]))
    again, _ = vocabularies.translate(batches, False, 3, 3)
    assert all(x is y for x, y in zip(again, batches))
    assert all(torch.equal(b.ids, r) for b, r in zip(again, rows))
    assert torch.equal(batches[3].ids, keys[3])  # the fixed table's ids untouched


def test_pipelined_dynamic_steps_staged_whole_keep_the_general_paths_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined (each update held back until after the next lookup, which must not evict its rows): the rows
    written over a step's keys stay in its arena until its update lands (the arena is busy until then)."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    looked_up: list[bool] = []
    real_lookup = NativeFastPath.lookup

    def recorded(self: NativeFastPath, *args: Any) -> Any:
        out = real_lookup(self, *args)
        looked_up.append(out is not None)
        return out

    monkeypatch.setattr(NativeFastPath, "lookup", recorded)
    fast = _module(2, pipelined=True)
    seen = _train(fast, 8)
    assert looked_up[0] is False and looked_up[-1] is True  # the last steps' rows, in place, on the fast path
    reference = assert_paths_agree(lambda: _module(2, True), lambda emb: _train(emb, 8), fast, seen, monkeypatch)
    for name in ("shared", "own"):
        assert [torch.equal(x, y) for x, y in zip(fast.vocabulary(name), reference.vocabulary(name))] == [True] * 2
