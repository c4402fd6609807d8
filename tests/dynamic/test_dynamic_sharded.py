"""Dynamic tables over W = 2 and 3 gloo processes (spec §11.4): every key's row trajectory equals one
process's, statistics add up, a refused batch changes no map, and checkpoints and state dicts move keys
between any world sizes (W = 2 into one process and into W = 3)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mp_world import run_world

import embtables as et
from embtables.sharding.dynamic_keys import splitmix64

BATCH, DIM, CAPACITY = 6, 3, 60
POOL = [*range(-12, 12), 2**63 - 1, -(2**63), 10**15, 2**40]  # 28 keys: no rank's rows ever fill up


def _module(sharding: str = "div", capacity: int = CAPACITY, pipelined: bool = False) -> et.DistributedEmbedding:
    policy = et.DynamicVocabulary(admit_after=2, eviction="lru", ttl_steps=5)
    user = et.TableConfig(capacity, DIM, name="user", initializer=et.Constant(0.05), dynamic=policy)
    item = et.TableConfig(16, DIM, name="item", initializer=et.Constant(0.02))
    features = {"u": et.FeatureConfig(user), "h": et.FeatureConfig(user), "i": et.FeatureConfig(item)}
    # without gradient accumulation every occurrence applies in one process's order: bit-identical throughout
    return et.DistributedEmbedding(
        features,
        et.Adagrad(0.2, use_gradient_accumulation=False),
        sharding=sharding,
        pipeline_execution_with_tensor_core=pipelined,
    )


def _global_batches(
    steps: int, seed: int
) -> list[tuple[list[int], list[list[int]], list[int], dict[str, torch.Tensor]]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        u = [rng.choice(POOL) for _ in range(BATCH)]
        h = [[rng.choice(POOL) for _ in range(rng.randint(0, 3))] for _ in range(BATCH)]
        i = [rng.randrange(16) for _ in range(BATCH)]
        grads = {k: torch.randn(BATCH, DIM, generator=gen) for k in ("u", "h", "i")}
        out.append((u, h, i, grads))
    return out


def _train(m: et.DistributedEmbedding, batches: list, lo: int, hi: int) -> list[dict[str, torch.Tensor]]:
    """Train on samples [lo, hi) of every global batch; returns the activations of each step."""
    acts = []
    for u, h, i, grads in batches:
        out = m({"u": torch.tensor(u[lo:hi]), "h": et.Ragged.from_lists(h[lo:hi]), "i": torch.tensor(i[lo:hi])})
        acts.append({k: v.detach().clone() for k, v in out.items()})
        m.apply_gradients({k: g[lo:hi] for k, g in grads.items()})
    return acts


def _per_key(m: et.DistributedEmbedding) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{key: (weights row, accumulator row)} of the dynamic table (collective when sharded)."""
    keys, rows = m.vocabulary("user")
    state = m.state_dict()
    return {int(k): (state["user"][int(r)], state["user/accumulators"][int(r)]) for k, r in zip(keys, rows)}


def _assert_same_keys(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]), k


def _reference(path: Path, pipelined: bool) -> None:
    """The one-process run (in the pytest process: inside a world every module is sharded)."""
    single = _module(pipelined=pipelined)
    acts = _train(single, _global_batches(10, seed=1), 0, BATCH)
    stats = single.vocabulary_statistics()["user"]
    torch.save({"acts": acts, "per_key": _per_key(single), "stats": stats}, path)


def _equivalence(rank: int, world: int, sharding: str, pipelined: bool, ref_path: str) -> None:
    batches = _global_batches(10, seed=1)
    ref = torch.load(ref_path)
    single_acts = ref["acts"]
    sharded = _module(sharding, pipelined=pipelined)
    per = BATCH // world
    acts = _train(sharded, batches, rank * per, (rank + 1) * per)
    for step, (mine, want_acts) in enumerate(zip(acts, single_acts)):
        for k in mine:
            assert torch.equal(mine[k], want_acts[k][rank * per : (rank + 1) * per]), (step, k)
    _assert_same_keys(_per_key(sharded), ref["per_key"])
    got, want = sharded.vocabulary_statistics()["user"], ref["stats"]
    for name in ("admitted", "evicted", "expired", "rejected", "live", "pending"):
        assert got[name] == want[name], name
    assert want["admitted"] > 0 and want["expired"] > 0
    # a refused batch (one rank's ids are floats): every rank raises, no key map changes anywhere
    before = sharded.vocabulary_statistics()
    bad = torch.tensor([0.5] * per) if rank == world - 1 else torch.tensor(batches[0][0][rank * per : (rank + 1) * per])
    with pytest.raises((TypeError, ValueError)):
        sharded({"u": bad, "h": et.Ragged.from_lists([[1]] * per), "i": torch.zeros(per, dtype=torch.int64)})
    assert sharded.vocabulary_statistics() == before


@pytest.mark.parametrize(
    "world,sharding,pipelined", [(2, "div", False), (3, "mod", False), (2, "table", False), (2, "div", True)]
)
def test_sharded_dynamic_tables_equal_one_process(world: int, sharding: str, pipelined: bool, tmp_path: Path) -> None:
    _reference(tmp_path / "reference.pt", pipelined)
    run_world(_equivalence, world, sharding, pipelined, str(tmp_path / "reference.pt"))


def _save_w2(rank: int, world: int, root: str) -> None:
    m = _module()
    per = BATCH // world
    _train(m, _global_batches(8, seed=2), rank * per, (rank + 1) * per)
    m.save(Path(root) / "ckpt")
    state = m.state_dict()
    keys = _per_key(m)
    if rank == 0:
        torch.save({"state": state, "per_key": keys}, Path(root) / "reference.pt")


def _restore_w3(rank: int, world: int, root: str) -> None:
    ref = torch.load(Path(root) / "reference.pt")
    m = _module("mod")  # another world size and strategy: keys move to their new owners
    m.restore(Path(root) / "ckpt")
    _assert_same_keys(_per_key(m), ref["per_key"])
    n = _module("div")
    n.load_state_dict(ref["state"])  # a W = 2 state dict into W = 3
    _assert_same_keys(_per_key(n), ref["per_key"])
    small = _module(capacity=12)  # fewer rows than a rank's live keys: refused on every rank, nothing changed
    with pytest.raises(et.CheckpointError, match="Raise vocabulary_size"):
        small.restore(Path(root) / "ckpt")
    assert small.vocabulary_statistics()["user"]["live"] == 0


def test_checkpoints_move_keys_between_world_sizes(tmp_path: Path) -> None:
    run_world(_save_w2, 2, str(tmp_path))
    ref = torch.load(tmp_path / "reference.pt")
    assert len(ref["per_key"]) > 5
    one = _module()
    one.restore(tmp_path / "ckpt")  # W = 2 into one process
    _assert_same_keys(_per_key(one), ref["per_key"])
    two = _module(capacity=30)  # a smaller capacity that still holds every key
    two.restore(tmp_path / "ckpt")
    _assert_same_keys(_per_key(two), ref["per_key"])
    run_world(_restore_w3, 3, str(tmp_path))
    assert not dist.is_initialized()


def _eval_rows(m: et.DistributedEmbedding, keys: list[int]) -> torch.Tensor:
    """Eval activations [N, D] of ``keys`` through feature u (a key without a row reads zeros)."""
    m.eval()
    items = torch.zeros(len(keys), dtype=torch.int64)
    out = m({"u": torch.tensor(keys), "h": et.Ragged.from_lists([[k] for k in keys]), "i": items})
    m.train()
    return out["u"]


def _one_process_state(path: Path) -> None:
    """A state dict trained in one process, its eval rows of every key, and the per-key state after
    four more steps (in the pytest process: inside a world every module is sharded)."""
    single = _module()
    _train(single, _global_batches(6, seed=3), 0, BATCH)
    state = {k: v.clone() for k, v in single.state_dict().items()}
    rows = _eval_rows(single, POOL)
    _train(single, _global_batches(4, seed=4), 0, BATCH)
    torch.save({"state": state, "rows": rows, "per_key": _per_key(single)}, path)


def _load_one_process_state(rank: int, world: int, sharding: str, root: str) -> None:
    ref = torch.load(Path(root) / "reference.pt")
    m = _module(sharding)
    m.load_state_dict(ref["state"])  # keys move to the ranks that own them here
    mine = POOL[rank::world]
    assert torch.equal(_eval_rows(m, mine), ref["rows"][rank::world])  # every key reads its own row
    per = BATCH // world
    _train(m, _global_batches(4, seed=4), rank * per, (rank + 1) * per)  # no key is admitted twice
    _assert_same_keys(_per_key(m), ref["per_key"])
    m.save(Path(root) / f"ckpt-{sharding}")  # and the checkpoints after it restore
    # 40 live keys that rank 0 owns here, in a state dict of 60 rows: more than its rows; refused on
    # every rank, nothing loaded.
    crowded = {k: v.clone() for k, v in ref["state"].items()}
    keys = [k for k in range(10_000) if int(splitmix64(torch.tensor([k]))[0]) % world == 0][:40]
    for field in ("keys", "counts", "age", "order"):
        crowded[f"user/{field}"].zero_()
    crowded["user/keys"][:40] = torch.tensor(keys)
    crowded["user/counts"][:40] = 1
    crowded["user/order"][:40] = torch.arange(40)
    for field in ("pending_keys", "pending_counts", "pending_age"):
        crowded[f"user/{field}"] = torch.zeros(0, dtype=torch.int64)
    fresh = _module(sharding)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"rank 0 owns 40 .*Raise vocabulary_size"):
        fresh.load_state_dict(crowded)
    assert fresh.vocabulary_statistics()["user"]["live"] == 0
    after = fresh.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # no table, slot or vocabulary changed


@pytest.mark.parametrize("world,sharding", [(2, "div"), (3, "mod")])
def test_a_state_dict_from_one_process_moves_keys_to_their_owners(world: int, sharding: str, tmp_path: Path) -> None:
    _one_process_state(tmp_path / "reference.pt")
    run_world(_load_one_process_state, world, sharding, str(tmp_path))
    ref = torch.load(tmp_path / "reference.pt")
    one = _module()
    one.restore(tmp_path / f"ckpt-{sharding}")
    _assert_same_keys(_per_key(one), ref["per_key"])
