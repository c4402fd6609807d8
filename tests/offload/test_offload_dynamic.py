"""A dynamic vocabulary over an offloaded table (docs/offload.md, "Dynamic vocabularies"): the key map gives keys
rows of the table, the row cache holds those rows, so the table trains to the bits of the same dynamic table in
memory while its key map evicts keys and reuses rows and its cache writes rows back and reads them again; a batch
whose keys the cache could not hold is refused before the key map changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp_world import run_world

import embtables as et

V, D = 48, 16  # rows the key map hands out (100 hot keys compete for them); keys up to 10**12


def _features(directory: Path | None, cache_rows: int = 32, **half: Any) -> dict[str, et.FeatureConfig]:
    offload = et.Offload(directory, cache_rows) if directory is not None else None
    policy = et.DynamicVocabulary(admit_after=1, eviction="lfu")
    user = et.TableConfig(V, D, name="user", combiner="sum", dynamic=policy, offload=offload,
                          initializer=et.TruncatedNormal(seed=5), **half)  # fmt: skip
    return {"u": et.FeatureConfig(user), "s": et.FeatureConfig(user, max_sequence_length=2)}


def _batch(step: int, lo: int = 0, hi: int = 4) -> dict[str, Any]:
    """The batch of ``step`` (4 samples), or its samples [lo, hi) (a rank's part)."""
    g = torch.Generator().manual_seed(30 + step)
    hot = torch.randint(0, 100, (4, 2), generator=g) * 7_919_000_001  # keys seen again and again
    cold = torch.randint(0, 10**12, (4, 1), generator=g)  # keys seen once: each takes a row for a while
    fresh = torch.randint(0, 600, (4, 1), generator=g) * 1_000_003 + step % 3  # keys that come and go
    return {"u": torch.cat([hot, cold, fresh], dim=1)[lo:hi], "s": et.Ragged.from_lists(hot[lo:hi].tolist())}


@pytest.mark.parametrize(
    ("pipelined", "half"),
    [
        (False, {}),
        (True, {}),
        (False, {"dtype": torch.bfloat16}),  # rounded by key: the cache keeps each slot's key
        (True, {"dtype": torch.float16, "slot_dtype": torch.float16}),
    ],
)
def test_a_dynamic_offloaded_table_trains_to_the_bits_of_the_dynamic_table_in_memory(
    pipelined: bool, half: dict[str, Any], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    off = et.DistributedEmbedding(_features(tmp_path / "rows", **half), et.Adagrad(0.2),
                                  pipeline_execution_with_tensor_core=pipelined)  # fmt: skip
    twin = et.DistributedEmbedding(_features(tmp_path / "twin", **half), et.Adagrad(0.2))  # initial rows, lazily
    ref = et.DistributedEmbedding(_features(None, **half), et.Adagrad(0.2),
                                  pipeline_execution_with_tensor_core=pipelined)  # fmt: skip
    ref.load_state_dict(twin.state_dict())
    del twin
    for step in range(30):
        got, want = off(_batch(step)), ref(_batch(step))
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)
        g = torch.Generator().manual_seed(700 + step)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in sorted(want.items())}
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
    want_state = ref.state_dict()
    for key, value in off.state_dict().items():
        assert torch.equal(value, want_state[key]), key
    vocabulary = off.vocabulary_statistics()["user"]
    stats = off.offload_statistics()["user"]
    assert vocabulary["evicted"] > 0, vocabulary  # rows handed to new keys again
    assert stats["evictions"] > 0 and stats["rows_written"] > 0 and stats["rows_read"] > 0, stats


def test_a_batch_whose_keys_the_cache_cannot_hold_is_refused_before_the_key_map_changes(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_features(tmp_path / "rows", cache_rows=8), et.Adagrad(0.2))
    emb({"u": torch.tensor([[1, 2]]), "s": et.Ragged.from_lists([[1]])})
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    with pytest.raises(ValueError, match=r"distinct keys .* more than Offload\(cache_rows=8\) holds.*Nothing"):
        emb({"u": torch.arange(20).reshape(2, 10), "s": et.Ragged.from_lists([[1]])})
    after = emb.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k  # the vocabulary fields too: no key was counted or admitted


def _sharded(rank: int, world: int, root: str) -> None:
    """On each rank: the dynamic offloaded table sharded over the W ranks against the same sharded dynamic table
    in memory, bit for bit over 30 steps, div and mod, float32 and bfloat16, pipelined or not; then a batch whose
    keys one rank's cache cannot hold is refused on every rank, every key map and table as it was. Each rank owns
    24 of the 48 rows and caches 22 of them."""
    lo, hi = rank * 4 // world, (rank + 1) * 4 // world
    for k, (sharding, pipelined, half) in enumerate(
        [("div", False, {}), ("mod", True, {}), ("mod", False, {"dtype": torch.bfloat16})]
    ):
        torch.manual_seed(0)
        off = et.DistributedEmbedding(_features(Path(root) / f"{k}", 22, **half), et.Adagrad(0.2), sharding=sharding,
                                      pipeline_execution_with_tensor_core=pipelined)  # fmt: skip
        ref = et.DistributedEmbedding(_features(None, **half), et.Adagrad(0.2), sharding=sharding,
                                      pipeline_execution_with_tensor_core=pipelined)  # fmt: skip
        ref.load_state_dict(off.state_dict())
        for step in range(30):
            got, want = off(_batch(step, lo, hi)), ref(_batch(step, lo, hi))
            for name in want:
                assert torch.equal(got[name], want[name]), (sharding, pipelined, half, step, name)
            g = torch.Generator().manual_seed(700 + step)
            grads = {n: torch.randn((4, *v.shape[1:]), generator=g)[lo:hi] for n, v in sorted(want.items())}
            off.apply_gradients(grads)
            ref.apply_gradients(grads)
        want_state = ref.state_dict()
        for key, value in off.state_dict().items():
            assert torch.equal(value, want_state[key]), (sharding, key)
        stats = off.offload_statistics()["user"]  # summed over the ranks
        assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats
        assert off.vocabulary_statistics()["user"]["evicted"] > 0
        off.close()
    small = et.DistributedEmbedding(_features(Path(root) / "small", cache_rows=8), et.Adagrad(0.2), sharding="mod")
    small({"u": torch.tensor([[1, 2]]), "s": et.Ragged.from_lists([[1]])})
    before = {key: value.clone() for key, value in small.state_dict().items()}
    many = torch.arange(40).reshape(1, 40) + 1000 * rank if rank == 0 else torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match=r"(distinct keys .* more than Offload\(cache_rows=8\)|another rank)"):
        small({"u": many, "s": et.Ragged.from_lists([[1]])})
    after = small.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # the vocabulary fields too: no key map changed
    small({"u": torch.tensor([[5, 6]]), "s": et.Ragged.from_lists([[2]])})  # and the next step trains


@pytest.mark.distributed
def test_a_sharded_dynamic_offloaded_table_trains_to_the_bits_of_the_sharded_table_in_memory(tmp_path: Path) -> None:
    run_world(_sharded, 2, str(tmp_path), timeout=600)
