"""The numbers README.md quotes for the main jobs, checked against the runs that produced them.

    python scripts/readme_numbers.py --check              # CI: README text == recorded results (+ teacher recomputed)
    python scripts/readme_numbers.py --measure dlrm       # rerun `embtables train` (~2 min), record its summary
    python scripts/readme_numbers.py --measure movielens  # rerun benchmarks/bench_movielens.py (~2 min)
    python scripts/readme_numbers.py --measure clean-exit # rerun scripts/clean_exit.py (100 torchrun runs, ~8 min)

Recorded results live in docs/results/*.json (what the job or benchmark printed, verbatim). Every
claim below names the text in README.md and where its number comes from; ``--check`` fails when the
README and the record disagree, so a number cannot go stale silently. The DLRM teacher's metrics are
deterministic and cheap, so ``--check`` recomputes them from the data generator.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
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

    return [
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
        result = {r["impl"]: r for r in records if "impl" in r}
        (RESULTS / "movielens.json").write_text(json.dumps(result, indent=1) + "\n")
    elif what == "sharded":  # ~10 min: W = 1, W = 2 div/table, the pipelined pair, TorchRec DMP
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_sharded"], check=True, cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        (RESULTS / "sharded.jsonl").write_text("".join(line + "\n" for line in out.splitlines() if line.startswith("{")))
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
    elif what == "clean-exit":
        out = subprocess.run([sys.executable, "scripts/clean_exit.py", "--runs", "100"], cwd=ROOT,
                             capture_output=True, text=True).stdout  # fmt: skip
        (RESULTS / "clean_exit.json").write_text(json.dumps(json.loads(out), indent=1) + "\n")
    print(f"recorded {what} in {RESULTS}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--check", action="store_true")
    p.add_argument("--measure", choices=("dlrm", "movielens", "clean-exit", "sharded", "checkpoint", "standard", "oracle"))
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
