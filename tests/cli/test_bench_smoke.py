"""Smoke run of the benchmark suite with tiny sizes: it runs, reports, and embtables passes its one-step
oracle check. Never asserts a time (benchmarks measure, tests do not time); missing peers are skip lines."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fast_child
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_runner_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import run

    argv = [
        "--impls", "embtables,embtables-noacc,torch,not-an-impl",
        "--optimizers", "adagrad,ftrl,adam",
        "--modes", "train,lookup",
        "--tables", "2", "--rows", "5000", "--batch", "32",
        "--steps", "2", "--warmup", "1",
        "--probe-gib", "0.05",
        "--out", str(tmp_path),
    ]  # fmt: skip
    assert run.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    steps = [r for r in records if r.get("bench") == "train_step" and r.get("impl") == "embtables"]
    assert {r["optimizer"] for r in steps} == {"adagrad", "ftrl", "adam"}
    assert all(r["steps_per_s"] > 0 and r["useful_GBps"] > 0 for r in steps)
    checks = {(r["impl"], r["optimizer"]): r for r in records if r.get("bench") == "oracle_check" and "ok" in r}
    for impl in ("embtables", "embtables-noacc"):
        for opt in ("adagrad", "ftrl"):
            assert checks[(impl, opt)]["ok"], checks[(impl, opt)]
    assert any(r.get("impl") == "not-an-impl" and "unknown impl" in r.get("skipped", "") for r in records)
    assert any(str(r.get("bench", "")).startswith("membw_") for r in records), "the bandwidth probe ran"
    report = (tmp_path / "report.md").read_text()
    assert "embtables" in report and "One step against the float64 oracle" in report
    assert os.path.getsize(tmp_path / "results.jsonl") > 0


def test_sharded_benchmark_reports_each_ranks_phases(tmp_path: Path) -> None:
    """``embtables bench sharded``: every configuration's line carries every rank's per-phase breakdown,
    whose owner-pooling bytes add up to the bytes the rank sent."""
    cmd = [sys.executable, "-m", "embtables", "bench", "sharded", "--quick", "--no-torchrec", "--steps", "2",
           "--warmup", "1", "--rounds", "2"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    runs = {r["config"]: r for r in records if "phases_per_rank" in r}
    assert len(runs) == 4  # W = 1, and W = 2 div, table, mod
    for r in runs.values():  # two interleaved rounds; the line reports the median one (the lower of two)
        assert len(r["rounds_ms"]) == 2 and r["step_ms"] == min(r["rounds_ms"])
    div = next(r for c, r in runs.items() if "W=2 div" in c)
    for rank, phases in enumerate(div["phases_per_rank"]):
        assert phases["owner pooling: pool"]["ms"] > 0
        # all_to_all payloads (what bytes_sent counts), leaving out the agreements and phase headers
        payload = sum(p["bytes"] for name, p in phases.items() if "agreement" not in name and name != "phase header")
        assert abs(payload / 2**20 - div["sent_mb_per_step_per_rank"][rank]) < 0.002
    assert any(r.get("summary", "").startswith("pipelining") for r in records)
    # the pipelined cases: synchronous and pipelined with the dense part on a device and on the CPU (in place by
    # the module's choice and on the exchange thread), each in both rounds, the dense part timed on every rank
    piped = [r for r in records if "dense_on" in r]
    cases = {(r["dense_on"], r["pipelined"], r["pipeline_thread"]) for r in piped}
    assert cases == {("device", False, "auto"), ("device", True, "background"), ("cpu", False, "auto"),
                     ("cpu", True, "auto"), ("cpu", True, "background")}  # fmt: skip
    for r in piped:
        assert len(r["rounds_ms"]) == 2 and len(r["dense_part_ms_per_rank"]) == 2
        assert all(ms > 0 for ms in r["dense_part_ms_per_rank"])


def test_latency_benchmark_reports_every_size_next_to_its_peers(tmp_path: Path) -> None:
    """``embtables bench latency``: a train_step line per impl, size and round, a summary per size with each
    impl's least median over the rounds and the peers' ratios over the concatenated embtables impl's, and the
    Markdown table written with ``--out``."""
    table = tmp_path / "latency.md"
    cmd = [sys.executable, "-m", "embtables", "bench", "latency", "--batches", "64,128", "--pooling", "1,3",
           "--steps", "3", "--warmup", "1", "--rounds", "2", "--impls", "embtables,embtables-concat,torch",
           "--out", str(table)]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    malloc = next(r for r in records if r.get("bench") == "env")["malloc"]
    assert malloc == "kept" or malloc.startswith("default ("), malloc  # glibc here: kept
    summaries = [r for r in records if r.get("bench") == "latency_summary"]
    assert [(s["batch"], s["pooling"]) for s in summaries] == [(64, 1), (64, 3), (128, 1), (128, 3)]
    for s in summaries:
        steps: dict[str, list[float]] = {}
        for r in records:
            if r.get("bench") == "train_step" and r["workload"].endswith(f"b{s['batch']} p{s['pooling']}"):
                assert r["batch"] == s["batch"]
                steps.setdefault(r["impl"], []).append(r["median_ms"])
        assert {k: len(v) for k, v in steps.items()} == {"embtables": 2, "embtables-concat": 2, "torch": 2}
        assert s["round_medians_ms"] == steps and s["ours"] == "embtables-concat"
        assert s["median_ms"] == {k: min(v) for k, v in steps.items()}
        ratio = min(steps["torch"]) / min(steps["embtables-concat"])
        assert set(s["speedup"]) == {"torch"} and abs(s["speedup"]["torch"] - ratio) < 1e-3 * max(1.0, ratio)
    assert table.read_text().count("\n") == 2 + len(summaries)


def test_estimator_benchmark_reports_the_overhead_and_where_it_goes(tmp_path: Path) -> None:
    """``embtables bench estimator``: bare and Estimator ms per step on the same batches, the overhead as
    their ratio, and the parts (conversion, step, checkpoint) it is made of."""
    pytest.importorskip("recbole")  # only for its MovieLens-100k files (never imported by embtables)
    cmd = [sys.executable, "-m", "embtables", "bench", "estimator", "--batches", "4096", "--repeats", "2",
           "--models", "job"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(x) for x in out.stdout.splitlines() if '"estimator_overhead"' in x]
    assert record["batch"] == 4096 and record["steps_per_call"] == 80 and record["epochs_per_call"] == 4
    assert record["fields"] == "job"
    assert "6 tables: user, item, age, gender, year, genres" in record["model"]
    for way in ("prefetch0", "prefetch1", "prefetchauto"):
        ratio = record["estimator_ms_per_step"][way] / record["bare_ms_per_step"] - 1
        assert abs(record["overhead"][way] - ratio) < 0.01
    assert record["prepare_ms"] > 0 and record["step_ms"] > 0 and record["save_ms_per_train_call"] > 0
    bad = fast_child.run([*cmd[:-1], "job,nope"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert bad.returncode == 2 and "--models: unknown model 'nope'" in bad.stderr


def test_gpu_benchmark_runs_its_impls_side_by_side_and_refuses_a_missing_device(tmp_path: Path) -> None:
    """``embtables bench gpu``: on the tiny workload (on the CPU here, the same code as on a GPU) a line per
    impl, optimizer and mode with the copy bandwidth's share and the speed-up over the peers; plain
    PyTorch skipped for FTRL (no sparse FTRL in torch); half-precision tables as an impl of their own
    (``--dtypes``); ``--device cuda`` without CUDA is refused."""
    cmd = [sys.executable, "-m", "embtables", "bench", "gpu", "--device", "cpu", "--workloads", "tiny",
           "--optimizers", "adagrad,ftrl", "--dtypes", "float32,bfloat16+slots", "--steps", "2",
           "--warmup", "1"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert records[0]["env"] and records[0]["copy_GBps"] > 0
    measured = {(r["impl"], r["optimizer"], r["mode"]) for r in records if "impl" in r}
    impls = ("embtables", "embtables[bfloat16+slots]", "embtables-torch", "torch")
    expected = {(i, o, m) for i in impls for o in ("adagrad", "ftrl") for m in ("forward", "train")}
    assert measured == expected - {("torch", "ftrl", "forward"), ("torch", "ftrl", "train")}
    assert sum(1 for r in records if r.get("skipped") == "torch") == 2
    for r in records:
        if "impl" in r:
            assert r["ms"] > 0 and r["of_copy_bw"] > 0 and ("embtables_speedup" in r) == (r["impl"] != "embtables")
    if not torch.cuda.is_available():
        missing = fast_child.run(
            [sys.executable, "-m", "embtables", "bench", "--device", "cuda", "--workloads", "tiny"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert missing.returncode == 2 and "no CUDA device" in missing.stderr


def test_online_benchmark_measures_idle_updates_and_freshness(tmp_path: Path) -> None:
    """``embtables bench online --small``: the first export, idle and during-update latencies, and the freshness
    of every save, all from real processes on loopback."""
    cmd = [sys.executable, "-m", "embtables", "bench", "online", "--small", "--idle-seconds", "0.5", "--clients", "1",
           "--out", str(tmp_path / "table.md")]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    phases = {r.get("phase"): r for r in records if r.get("bench") == "online"}
    assert phases["idle"]["requests"] > 0 and phases["during updates"]["requests"] > 0
    fresh = phases["freshness"]
    assert fresh["saves"] >= 1 and fresh["failures"] == 0 and 0 <= fresh["freshness_max_s"] < 30
    assert "freshness" in (tmp_path / "table.md").read_text()


def test_precision_benchmark_measures_the_rounding_and_the_half_peer() -> None:
    """``embtables bench precision``: float32, bfloat16 rows, rows and slots, the same rounded to nearest, and the
    FBGEMM peers (float32 and float16 weights; skip lines when fbgemm_gpu is missing), with the rounding's cost."""
    cmd = [sys.executable, "-m", "embtables", "bench", "precision", "--workloads", "small", "--steps", "2",
           "--warmup", "1", "--no-probe"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (summary,) = [r for r in records if r.get("bench") == "precision_summary"]
    assert {"embtables", "embtables-bf16-slots", "embtables-bf16-slots-nearest"} <= set(summary["impls"])
    assert summary["stochastic_vs_nearest"] > 0
    peers = {r["impl"] for r in records if r.get("bench") == "train_step" and r["impl"].startswith("fbgemm")}
    assert peers == {"fbgemm", "fbgemm-fp16"}  # measured, or a skip line saying why


def test_rounding_benchmark_times_each_type_mode_and_path() -> None:
    """``embtables bench rounding``: a line per half type and mode with the vector and scalar loops' times, and
    the stochastic rounding's cost over rounding to nearest on each path."""
    cmd = [sys.executable, "-m", "embtables", "bench", "rounding", "--rows", "64", "--dim", "24", "--reps", "2",
           "--rounds", "1"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    lines = [r for r in records if r.get("bench") == "rounding"]
    if lines and "skipped" in lines[0]:
        pytest.skip(lines[0]["skipped"])
    assert {(r["type"], r["mode"]) for r in lines} == {(t, m) for t in ("bfloat16", "float16")
                                                       for m in ("stochastic", "nearest")}  # fmt: skip
    assert all(r["vector_ms"] > 0 and r["scalar_ms"] > 0 for r in lines)
    (summary,) = [r for r in records if r.get("bench") == "rounding_summary"]
    assert summary["float16_stochastic_vs_nearest_vector"] > 0


def test_offload_benchmark_reports_the_disk_at_two_depths_the_floor_and_the_ideal_lfu(tmp_path: Path) -> None:
    """``embtables bench offload``: the disk probe at queue depth 1 and 32, and per case the step, the disk-bound
    floor and the hit rate next to an ideal LFU's of the same capacity."""
    cmd = [sys.executable, "-m", "embtables", "bench", "offload", "--tables", "1", "--rows", "20000", "--dim", "16",
           "--batch", "128", "--pooling", "2", "--cache-rows", "12800", "--steps", "2", "--warmup", "1",
           "--batches", "3", "--probe-seconds", "0.1", "--probe-mib", "8", "--directory", str(tmp_path),
           "--cold"]  # fmt: skip
    out = fast_child.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (probe,) = [r for r in records if r.get("bench") == "disk_probe"]
    assert probe["random_4k_reads_per_s_qd1"] > 0 and probe["random_4k_reads_per_s_qd32"] > 0
    steps = {r["ids"]: r for r in records if r.get("bench") == "offload_step" and r["impl"] == "offloaded"}
    assert set(steps) == {"zipf", "uniform"}
    for r in steps.values():
        assert 0 <= r["hit_rate"] <= 1 and 0 <= r["ideal_lfu_hit_rate"] <= 1 and r["disk_bound_floor_ms"] >= 0
        assert r["cold"] is True  # the files dropped from the page cache after the warm-up
    (summary,) = [r for r in records if r.get("bench") == "offload_summary"]
    assert "zipf_step_vs_disk_bound_floor" in summary or steps["zipf"]["disk_bound_floor_ms"] == 0
    assert not list(tmp_path.glob("embtables-bench-offload-*")), "the benchmark's files are removed"


@pytest.mark.parametrize("batches_made", [3, 6])  # cycled, or every step a fresh batch (made one at a time)
@pytest.mark.parametrize("capacity", [0, 10**9])
def test_the_ideal_lfu_never_evicts_with_room_for_everything_and_keeps_one_batch_without(
    capacity: int, batches_made: int
) -> None:
    """``ideal_lfu_hit_rate`` at its two ends, against a recount: with room for every row nothing leaves (a hit is
    a row any earlier step looked up); with no room beyond a batch only the previous batch's rows are kept."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_offload import ideal_lfu_hit_rate
    from benchmarks.workload import Workload, iter_batches, make_batches

    wl = Workload("t", tables=2, rows=300, dim=4, batch=16, pooling=3, ids="zipf", num_batches=batches_made)
    batches = make_batches(wl)
    assert all(
        all((a == b).all() for a, b in zip(x.ids, y.ids, strict=True))
        for x, y in zip(batches, iter_batches(wl), strict=True)
    )
    looked = hits = 0
    for t in range(wl.tables):
        seen: set[int] = set()
        last: set[int] = set()
        for i in range(6):
            rows = set(batches[i % batches_made].ids[t].tolist())
            if i >= 2:
                looked += len(rows)
                hits += len(rows & (seen if capacity else last))
            seen |= rows
            last = rows
    assert ideal_lfu_hit_rate(wl, capacity, warmup=2, steps=4) == hits / looked


def test_a_benchmarks_out_file_is_checked_before_it_runs(tmp_path: Path) -> None:
    """``--out FILE`` of a benchmark's table: a file that is not a table a benchmark wrote, or a folder, is refused
    at once (exit 2, one line, the file's bytes kept); the benchmark never runs to find it at the end."""
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n")
    for out, reason in ((notes, "is not a Markdown table a benchmark wrote"), (tmp_path, "is a folder")):
        for bench in ("latency", "dynamic", "online"):
            argv = ["bench", bench, "--out", str(out)]
            code = f"import sys; from embtables.__main__ import main; sys.exit(main({argv!r}))"
            got = fast_child.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert got.returncode == 2 and reason in got.stderr, (bench, got.stderr[-2000:])
            assert "[" not in got.stdout  # no benchmark line: nothing ran
    assert notes.read_text() == "# my notes\n"
