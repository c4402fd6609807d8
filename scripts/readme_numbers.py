"""Every number README.md quotes, checked against the runs that produced them.

    python scripts/readme_numbers.py --check              # CI: README text == recorded results (+ teacher recomputed)
    python scripts/readme_numbers.py --measure dlrm       # rerun `embtables train` (~2 min), record its summary
    python scripts/readme_numbers.py --measure movielens  # rerun benchmarks/bench_movielens.py (~2 min)
    python scripts/readme_numbers.py --measure clean-exit # rerun scripts/clean_exit.py (100 torchrun runs, ~8 min)
    python scripts/readme_numbers.py --measure standard   # benchmarks/run.py with every peer (~5 min)
    python scripts/readme_numbers.py --measure sharded    # benchmarks/bench_sharded.py (~2 min)
    python scripts/readme_numbers.py --measure checkpoint # benchmarks/bench_checkpoint.py, 2 GiB (~1 min)
    python scripts/readme_numbers.py --measure oracle     # scripts/oracle_errors.py --json (~2 min)
    python scripts/readme_numbers.py --measure suite      # the README's test command, timed (~10 min + the set-up)

Recorded results live in docs/results/*.json (what the job or benchmark printed, verbatim). Every
claim below names the text in README.md and where its number comes from; ``--check`` fails when the
README and the record disagree, so a number cannot go stale silently. The DLRM teacher's metrics are
deterministic and cheap, so ``--check`` recomputes them from the data generator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())  # type: ignore[no-any-return]


def _teacher() -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from embtables.cli import dlrm
    from embtables.data import SyntheticCTR, SyntheticCTRConfig
    from embtables.estimator import auc, log_loss

    data = SyntheticCTR(
        SyntheticCTRConfig(seed=0, features=dlrm.FEATURES, interactions=(("user", "item"), ("city", "tags")))
    )
    n_eval = max(1, math.ceil(16384 / 4096))  # the job's default --eval-size, one process
    batches = [data.batch(16384 // n_eval, i, split="eval") for i in range(n_eval)]
    logits = np.concatenate([data.teacher_logits(f).numpy() for f, _ in batches])
    labels = np.concatenate([y.numpy() for _, y in batches])
    return {"auc": auc(logits, labels), "log_loss": log_loss(1 / (1 + np.exp(-logits)), labels)}


# (README text with one {} per number, a function returning the numbers, each formatted as shown)
Claim = tuple[str, Callable[[], list[str]]]


def _claims() -> list[Claim]:
    def dlrm() -> list[str]:
        d = _load("dlrm")
        return [str(d["steps"]), str(d["batch_size"]), f"{d['seconds']:.0f}", f"{d['auc']:.3f}", f"{d['log_loss']:.3f}"]

    def teacher_recorded() -> list[str]:
        d = _load("dlrm")
        return [f"{d['teacher_auc']:.3f}", f"{d['teacher_log_loss']:.3f}"]

    def movielens() -> list[str]:
        e = _load("movielens")["embtables"]
        return [f"{e['rmse']:.4f}", f"{e['mae']:.4f}", f"{e['train_seconds']:.0f}", f"{e['seconds']:.0f}"]

    def surprise() -> list[str]:
        m = _load("movielens")["surprise-svd"]
        return [f"{m['rmse']:.4f}", f"{m['mae']:.4f}", f"{m['seconds']:.1f}"]

    def clean_exit() -> list[str]:
        c = _load("clean_exit")
        return [str(c["failed"]), str(c["runs"])]

    def _sharded_lines() -> list[dict[str, Any]]:
        return [json.loads(x) for x in (RESULTS / "sharded.jsonl").read_text().splitlines() if x.strip()]

    def sharded() -> dict[str, dict[str, Any]]:
        lines = _sharded_lines()
        by = {r["config"]: r for r in lines if "config" in r and "step_ms" in r and "dense_ms" not in r}
        by["torchrec"] = next(r for r in lines if r.get("impl") == "torchrec-dmp" and "step_ms" in r)
        return by

    def sharded_rows() -> list[str]:
        by = sharded()
        w1, div, mod, table = (by[f"embtables W={k}"] for k in (
            "1 (1 proc x 2 threads)", "2 div (2 procs x 1 thread)", "2 mod (2 procs x 1 thread)",
            "2 table (2 procs x 1 thread)"))  # fmt: skip
        sent = div["sent_mb_per_step_per_rank"]
        return [f"{w1['step_ms']:.0f}", f"{div['step_ms']:.0f}", f"{div['step_ms'] / w1['step_ms']:.2f}",
                f"{min(sent):.1f}", f"{max(sent):.1f}", f"{mod['step_ms']:.0f}",
                f"{mod['step_ms'] / w1['step_ms']:.2f}", f"{max(mod['sent_mb_per_step_per_rank']):.1f}",
                f"{table['step_ms']:.0f}",
                f"{table['step_ms'] / w1['step_ms']:.2f}", f"{max(table['sent_mb_per_step_per_rank']):.1f}",
                f"{by['torchrec']['step_ms']:.0f}"]  # fmt: skip

    def sharded_text() -> list[str]:
        by = sharded()
        div, table = by["embtables W=2 div (2 procs x 1 thread)"], by["embtables W=2 table (2 procs x 1 thread)"]
        ratio = {r["summary"]: r["ratio"] for r in _sharded_lines() if "summary" in r}
        return [f"{by['torchrec']['step_ms'] / table['step_ms']:.2f}", f"{100 * div['phase_check_share_of_step']:.1f}",
                f"{ratio['pipelined step / longer part (dense on the device, pipelined work background)']:.2f}",
                f"{ratio['pipelining speed-up, dense on the device, pipelined work background']:.2f}",
                f"{ratio['pipelining speed-up, dense on the cpu, pipelined work auto']:.2f}",
                f"{ratio['pipelining speed-up, dense on the cpu, pipelined work background']:.2f}"]  # fmt: skip

    def checkpoint() -> list[str]:
        c = _load("checkpoint")
        return [f"{c['save_gbps']:.2f}", f"{c['disk_write_gbps']:.2f}", f"{c['save_peak_extra_mib']:.0f}",
                f"{100 * c['save_peak_extra_share']:.1f}", f"{c['restore_cold_gbps']:.2f}",
                f"{c['restore_cold_vs_disk_read']:.2f}", f"{c['disk_read_cold_gbps']:.2f}",
                f"{c['restore_peak_extra_mib']:.0f}", f"{100 * c['restore_peak_extra_share']:.1f}"]  # fmt: skip

    def movielens_ratios() -> list[str]:
        m = _load("movielens")
        e, sv = m["embtables"], m["surprise-svd"]
        return [f"{100 * (1 - e['rmse'] / sv['rmse']):.1f}", f"{m['ratio']['median']:.2f}"]

    def movielens_processes() -> list[str]:
        m = _load("movielens")
        rounds = m["process_ratio"]["process_seconds_over_surprise_process"]
        return [f"{m['embtables']['seconds']:.1f}", f"{m['surprise-svd-process']['seconds']:.1f}",
                f"{m['process_ratio']['median']:.2f}", f"{min(rounds):.2f}", f"{max(rounds):.2f}"]  # fmt: skip

    def demo_minutes() -> list[str]:  # up to the next half minute: the job's clock plus start-up and the plot
        return [f"{math.ceil(_load('dlrm')['seconds'] / 30) / 2:g}"]

    def oracle() -> list[str]:
        o = _load("oracle_errors")
        worst = o["worst"]

        def top(field: str, configs: list[str]) -> str:
            return f"{max(worst[c][path][field] for c in configs for path in worst[c]):.1e}"

        ftrl = [c for c in worst if c.startswith("ftrl")]
        other = [c for c in worst if c not in ftrl]
        return [str(o["examples"]), top("tables", list(worst)), top("slots", other), top("slots", ftrl),
                top("activations", list(worst))]  # fmt: skip

    def suite() -> list[str]:
        return [f"{round(_load('suite')['seconds'] / 60):.0f}"]

    def standard() -> list[dict[str, Any]]:
        return [json.loads(x) for x in (RESULTS / "standard.jsonl").read_text().splitlines() if x.strip()]

    def step_ms(records: list[dict[str, Any]], bench: str, impl: str, opt: str | None, ids: str = "zipf") -> float:
        found = [r["median_ms"] for r in records if r.get("bench") == bench and r.get("impl") == impl
                 and r.get("optimizer") == opt and r.get("ids") == ids and "median_ms" in r]  # fmt: skip
        return float(found[0]) if found else math.nan

    def speed_row(opt: str) -> Callable[[], list[str]]:
        def numbers() -> list[str]:
            records = standard()
            ours = step_ms(records, "train_step", "embtables", opt)
            peers = [step_ms(records, "train_step", p, opt) for p in ("torchrec", "fbgemm", "torch", "tensorflow")]
            cells = ["—" if math.isnan(t) else f"{t:.0f} ms" for t in peers]
            if opt != "adagrad":
                return [f"{ours:.1f}", *cells]
            sys.path.insert(0, str(ROOT))
            from benchmarks.report import probe_bandwidth, probe_time_ms

            mine = next(r for r in records if r.get("bench") == "train_step" and r.get("impl") == "embtables"
                        and r.get("optimizer") == opt)  # fmt: skip
            share = (probe_time_ms(mine, probe_bandwidth(records)) or math.nan) / ours
            return [f"{ours:.1f}", f"{100 * share:.0f}", *cells]

        return numbers

    def guarded_rows() -> list[str]:
        """The same-run rounds of the guarded step against 8bd5665 (the step before the measured bounds) and
        FBGEMM: per optimizer, the range of medians each way, their ratio's range and FBGEMM's over ours."""
        records = [json.loads(x) for x in (RESULTS / "guard_same_run.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in records if r.get("bench") == "train_step"]
        landed = next(r["rev"] for r in steps if r["rev"] != "8bd5665")

        def medians(rev: str, impl: str, opt: str) -> dict[int, float]:
            return {r["round"]: r["median_ms"] for r in steps if (r["rev"], r["impl"], r["optimizer"]) == (rev, impl, opt)}  # noqa: E501

        cells = [landed, landed, landed]
        for opt in ("adagrad", "adam", "sgd"):
            ours, old = medians(landed, "embtables", opt), medians("8bd5665", "embtables", opt)
            fb = medians(landed, "fbgemm", opt)
            ratio = [ours[k] / old[k] for k in ours]
            cells += [f"{min(ours.values()):.1f}-{max(ours.values()):.1f}",
                      f"{min(old.values()):.1f}-{max(old.values()):.1f}",
                      f"{min(ratio):.2f}-{max(ratio):.2f}"]  # fmt: skip
            if fb:
                over = [fb[k] / ours[k] for k in fb]
                cells += [f"{min(fb.values()):.0f}-{max(fb.values()):.0f}", f"{min(over):.1f}-{max(over):.1f}"]
        gather = next(r["GBps"] for r in records if r.get("bench") == "membw_gather")
        mine = (landed, "embtables", "adagrad")
        useful = [r["useful_GBps"] for r in steps if (r["rev"], r["impl"], r["optimizer"]) == mine]
        cells += [f"{min(useful):.1f}-{max(useful):.1f}", f"{gather:.1f}", f"{100 * min(useful) / gather:.0f}",
                  f"{100 * max(useful) / gather:.0f}"]  # fmt: skip
        return cells

    def lookups() -> list[str]:
        records = standard()
        t = {(impl, ids): step_ms(records, "lookup", impl, None, ids) for impl in ("embtables", "torch", "fbgemm",
             "torchrec") for ids in ("zipf", "uniform")}  # fmt: skip
        faster = [t[(p, ids)] / t[("embtables", ids)] for p in ("fbgemm", "torchrec") for ids in ("zipf", "uniform")]
        return [f"{t[('torch', 'zipf')] / t[('embtables', 'zipf')]:.2f}",
                f"{t[('torch', 'uniform')] / t[('embtables', 'uniform')]:.2f}", f"{min(faster):.1f}",
                f"{max(faster):.1f}"]  # fmt: skip

    return [
        ("| Adagrad | **{} ms** ({}% of the measured memory bandwidth) | {} | {} | {} | {} |", speed_row("adagrad")),
        ("| SGD | **{} ms** | {} | {} | {} | {} |", speed_row("sgd")),
        ("| Adam | **{} ms** | {} | {} | {} | {} |", speed_row("adam")),
        ("| FTRL | **{} ms** | {} | {} | {} | {} |", speed_row("ftrl")),
        ("| step | embtables ({}) | 8bd5665 | {} / 8bd5665 | FBGEMM | FBGEMM / {} |\n"
         "| --- | --- | --- | --- | --- | --- |\n| Adagrad | {} ms | {} ms | {}x | {} ms | **{}x** |\n"
         "| Adam | {} ms | {} ms | {}x | — | |\n"
         "| SGD | {} ms | {} ms | {}x | {} ms | {}x |\n\nThe Adagrad step moves {} GB/s of useful bytes against a "
         "random-gather rate of {} GB/s measured in the same session ({}-{}%)", guarded_rows),
        ("Lookup-only (inference) runs at {}x the speed of `F.embedding_bag` with Zipf ids and {}x with uniform ids, "
         "and {}–{}x faster than FBGEMM/TorchRec", lookups),
        ("Max abs error against the float64 oracle over {} hypothesis scenarios per optimizer config (`python3 "
         "scripts/oracle_errors.py`, recorded in `docs/results/oracle_errors.json`): weights ≤ {} for every optimizer, "
         "slots ≤ {} (FTRL's slots, `linears` included, ≤ {}), activations ≤ {}, on both kernel paths.", oracle),
        ("runs the whole test suite over every core (about {} minutes on 2 cores)", suite),
        ("| W = 1, one process x 2 threads | {} ms | 0 |\n| W = 2 div, 2 processes x 1 thread | {} ms ({}x W = 1) | "
         "{}–{} MiB |\n| W = 2 mod, 2 processes x 1 thread | {} ms ({}x W = 1) | {} MiB |\n"
         "| W = 2 table-wise, 2 processes x 1 thread | {} ms ({}x W = 1) | {} MiB |\n"
         "| TorchRec `DistributedModelParallel` W = 2 table-wise (its CPU planner offers no row-wise) | {} ms |",
         sharded_rows),
        ("W = 2 takes {}x our `table` step. The phase headers that catch ranks out of step cost {}% of the\n"
         "W = 2 `div` step. Pipelined, with a dense stand-in on a device as long as the embedding step, a step\n"
         "takes {}x the longer of the two ({}x faster than synchronous); with the dense model on each rank's one\n"
         "CPU core the module runs that work in place ({}x the synchronous step; {}x on an exchange thread)",
         sharded_text),
        ("Saving 2 GiB runs at {} GB/s, against the disk's fsynced sequential write of {} GB/s in the same run, with "
         "{} MiB ({}%) of peak extra memory. Restoring it runs at {} GB/s with its pages dropped from the cache, {}x "
         "of the disk's cold sequential read ({} GB/s), with {} MiB ({}%) of peak extra memory", checkpoint),
        ("embtables beats the baseline's error by {}% in {}x its time", movielens_ratios),
        ("the job takes {} s against Surprise's {} s ({}x; five interleaved rounds, {}-{}x", movielens_processes),
        ("a DLRM on synthetic CTR data (about {} minutes)", demo_minutes),
        ("{} steps x {} in {} s", dlrm),
        ("held-out **AUC {}, log-loss {}**", lambda: dlrm()[3:]),
        ("(the best\nachievable) {} / {}", teacher_recorded),
        ("| **{}** | **{}** | {} s ({} s with start-up", movielens),
        ("the usual baseline | {} | {} | {} s", surprise),
        ("{} of {} runs", clean_exit),
    ]


def check() -> list[str]:
    """Every claim's text, with its recorded numbers, must appear in README.md; the recorded teacher
    metrics must equal a fresh computation. Returns the problems."""
    readme = (ROOT / "README.md").read_text()
    flat = re.sub(r"\s+", " ", readme)
    problems = []
    for text, numbers in _claims():
        try:
            expected = text.format(*numbers())
        except (OSError, KeyError, ValueError) as exc:
            problems.append(f"claim {text!r}: its record cannot be read ({exc})")
            continue
        if re.sub(r"\s+", " ", expected) not in flat:
            problems.append(f"README.md does not say {expected!r} (the recorded result)")
    fresh = _teacher()
    recorded = _load("dlrm")
    for key in ("auc", "log_loss"):
        if abs(fresh[key] - recorded[f"teacher_{key}"]) > 1e-9:
            problems.append(f"teacher {key}: recorded {recorded[f'teacher_{key}']}, computed now {fresh[key]}")
    return problems


def _bench_python() -> str:
    """The TensorFlow venv's python when scripts/install_bench_peers.sh made one (it sees every other
    peer too), else this one (the TensorFlow column is then "—")."""
    venv = Path.home() / ".cache" / "embtables" / "venv-tf" / "bin" / "python"
    ok = venv.exists() and subprocess.run([str(venv), "-c", "import tensorflow"], capture_output=True).returncode == 0
    return str(venv) if ok else sys.executable


def measure(what: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    if what == "dlrm":
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "embtables", "train", "--model-dir", tmp, "--no-progress"],
                           check=True, cwd=ROOT)  # fmt: skip
            summary = json.loads((Path(tmp) / "summary.json").read_text())
            shutil.copy(Path(tmp) / "training_curves.png", ROOT / "docs" / "img" / "dlrm_curves.png")
        (RESULTS / "dlrm.json").write_text(json.dumps(summary, indent=1) + "\n")
    elif what == "movielens":
        out = subprocess.run([sys.executable, "benchmarks/bench_movielens.py"], check=True, cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        result = {r["impl"]: r for r in records if "impl" in r}  # the last record of each: its median
        ratios = [r for r in records if r.get("bench") == "movielens_100k_ratio"]
        if ratios:
            result["ratio"] = ratios[-1]
        process = [r for r in records if r.get("bench") == "movielens_100k_process_ratio"]
        if process:
            result["process_ratio"] = process[-1]
        (RESULTS / "movielens.json").write_text(json.dumps(result, indent=1) + "\n")
    elif what == "sharded":  # ~12 min: W = 1, W = 2 div/table, the pipelined cases, TorchRec DMP
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_sharded", "--w3"], check=True, cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        lines = [line + "\n" for line in out.splitlines() if line.startswith("{")]
        (RESULTS / "sharded.jsonl").write_text("".join(lines))
    elif what == "checkpoint":  # ~1 min: 2 GiB saved and restored (cold and warm) beside the disk's own speed
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_checkpoint", "--gib", "2"], check=True,
                             cwd=ROOT, capture_output=True, text=True).stdout  # fmt: skip
        (RESULTS / "checkpoint.json").write_text(json.dumps(json.loads(out.splitlines()[-1]), indent=1) + "\n")
    elif what == "standard":  # ~15 min: every peer, four optimizers, then lookups with Zipf and uniform ids
        python = _bench_python()
        records = []
        for extra in (["--optimizers", "adagrad,sgd,adam,ftrl", "--ids", "zipf", "--modes", "train"],
                      ["--optimizers", "adagrad", "--ids", "zipf,uniform", "--modes", "lookup", "--no-check"]):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([python, "benchmarks/run.py", *extra, "--out", tmp, "--wait-idle", "30"], check=True,
                               cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
                records += (Path(tmp) / "results.jsonl").read_text().splitlines()
        (RESULTS / "standard.jsonl").write_text("".join(line + "\n" for line in records))
    elif what == "oracle":  # ~3 min
        out = subprocess.run([sys.executable, "scripts/oracle_errors.py", "--json"], check=True, cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        (RESULTS / "oracle_errors.json").write_text(json.dumps(json.loads(out), indent=1) + "\n")
    elif what == "suite":  # the README's test command, timed (~10 min + the set-up); less the check of this very record
        t0 = time.monotonic()
        skip = "--deselect tests/api/test_docs_run.py::test_the_main_job_numbers_in_the_readme_match_the_recorded_runs"
        env = {**os.environ, "PYTEST_ADDOPTS": skip}
        proc = subprocess.run(["bash", ".ci/run"], cwd=ROOT, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - t0
        found = re.search(r"(\d+) passed.* in ([\d.]+)s", proc.stdout)
        if proc.returncode != 0 or found is None:
            sys.exit(f"the test suite failed (exit {proc.returncode}); nothing recorded:\n{proc.stdout[-3000:]}")
        record = {"seconds": float(found[2]), "passed": int(found[1]), "ci_seconds": round(seconds, 1)}
        (RESULTS / "suite.json").write_text(json.dumps(record) + "\n")  # seconds: pytest's; ci: clone + venv too
    elif what == "clean-exit":
        out = subprocess.run([sys.executable, "scripts/clean_exit.py", "--runs", "100"], cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        (RESULTS / "clean_exit.json").write_text(json.dumps(json.loads(out), indent=1) + "\n")
    print(f"recorded {what} in {RESULTS}")


MEASURES = ("dlrm", "movielens", "clean-exit", "sharded", "checkpoint", "standard", "oracle", "suite")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--check", action="store_true")
    p.add_argument("--measure", choices=MEASURES)
    args = p.parse_args(argv)
    if args.measure:
        measure(args.measure)
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        print("README numbers: OK" if not problems else f"README numbers: {len(problems)} problem(s)")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
