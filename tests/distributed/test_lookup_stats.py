"""Lookup statistics (``profile_data_directory``, spec §5) and the placement they feed (issue 7, item 5)."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import fast_child
import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.sharding.lookup_stats import (
    LookupStatsRecorder,
    TableLoad,
    merge,
    read_all,
    read_loads,
    sampled,
    stats_filename,
    summary,
    write_stats,
)
from embtables.sharding.plan import Placement, TablePlan
from embtables.sharding.strategies import place_tables


def _resolved(v: int = 6, dim: int = 2) -> et.DistributedEmbedding:
    t = et.TableConfig(v, dim, name="t", optimizer=et.SGD(0.1))
    u = et.TableConfig(40, 8, name="u", optimizer=et.Adagrad(0.1))
    return et.DistributedEmbedding({"a": et.FeatureConfig(t), "b": et.FeatureConfig(t), "c": et.FeatureConfig(u)})


def _recorder(world: int = 3) -> LookupStatsRecorder:
    resolved = _resolved().resolved_config
    plans = {t.name: TablePlan("mod", t.vocabulary_size, world, 0) for t in resolved.tables}
    return LookupStatsRecorder(resolved, plans, sample_rate=1.0)


BATCH_1 = ([torch.tensor([0, 1, 1, 5]), torch.tensor([1, 3]), torch.tensor([7, 7, 7])], [2, 2, 3], [1, 0, 0])
BATCH_2 = ([torch.tensor([4]), torch.tensor([0, 0, 2]), torch.tensor([39])], [1, 3, 1], [0, 2, 0])


def test_recorder_counts_match_hand_counts() -> None:
    rec = _recorder()
    rec.record(*BATCH_1)
    t = rec.state()["t"]
    # Table t serves features a and b: ids 0 1 1 5 | 1 3; mod 3 owners: 0->0 1->1 1->1 5->2 | 1->1 3->0.
    assert t["batches"] == 1 and t["samples"] == [2, 2] and t["ids"] == [4, 2]
    assert t["unique_ids"] == 4  # {0, 1, 3, 5}
    assert t["ids_per_shard"] == [2, 3, 1] and t["unique_ids_per_shard"] == [2, 1, 1]
    assert t["dropped_ids"] == 1
    s = summary(t)
    assert s["ids_per_sample"] == [2.0, 1.0] and s["ids_per_batch"] == 6.0
    assert s["load_balance"] == pytest.approx(3 / 2)
    assert s["hottest_rows"][0] == [1, 3]
    assert summary(rec.state()["u"])["hottest_rows"] == [[7, 3]]


def test_merging_two_ranks_equals_one_recorder_fed_both_batches() -> None:
    r1, r2, both = _recorder(), _recorder(), _recorder()
    r1.record(*BATCH_1)
    r2.record(*BATCH_2)
    both.record(*BATCH_1)
    both.record(*BATCH_2)
    assert merge([r1.state(), r2.state()]) == both.state()


def test_sampling_is_seeded_and_close_to_the_rate() -> None:
    steps = range(20000)
    picked = [s for s in steps if sampled(s, 0, 0.03)]
    assert 0.025 < len(picked) / len(steps) < 0.035
    assert picked == [s for s in steps if sampled(s, 0, 0.03)]
    assert picked != [s for s in steps if sampled(s, 1, 0.03)]
    assert all(sampled(s, 5, 1.0) for s in range(100))


def test_file_names_are_stable_and_depend_on_the_placement() -> None:
    table = _resolved().resolved_config.tables[0]
    name = stats_filename(table, "div", 2)
    assert name == stats_filename(table, "div", 2) and name.startswith("t-") and name.endswith(".json")
    assert len({name, stats_filename(table, "mod", 2), stats_filename(table, "div", 3)}) == 3
    other = _resolved(v=7).resolved_config.tables[0]
    assert stats_filename(other, "div", 2) != name


def test_files_are_written_atomically_merged_and_bad_files_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resolved = _resolved().resolved_config
    rec = _recorder()
    rec.record(*BATCH_1)
    strategies = {"t": "mod", "u": "mod"}
    paths = write_stats(tmp_path, rec.state(), resolved, strategies, 3)
    assert len(paths) == 2 and sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
    write_stats(tmp_path, rec.state(), resolved, strategies, 3)  # a second run adds up
    doc = json.loads(paths[0].read_text())
    assert doc["counts"]["batches"] == 2 and doc["strategy"] == "mod" and doc["world_size"] == 3
    (tmp_path / "junk.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="embtables"):
        docs = read_all(tmp_path)
    assert len(docs) == 2 and "junk.json" in caplog.text
    loads = read_loads(tmp_path, resolved)
    assert loads["t"] == TableLoad(ids_per_batch=6.0, unique_ids_per_batch=4.0, batches=2, samples_per_batch=4.0)


def test_placement_balances_bytes_and_measured_load() -> None:
    tables = {f"t{i}": et.TableConfig(100 * (i + 1), 4, name=f"t{i}") for i in range(4)}
    emb = et.DistributedEmbedding({k: et.FeatureConfig(t) for k, t in tables.items()}, optimizer=et.SGD(0.1))
    resolved = emb.resolved_config
    placed = place_tables(resolved, "table", 2)
    assert {p.strategy for p in placed.values()} == {"table"}
    # 400 | 300 + 200 ... then 100 to the lighter rank
    expected = {"t3": "table@0", "t2": "table@1", "t1": "table@1", "t0": "table@0"}
    assert {n: str(p) for n, p in placed.items()} == expected
    assert place_tables(resolved, "table", 2) == placed  # deterministic
    # auto: small tables go whole; a small table that carries most of the traffic is row-sharded.
    auto = place_tables(resolved, "auto", 2)
    assert {n: p.strategy for n, p in auto.items()} == {"t0": "table", "t1": "div", "t2": "div", "t3": "div"}
    hot = {f"t{i}": TableLoad(1000.0 if i == 0 else 10.0, 5.0, 3) for i in range(4)}
    assert place_tables(resolved, "auto", 2, hot)["t0"] == Placement("div")
    mixed = place_tables(resolved, {"t1": "mod"}, 2)
    assert {n: str(p) for n, p in mixed.items()} == {"t0": "div", "t1": "mod", "t2": "div", "t3": "div"}


def test_sharding_argument_errors_name_the_problem() -> None:
    cfg = {"a": et.FeatureConfig(et.TableConfig(5, 2, name="t", optimizer=et.SGD(0.1)))}
    with pytest.raises(ValueError, match="'rows'"):
        et.DistributedEmbedding(cfg, sharding="rows")
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        et.DistributedEmbedding(cfg, sharding={"nope": "div"})
    with pytest.raises(ValueError, match="unknown strategies"):
        et.DistributedEmbedding(cfg, sharding={"t": "rows"})
    with pytest.raises(TypeError, match="str or a dict"):
        et.DistributedEmbedding(cfg, sharding=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        et.DistributedEmbedding(cfg, timeout=-1)


def test_a_training_run_writes_statistics_and_the_cli_shows_them(tmp_path: Path) -> None:
    cfg = {
        "a": et.FeatureConfig(et.TableConfig(10, 2, name="t", optimizer=et.SGD(0.1))),
        "s": et.FeatureConfig(et.TableConfig(10, 2, name="q", optimizer=et.SGD(0.1)), max_sequence_length=2),
    }
    emb = et.DistributedEmbedding(cfg, profile_data_directory=tmp_path, profile_sample_rate=1.0)
    for _ in range(3):
        acts = emb({"a": torch.tensor([[1, -1], [2, 2]]), "s": et.Ragged.from_lists([[1, 2, 3], [4]])})
        emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    emb.eval()
    emb({"a": torch.tensor([[1, 1], [2, 2]]), "s": et.Ragged.from_lists([[1], [4]])})  # eval: not counted
    paths = emb.flush()
    docs = {d["table"]["name"]: d for d in read_all(tmp_path)}
    assert len(paths) == 2 and docs["t"]["counts"]["batches"] == 3
    assert docs["t"]["counts"]["dropped_ids"] == 3  # the -1 of each step
    assert docs["q"]["counts"]["dropped_ids"] == 3  # the third position of [1, 2, 3] with max_sequence_length=2
    assert docs["t"]["summary"]["hottest_rows"][0] == [2, 6]
    png = tmp_path / "load.png"
    out = fast_child.run(
        [sys.executable, "-m", "embtables", "stats", str(tmp_path), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "unique/batch" in out.stdout and "\nt " in out.stdout and "\nq " in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = fast_child.run([sys.executable, "-m", "embtables", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr and "see embtables --help" in bad.stderr


def _sharded_stats(rank: int, world: int, directory: str) -> None:
    t = et.TableConfig(9, 2, name="t", optimizer=et.SGD(0.1))
    emb = et.DistributedEmbedding(
        {"a": et.FeatureConfig(t)}, sharding="mod", profile_data_directory=directory, profile_sample_rate=1.0
    )
    for step in range(2):
        acts = emb({"a": torch.tensor([[rank, 3], [step + 4, 8]])})
        emb.apply_gradients({"a": torch.ones_like(acts["a"])})
    paths = emb.flush()
    assert (len(paths) == 1) == (rank == 0)
    # The statistics are read back at construction (all ranks see the shared directory).
    big = et.FeatureConfig(et.TableConfig(1000, 8, name="big", optimizer=et.SGD(0.1)))
    auto = et.DistributedEmbedding(
        {"a": et.FeatureConfig(t), "b": big}, sharding="auto", profile_data_directory=directory
    )
    assert re.search(r"sharding=\[t: table@[01], big: div\]", repr(auto))


@pytest.mark.distributed
def test_sharded_statistics_merge_every_rank(tmp_path: Path) -> None:
    run_world(_sharded_stats, 2, str(tmp_path))
    (doc,) = read_all(tmp_path)
    counts = doc["counts"]
    assert doc["strategy"] == "mod" and doc["world_size"] == 2
    assert counts["batches"] == 4 and sum(counts["ids_per_shard"]) == 16
    # ids: rank r: {r, 3, s+4, 8}; mod 2 owners: even ids -> rank 0.
    assert counts["ids_per_shard"] == [8, 8] and counts["unique_ids_per_shard"] == [8, 8]


def test_malformed_statistics_files_are_skipped_with_a_warning_naming_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resolved = _resolved().resolved_config
    rec = _recorder()
    rec.record(*BATCH_1)
    (path,) = write_stats(tmp_path, rec.state(), resolved, {"t": "mod", "u": "mod"}, 3)[:1]
    good = json.loads(path.read_text())
    mutations = {
        "no_counts.json": lambda d: d.pop("counts"),
        "bad_batches.json": lambda d: d["counts"].__setitem__("batches", "many"),
        "bad_hot.json": lambda d: d["counts"].__setitem__("hot", {"x": 1}),
        "table_list.json": lambda d: d.__setitem__("table", []),
        "not_object.json": lambda d: d.clear() or d.update({"format_version": 1, "table": {"name": "t"}}),
        "offload_text.json": lambda d: d.__setitem__("offload", {"hits": "all"}),
        "offload_negative.json": lambda d: d.__setitem__("offload", {"hits": -1}),
        "offload_list.json": lambda d: d.__setitem__("offload", [1]),
    }
    for name, fn in mutations.items():
        doc = json.loads(json.dumps(good))
        fn(doc)
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "list.json").write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="embtables"):
        loads = read_loads(tmp_path, resolved)  # construction reads these: never a bare KeyError
        et.DistributedEmbedding(
            {"a": et.FeatureConfig(et.TableConfig(6, 2, name="t"))}, et.SGD(0.1), profile_data_directory=tmp_path
        )
    assert loads["t"].batches == 1
    for name in [*mutations, "list.json"]:
        assert name in caplog.text
