"""The traffic model (``embtables/sharding/cost_model.py``) predicts, from one step's per-owner id
counts, exactly the bytes every rank sends (``comm.bytes_sent``) at W = 2, 3 and 4, for tables pooled
on their owners and row-returning tables (a sequence feature) together, with batches of different
sizes on different ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding import comm
from embtables.sharding.cost_model import (
    PooledFeature,
    RowTable,
    even_step_traffic,
    network_ms,
    pools_on_owner,
    step_traffic,
    torchrec_bytes,
)


def _config() -> dict[str, et.FeatureConfig]:
    pooled_a = et.TableConfig(101, 4, name="pa", combiner="sum", optimizer=et.Adagrad(0.1))
    pooled_b = et.TableConfig(37, 8, name="pb", combiner="mean", optimizer=et.SGD(0.1))
    rows = et.TableConfig(53, 4, name="seq", optimizer=et.Adagrad(0.1))
    return {
        "a": et.FeatureConfig(pooled_a),
        "a2": et.FeatureConfig(pooled_a, name="a2"),
        "b": et.FeatureConfig(pooled_b),
        "s": et.FeatureConfig(rows, max_sequence_length=3),
    }


def _traffic(rank: int, world: int) -> None:
    emb = et.DistributedEmbedding(_config(), sharding="div")
    gen = torch.Generator().manual_seed(rank)
    bags = 5 + 3 * rank  # every rank its own batch size
    features: dict[str, et.Ragged] = {}
    for name, vocab in (("a", 101), ("a2", 101), ("b", 37), ("s", 53)):
        lengths = torch.randint(0, 5, (bags,), generator=gen) if name != "s" else torch.full((bags,), 3)
        ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen)
        features[name] = et.Ragged.from_lengths(ids, lengths.to(torch.int64))
    comm.bytes_sent.clear()
    acts = emb(features)
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    plans = emb._engine.plans  # type: ignore[attr-defined]
    bags_of = tuple(comm.all_gather_object(bags))
    pooled = []
    for name in ("a", "a2", "b"):  # tf.nest order: sorted keys
        table = {"a": "pa", "a2": "pa", "b": "pb"}[name]
        owner, _ = plans[table].owner(features[name].values)
        per_owner = tuple(int(n) for n in torch.bincount(owner, minlength=world).tolist())
        # "b" (mean) sends a coefficient per id; "a" and "a2" (unweighted sums) send none
        pooled.append(PooledFeature(per_owner, bags, bags_of, {"pa": 4, "pb": 8}[table], coefficients=table == "pb"))
    owner, _ = plans["seq"].owner(torch.unique(features["s"].values))
    unique = tuple(int(n) for n in torch.bincount(owner, minlength=world).tolist())
    everyone = comm.all_gather_object(unique)
    rows = [RowTable(unique, tuple(everyone[r][rank] for r in range(world)), 4)]
    predicted = step_traffic(rank, world, pooled, rows)
    assert comm.bytes_sent.get("int", 0) == predicted.int_bytes, (rank, dict(comm.bytes_sent), predicted, pooled, rows)
    assert comm.bytes_sent.get("float", 0) == predicted.float_bytes


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_model_predicts_every_byte_sent(world: int) -> None:
    run_world(_traffic, world)


def test_even_traffic_grows_with_the_peers_for_pooled_tables_and_not_for_row_tables() -> None:
    pooled = [even_step_traffic(w, 8, 2048, 20, 64, 0.5, pooled=True).bytes for w in (2, 8, 64)]
    rows = [even_step_traffic(w, 8, 2048, 20, 64, 0.5, pooled=False).bytes for w in (2, 8, 64)]
    assert pooled[0] < pooled[1] < pooled[2] and pooled[2] > 50 * pooled[0]  # (W - 1) partial bags per feature
    assert rows[2] < 2.1 * rows[0]  # unique rows x (W - 1) / W: bounded
    # Coefficients (weights, mean, sqrtn) travel as one float32 per id sent to the other rank: 8 x 20480.
    weighted = even_step_traffic(2, 8, 2048, 20, 64, 0.5, pooled=True, coefficients=True)
    assert weighted.bytes - pooled[0] == 4 * 8 * 20480


def test_pooling_on_the_owner_is_chosen_only_where_it_sends_less() -> None:
    # The standard per-rank batch: 8 x 2048 bags of 20 ids, 36% unique, D = 64.
    assert pools_on_owner(2, 40960, 14720, 2048, 64)
    assert not pools_on_owner(8, 40960, 14720, 2048, 64)
    # One id per bag and three hot ids: a partial bag per sample costs far more than three rows.
    assert not pools_on_owner(2, 1000, 3, 1000, 8)
    assert pools_on_owner(1, 1000, 3, 1000, 8)  # nothing is sent in one process


def _hot_ids(rank: int, world: int, stats: str, out: str) -> None:
    table = et.TableConfig(50, 4, name="hot", combiner="sum", initializer=et.Constant(0.5), optimizer=et.Adagrad(0.1))
    emb = et.DistributedEmbedding({"h": et.FeatureConfig(table)}, profile_data_directory=stats)
    assert [t.name for t in emb._engine.pooled_tables] == []  # type: ignore[attr-defined]
    assert [t.name for t in emb._engine.row_tables] == ["hot"]  # type: ignore[attr-defined]
    for step in range(3):
        ids = torch.tensor([(step + rank + i) % 3 for i in range(40)])  # 40 bags of one hot id
        acts = emb({"h": ids})
        emb.apply_gradients({"h": torch.full_like(acts["h"], 0.1 * (rank + 1))})
    state = emb.state_dict()
    if rank == 0:
        torch.save(state, out)


@pytest.mark.distributed
def test_statistics_that_favour_unique_rows_switch_a_table_off_owner_pooling(tmp_path: Path) -> None:
    stats = str(tmp_path / "stats")
    table = et.TableConfig(50, 4, name="hot", combiner="sum", initializer=et.Constant(0.5), optimizer=et.Adagrad(0.1))
    one = et.DistributedEmbedding({"h": et.FeatureConfig(table)}, profile_data_directory=stats, profile_sample_rate=1.0)
    for step in range(3):
        ids = torch.tensor([(step + r + i) % 3 for r in range(2) for i in range(40)])
        one({"h": ids})
        grad = torch.cat([torch.full((40, 4), 0.1), torch.full((40, 4), 0.2)])
        one.apply_gradients({"h": grad})
    assert one.flush()
    out = str(tmp_path / "state.pt")
    run_world(_hot_ids, 2, stats, out)
    sharded = torch.load(out)
    for key, value in one.state_dict().items():
        torch.testing.assert_close(sharded[key], value, rtol=1e-6, atol=1e-6)


def test_the_weak_scaling_table_in_the_docs_is_the_model() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "sharding.md").read_text()
    rows = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| ") and "ms |" in line]
    table = {int(r[0]): r for r in rows if r[0].strip().isdigit()}
    assert sorted(table) == [2, 8, 16, 32, 64, 128, 256]
    for w, row in table.items():
        pooled = even_step_traffic(w, 8, 2048, 20, 64, 0.36, pooled=True)
        rows_ = even_step_traffic(w, 8, 2048, 20, 64, 0.36, pooled=False)
        mib = [pooled.bytes / 2**20, rows_.bytes / 2**20]
        mib += [torchrec_bytes(w, 8, 2048, 20, 64, row_wise=rw) / 2**20 for rw in (True, False)]
        assert [float(x) for x in row[1:5]] == [round(m, 1) for m in mib], w
        fast, slow = (network_ms(pooled.bytes, pooled.messages, w, gbit) for gbit in (100, 25))
        assert row[5].strip() == f"{slow:.1f} / {fast:.1f} ms", w
