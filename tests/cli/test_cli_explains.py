"""A CLI that explains (issue 22, items 6 and 9), through real subprocesses: routine mistakes are one
line on stderr with exit code 2; --steps/--epochs are totals and a rerun says it resumed; Ctrl-C saves,
prints the command that resumes and exits 130 quickly; default model dirs do not pile up in the temp
dir; --version and plain help."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import fast_child
import pytest
from subproc import ROOT

SMALL = ["--small", "--batch-size", "64", "--eval-size", "256", "--no-progress"]


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "EMBTABLES_DEBUG": ""}


def _run(tmp: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return fast_child.run(
        [sys.executable, "-m", "embtables", *args], capture_output=True, text=True, env=_env(tmp), cwd=tmp,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "d.csv").write_text("clicked,user,country\n1,3,US\n0,5,FR\n1,3,IN\n0,7,US\n1,2,FR\n0,1,US\n")
    (tmp_path / "strings.csv").write_text("clicked,user,country\nyes,3,US\nno,5,FR\n")
    (tmp_path / "nan.csv").write_text("clicked,user,country\n1,3,US\n,5,FR\n1,3,US\n")
    (tmp_path / "big_ids.csv").write_text("clicked,user,country\n1,3,US\n0,50,FR\n1,3,US\n0,3,US\n")
    schema = '{"label": "clicked", "features": {"user": {"type": "identity", "num_buckets": 10}, '
    schema += '"country": {"type": "vocabulary", "vocabulary": ["US", "FR", "IN"]}}}'
    (tmp_path / "s.json").write_text(schema)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "model" / "tables").mkdir(parents=True)  # a model artifact's serving export (its marker)
    (tmp_path / "model" / "tables" / ".embtables-export").write_text('{"files": []}')
    return tmp_path


MISTAKES = [
    (["train", "--data", "missing.csv", "--schema", "s.json"], "--data missing.csv: no such file"),
    (["train", "--data", "d.csv", "--schema", "missing.json"], "--schema missing.json: no such file"),
    (["train", "--data", "d.csv", "--schema", "d.csv"], "is not JSON"),
    (["train", "--data", "d.csv", "--schema", "list.json"], "must hold a JSON object"),
    (["train", "--data", "strings.csv", "--schema", "s.json"], "is not numeric"),
    (["train", "--data", "nan.csv", "--schema", "s.json"], "empty or NaN"),
    (["train", "--data", "big_ids.csv", "--schema", "s.json", "--batch-size", "1"], "id 50 is outside"),
    (["train", "--model-dir", "a_file", *SMALL], "is a file, not a directory"),
    (["train", "--eval-fraction", "2"], "--eval-fraction must be"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["quickstart", "--device", "nonsense"], "is not a torch device"),
    (["quickstart", "--device", "cuda:0"], "no CUDA device"),
    (["quickstart", "--dense-lr", "nan"], "--dense-lr must be a finite number >= 0"),
    (["export", "nothing_here", "out"], "no checkpoint at nothing_here"),
    (["inspect", "nothing_here"], "no checkpoint at nothing_here"),
    (["inspect", "model"], "It holds a serving export (model/tables"),
    (["train", "--data", "d.csv", "--schema", "s.json", "--export-to", "model"], "not written by export_model"),
    (["train", "--dataset", "adult", "--data-dir", "nothere"], "--data-dir nothere: no such file or directory"),
    (["train", "--dataset", "movielens-100k", "--data-dir", "nothere"], "nothere: neither GroupLens files"),
    (["stats", "nothere"], "nothere: no such directory"),
    (["stats", "empty"], "no lookup statistics files in empty"),
]


@pytest.mark.parametrize("args, message", MISTAKES, ids=[" ".join(a)[:40] for a, _ in MISTAKES])
def test_a_routine_mistake_is_one_line_and_exit_code_2(files: Path, args: list[str], message: str) -> None:
    if args[:2] == ["quickstart", "--device"] and args[2].startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    out = _run(files, *args)
    assert out.returncode == 2, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_debug_shows_the_traceback(files: Path) -> None:
    out = _run(files, "--debug", "inspect", "nothing_here")
    assert out.returncode != 0 and "Traceback" in out.stderr
    out = _run(files, "--debug", "train", "--dataset", "adult", "--data-dir", "nothere")  # before any command
    assert out.returncode != 0 and "Traceback" in out.stderr and "FileNotFoundError" in out.stderr


def _without(files: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``embtables ARGS`` in a process where ``module`` cannot be imported (a bare install)."""
    code = f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = ['embtables', *{list(args)!r}]; "
    code += "runpy.run_module('embtables', run_name='__main__')"
    return fast_child.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(files), cwd=files,
                          timeout=240)  # fmt: skip


def test_a_missing_optional_package_says_how_to_install_it(files: Path) -> None:
    out = _without(files, "pandas", "train", "--dataset", "adult", "--no-progress")
    assert out.returncode == 2 and "pip install 'embtables[data]'" in out.stderr, out.stderr
    out = _without(files, "matplotlib", "train", *SMALL, "--steps", "5", "--eval-every", "5", "--model-dir", "m")
    assert out.returncode == 0 and "curves: not drawn (matplotlib is not installed" in out.stdout, out.stdout


def test_version_and_plain_help(files: Path) -> None:
    import embtables

    out = _run(files, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"embtables {embtables.__version__}"
    text = _run(files, "--help").stdout
    assert "``" not in text
    for command in ("train", "quickstart", "bench", "stats", "inspect", "export"):
        assert sum(line.split()[:1] == [command] for line in text.splitlines()) == 1, command
    assert "``" not in _run(files, "train", "--help").stdout


def test_steps_are_a_total_and_a_rerun_says_it_resumed(files: Path) -> None:
    first = _run(files, "train", *SMALL, "--steps", "30", "--eval-every", "30", "--model-dir", "m")
    assert first.returncode == 0, first.stderr
    assert "resumed" not in first.stdout
    again = _run(files, "train", *SMALL, "--steps", "30", "--eval-every", "30", "--model-dir", "m")
    assert again.returncode == 0, again.stderr
    assert "resumed from step 30 in m" in again.stdout and "nothing to train" in again.stdout
    assert "PASS" not in again.stdout and "finished" in again.stdout
    more = _run(files, "train", *SMALL, "--steps", "40", "--eval-every", "40", "--model-dir", "m")
    assert "resumed from step 30 in m" in more.stdout and '"steps": 40' in more.stdout, more.stdout
    changed = _run(files, "train", *SMALL, "--steps", "50", "--dim", "8", "--model-dir", "m")
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "different --dim" in changed.stderr, changed.stderr


def test_data_epochs_are_a_total(files: Path) -> None:
    args = ["train", "--data", "d.csv", "--schema", "s.json", "--batch-size", "2", "--no-progress", "--model-dir", "m"]
    assert _run(files, *args, "--epochs", "2").returncode == 0
    again = _run(files, *args, "--epochs", "2")
    assert again.returncode == 0 and "resumed from step" in again.stdout and "evaluating only" in again.stdout
    assert '"steps": 6,' in again.stdout  # 5 training rows, batches of 2: 3 steps per epoch, 2 epochs


def test_ctrl_c_saves_prints_the_resume_command_and_exits_130(files: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "embtables", "train", *SMALL, "--steps", "1000000", "--eval-every", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(files), cwd=files,
    )  # fmt: skip
    assert proc.stdout is not None
    while "tables:" not in proc.stdout.readline():
        pass
    time.sleep(4)  # training
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 130, err
    assert took < 3.0, took  # measured 1.4 s on the 2-core machine
    assert "Traceback" not in err and "checkpoint saved at" in err
    command = err.strip().splitlines()[-1].split()
    assert command[:2] == ["embtables", "train"] and "--model-dir" in command
    model_dir = Path(command[command.index("--model-dir") + 1])
    assert list(model_dir.glob("ckpt-*"))  # the interrupted run's temporary dir is kept: it is needed to resume
    steps = command.index("--steps") + 1
    command[steps] = str(int(next(model_dir.glob("ckpt-*")).name.split("-")[1]) + 5)
    resumed = _run(files, *command[1:])
    assert resumed.returncode == 0 and "resumed from step" in resumed.stdout, resumed.stderr


def test_default_model_dirs_are_removed_at_exit_unless_kept(files: Path) -> None:
    def ours() -> list[str]:
        return sorted(p.name for p in files.iterdir() if p.name.startswith("embtables-"))

    assert _run(files, "train", *SMALL, "--steps", "10", "--eval-every", "10").returncode == 0
    assert ours() == []
    kept = _run(files, "train", *SMALL, "--steps", "10", "--eval-every", "10", "--keep")
    assert kept.returncode == 0 and len(ours()) == 1


def test_the_installed_wheel_has_bench_and_the_samples(tmp_path: Path) -> None:
    """`embtables bench` and the sample data work from an installed wheel, not only from a checkout."""
    import zipfile

    wheel_dir = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w",
         str(wheel_dir)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheel_dir.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("embtables/_benchmarks/run.py", "embtables/_benchmarks/_harness.py",
                   "embtables/data/samples/clicks.csv", "embtables/data/samples/clicks.schema.json"):  # fmt: skip
        assert needed in names, needed
    venv = tmp_path / "venv"
    # A bare venv that sees this interpreter's packages (torch, numpy) through a path entry: `--system-site-packages`
    # from inside a venv would see the base interpreter's packages instead, which have no torch.
    # No pip inside it (ensurepip takes seconds): this interpreter's pip installs into it (``pip --python``).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    inner = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    outer = sysconfig.get_paths()["purelib"]
    (Path(inner) / "outer-packages.pth").write_text(outer + "\n")  # a plain path: no editable finder comes along
    # Without PYTHONPATH (a run from a worktree sets it): pip would see the package there and install nothing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                              str(wheel)], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    where = subprocess.run([str(py), "-c", "import embtables; print(embtables.__file__)"], capture_output=True,
                           text=True, cwd="/", env=env)  # fmt: skip
    assert str(venv) in where.stdout, where.stdout + where.stderr
    bench = subprocess.run([str(py), "-m", "embtables", "bench", "--help"], capture_output=True, text=True, cwd="/",
                           env=env, timeout=120)  # fmt: skip
    assert bench.returncode == 0 and bench.stdout.startswith("usage: embtables bench"), bench.stdout + bench.stderr
    sample = subprocess.run([str(py), "-c", "from embtables.data import sample_path; print(sample_path('clicks.csv'))"],
                            capture_output=True, text=True, cwd="/", env=env)  # fmt: skip
    assert str(venv) in sample.stdout and Path(sample.stdout.strip()).is_file()
