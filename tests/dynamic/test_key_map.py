"""The native key map (kernels/key_map.py) against the pure-Python reference (tests/oracle/py_key_map.py):
every row, reset list, counter and exported array, step by step, for every policy (spec §11)."""

from __future__ import annotations

import ast
import pickle
import random
import subprocess
import sys

import pytest
import torch
from oracle.py_key_map import PyKeyMap
from subproc import run_python

import embtables as et
from embtables.kernels.key_map import KeyMap, KeyMapState

# Keys from a small pool (so keys repeat, get admitted, evicted and come back), spread over all of int64.
_POOL = [0, 1, -1, 7, 2**63 - 1, -(2**63), 2**40 + 3, -5, 12345678901, 42, 43, 44, 99, -99, 3, 2**62]


def _check_same(native: KeyMap, ref: PyKeyMap) -> None:
    state = native.export()
    got = {"keys": state.keys, "counts": state.counts, "last_step": state.last_step, "order": state.order}
    want = ref.export()
    live = [c > 0 for c in want["counts"]]

    def live_values(values: list[int]) -> list[int]:  # free rows' other fields are unspecified
        return [v for v, keep in zip(values, live) if keep]

    for name in ("keys", "last_step"):
        assert live_values(got[name].tolist()) == live_values(want[name]), name
    # the touch order ranks the live rows (a restore renumbers it from 0, keeping the ranks)
    got_order, want_order = live_values(got["order"].tolist()), live_values(want["order"])
    assert sorted(range(len(got_order)), key=got_order.__getitem__) == sorted(
        range(len(want_order)), key=want_order.__getitem__
    )
    assert got["counts"].tolist() == want["counts"]
    stats = native.stats()
    for name, value in ref.stats.items():
        assert stats[name] == value, name
    assert stats["live"] == len(ref.rows) and stats["pending"] == len(ref.pending)


@pytest.mark.parametrize("eviction", ["lru", "lfu", None])
@pytest.mark.parametrize("admit_after", [1, 3])
@pytest.mark.parametrize("ttl", [None, 2])
@pytest.mark.parametrize("pipelined", [False, True])
def test_native_map_matches_reference(eviction: str | None, admit_after: int, ttl: int | None, pipelined: bool) -> None:
    rng = random.Random(hash((eviction, admit_after, ttl, pipelined)) & 0xFFFF)
    capacity = 5
    policy = et.DynamicVocabulary(admit_after=admit_after, eviction=eviction, ttl_steps=ttl)
    native, ref = KeyMap(capacity, policy), PyKeyMap(capacity, admit_after, eviction, ttl)
    step = 0
    for i in range(120):
        step += rng.choice([1, 1, 1, 2, 4])  # steps with no lookup of this table happen
        keys = [rng.choice(_POOL[: rng.choice([6, 10, 16])]) for _ in range(rng.randint(0, 9))]
        pin = step - 1 if pipelined else step
        rows, reset = native.train(torch.tensor(keys, dtype=torch.int64), step, pin)
        want_rows, want_reset = ref.train(keys, step, pin)
        assert rows.tolist() == want_rows, (i, keys)
        assert reset.tolist() == want_reset
        assert native.find(torch.tensor(_POOL, dtype=torch.int64)).tolist() == ref.find(_POOL)
        _check_same(native, ref)
        if i % 40 == 39:  # a restore keeps the rows and pending keys, not the counters
            native = pickle.loads(pickle.dumps(native))
            ref.restored()
            _check_same(native, ref)


def test_within_one_step_a_key_counts_once_and_rows_never_move() -> None:
    m = KeyMap(2, et.DynamicVocabulary(admit_after=2))
    rows, reset = m.train(torch.tensor([5, 5, 5, 6]), 1, 1)
    assert rows.tolist() == [-1, -1, -1, -1] and reset.numel() == 0
    rows, reset = m.train(torch.tensor([6, 5, 6, 7, 8]), 2, 2)
    assert rows.tolist() == [0, 1, 0, -1, -1] and reset.tolist() == [0, 1]
    # both rows were looked up at step 3: nothing can be evicted, 7 and 8 are rejected, not admitted
    rows, _ = m.train(torch.tensor([5, 6, 7, 8]), 3, 3)
    assert rows.tolist() == [1, 0, -1, -1]
    assert m.stats()["rejected"] == 2
    # eval lookups change nothing
    before = m.export()
    assert m.find(torch.tensor([5, 6, 7])).tolist() == [1, 0, -1]
    after = m.export()
    assert all(torch.equal(getattr(before, f), getattr(after, f)) for f in ("keys", "counts", "last_step", "order"))


def test_no_eviction_fills_then_rejects_until_ttl_frees_rows() -> None:
    m = KeyMap(2, et.DynamicVocabulary(eviction=None, ttl_steps=2))
    assert m.train(torch.tensor([1, 2, 3]), 1, 1)[0].tolist() == [0, 1, -1]
    assert m.stats()["rejected"] == 1
    assert m.train(torch.tensor([1, 3]), 2, 2)[0].tolist() == [0, -1]
    assert m.train(torch.tensor([1]), 3, 3)[0].tolist() == [0]
    rows, reset = m.train(torch.tensor([3]), 4, 4)  # key 2 (last step 1) expired: 3 takes its row
    assert rows.tolist() == [1] and reset.tolist() == [1] and m.stats()["expired"] == 1


def test_load_refuses_inconsistent_state_and_leaves_the_map_empty() -> None:
    m = KeyMap(3, et.DynamicVocabulary())
    m.train(torch.tensor([10, 11, 12]), 1, 1)
    good = m.export()
    twice = KeyMapState(torch.tensor([10, 10, 12]), good.counts, good.last_step, good.order, good.step)
    with pytest.raises(ValueError, match="a key twice"):
        m.load(twice)
    assert m.stats()["live"] == 0 and m.find(torch.tensor([10])).tolist() == [-1]
    future = KeyMapState(good.keys, good.counts, good.last_step + 5, good.order, good.step)
    with pytest.raises(ValueError, match="inconsistent"):
        m.load(future)
    m.load(good)
    assert m.find(torch.tensor([10, 11, 12])).tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="steps never go back"):
        m.train(torch.tensor([10]), 0, 0)


def test_bad_buffers_never_reach_c() -> None:
    m = KeyMap(3, et.DynamicVocabulary())
    with pytest.raises(RuntimeError, match=r"contiguous CPU torch\.int64"):
        m.train(torch.tensor([1.0, 2.0]), 1, 1)
    with pytest.raises(RuntimeError, match=r"contiguous CPU torch\.int64"):
        m.find(torch.arange(10)[::2])


def test_train_many_equals_one_map_at_a_time() -> None:
    rng = random.Random(5)
    policies = [et.DynamicVocabulary(), et.DynamicVocabulary(admit_after=2, eviction="lfu", ttl_steps=3)]
    together = [KeyMap(4, p) for p in policies]
    alone = [KeyMap(4, p) for p in policies]
    for step in range(1, 30):
        keys = [
            torch.tensor([rng.choice(_POOL) for _ in range(rng.randint(0, 8))], dtype=torch.int64) for _ in policies
        ]
        got = KeyMap.train_many(together, keys, step, step)
        for m, k, (rows, reset) in zip(alone, keys, got):
            want_rows, want_reset = m.train(k, step, step)
            assert torch.equal(rows, want_rows) and torch.equal(reset, want_reset)


def test_hostile_states_are_refused_or_loaded_never_a_crash() -> None:
    """Random and extreme states (as a corrupt checkpoint could hold them) go through the native import in
    a child process: each is refused with ValueError or loads, and the map then trains without a crash."""
    out = run_python(
        """
        import random, torch
        import embtables as et
        from embtables.kernels.key_map import KeyMap, KeyMapState
        rng = random.Random(0)
        extremes = [0, 1, -1, 2**62, 2**62 + 1, 2**63 - 1, -(2**63), 7]
        loaded = refused = 0
        for trial in range(400):
            v = rng.choice([1, 3, 8])
            policy = et.DynamicVocabulary(
                admit_after=rng.choice([1, 2]),
                eviction=rng.choice(["lru", "lfu", None]),
                ttl_steps=rng.choice([None, 2]),
            )
            m = KeyMap(v, policy)
            pick = lambda: rng.choice(extremes) if rng.random() < 0.5 else rng.randrange(-5, 10)
            col = lambda n: torch.tensor([pick() for _ in range(n)], dtype=torch.int64)
            p = rng.choice([0, 1, 3, v, v + 1])
            step = rng.choice([0, 5, 2**62, 2**63 - 1])
            state = KeyMapState(col(v), col(v), col(v), col(v), step, col(p), col(p), col(p))
            try:
                m.load(state)
                loaded += 1
            except ValueError:
                refused += 1
            step = max(m.step, 0)
            if step < 2**62:
                m.train(torch.tensor([pick() for _ in range(6)], dtype=torch.int64), step + 1, step + 1)
        print(loaded, refused)
        """
    )
    loaded, refused = (int(x) for x in out.split())
    assert loaded > 0 and refused > 0


_FULL_POOL = """
import torch, embtables as et
user = et.TableConfig(200_000, 4, name="user", dynamic=et.DynamicVocabulary(admit_after=2))
emb = et.DistributedEmbedding({"u": et.FeatureConfig(user)}, et.SGD(0.1))
for _ in range(2):
    emb({"u": torch.arange(300_000) * 7 + 1})
    emb.apply_gradients()
print(emb.vocabulary_statistics()["user"])
"""


def test_a_batch_that_fills_the_pending_pool_costs_linear_time() -> None:
    """300k new keys into a 200k-row table with admit_after=2: once the pending pool was full, every further
    new key swept the whole map again although nothing could be freed (over 100 s; well under a second now).
    Run in a child with a limit far above the linear cost and far below the quadratic one."""
    out = subprocess.run([sys.executable, "-c", _FULL_POOL], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert stats["pending"] == 100_000 and stats["live"] == 200_000 and stats["untracked"] == 100_000
