"""embtables COMMAND [args...] (also python -m embtables): the TPU embedding system, running anywhere.

Run "embtables COMMAND --help" for a command's options. Errors are one line on stderr with exit
code 2; --debug (or EMBTABLES_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import runpy
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import embtables
from embtables.checkpoint import export, increments, inspect
from embtables.checkpoint.serving_codec import DTYPES
from embtables.cli import model_files, predict, quickstart, serve, stats, train
from embtables.cli.job_runner import DEBUG_ENV, ROUTINE, Parser, debugging, fail

_ROOT = Path(__file__).resolve().parent.parent
_SCRIPTS = ("bench",)
_OWN_PARSERS = {"train": train.main, "quickstart": quickstart.main}  # read every argument after the command
_COMMANDS = (
    ("train", "the main job: DLRM on synthetic data, --dataset movielens-100k, or --data FILE --schema FILE"),
    ("quickstart", "a small CTR model on synthetic data (~7 s)"),
    (
        "bench",
        "the benchmark suite against the peers (embtables bench --help); embtables bench "
        "latency | estimator | sharded | checkpoint | movielens | extra-optimizers | noacc | dynamic | incremental | "
        "precision | rounding | subnormals | offload | online | gpu-launches for the others; on a GPU: "
        "embtables bench --device cuda",
    ),
    ("stats", "print lookup statistics files (profile_data_directory) and draw per-shard load"),
    ("inspect", "what a checkpoint holds (tables, shapes, optimizer, step, size) and its checksum status"),
    (
        "export",
        "write a serving artifact of a checkpoint's tables (float32, float16, bfloat16 or int8), or with "
        "--model the whole model (tables, dense part, columns, normalisation) for load_model / predict / serve",
    ),
    (
        "predict",
        "score the rows of a CSV or Parquet file with a model (an --model export, or a --data model directory)",
    ),
    ("serve", "serve a model export over HTTP (JSON predictions, health, live updates as training exports)"),
)


def _parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = Parser(
        prog="embtables", description=doc.splitlines()[0], epilog="\n".join(doc.splitlines()[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"embtables {embtables.__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also EMBTABLES_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=Parser)
    sub.required = True
    parsers = {name: sub.add_parser(name, help=what, description=what) for name, what in _COMMANDS}
    for name in ("train", "quickstart", "bench"):
        parsers[name].add_argument("rest", nargs=argparse.REMAINDER)
    stats.add_arguments(parsers["stats"])
    inspect.add_arguments(parsers["inspect"])
    e = parsers["export"]
    e.add_argument("checkpoint", help="a checkpoint directory (or a folder of them: the latest is used)")
    e.add_argument("out", help="a new or empty directory, or an earlier export (replaced atomically)")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage type (default float32)")
    e.add_argument(
        "--model", action="store_true",
        help="the whole model for scoring (embtables.load_model, predict, serve): CHECKPOINT is a model directory "
        "of embtables train --data (or a checkpoint in one)",
    )  # fmt: skip
    e.add_argument(
        "--incremental", action="store_true",
        help="when OUT is an export of an earlier checkpoint of the same chain: write only a delta of the rows "
        "changed since (ServingEmbedding.update applies it)",
    )  # fmt: skip
    predict.add_arguments(parsers["predict"])
    serve.add_arguments(parsers["serve"])
    return p


def _export(args: argparse.Namespace) -> int:
    increments.show_full_writes()  # --incremental: a full export instead says so, and why
    if args.model:
        done = model_files.export_model_dir(args.checkpoint, args.out, args.dtype, args.incremental)
        what = "added step" if done.incremental else "model artifact"
        print(f"{done.path}: {what} {done.step}, tables {done.dtype} (embtables predict / serve, embtables.load_model)")
        return 0
    report = export(args.checkpoint, args.out, dtype=args.dtype, incremental=args.incremental)
    if args.incremental and not report.max_abs_error:
        print(f"{report.path}: {report.dtype}, " + (f"delta {report.delta}" if report.delta else "nothing new"))
        return 0
    print(f"{report.path}: {report.dtype}")
    for name, err in report.max_abs_error.items():
        bad = report.nonfinite.get(name, 0)
        note = f"  ({bad} NaN/Inf values in the checkpoint, exported as they are)" if bad else ""
        print(f"  {name:24s} max abs error {err:.3g} (relative {report.relative_error[name]:.3g}){note}")
    return 0


def _benchmarks_dir() -> Path | None:
    """The benchmark suite: the checkout's ``benchmarks/``, else the copy shipped in the wheel."""
    for where in (_ROOT / "benchmarks", Path(__file__).resolve().parent / "_benchmarks"):
        if (where / "run.py").is_file() and (where / "__init__.py").is_file():
            return where
    return None


# ``embtables bench <name>``: the benchmarks beside the standard suite (``embtables bench`` alone).
_BENCHES = {
    "latency": "bench_latency",
    "estimator": "bench_estimator",
    "sharded": "bench_sharded",
    "checkpoint": "bench_checkpoint",
    "movielens": "bench_movielens",
    "extra-optimizers": "bench_extra_optimizers",
    "noacc": "bench_noacc",
    "dynamic": "bench_dynamic",
    "incremental": "bench_incremental",
    "precision": "bench_precision",
    "rounding": "bench_rounding",
    "subnormals": "bench_subnormals",
    "offload": "bench_offload",
    "gpu": "bench_gpu",
    "gpu-launches": "bench_gpu_launches",
    "online": "bench_online",
}


def _run_script(name: str, rest: list[str]) -> int:
    """Run ``benchmarks/run.py`` as ``embtables bench`` (or ``embtables bench <name>`` for another
    benchmark) with ``benchmarks`` importable as a package, from a checkout or from the copy inside an
    installed wheel; importable by path too, so the processes a benchmark spawns find it."""
    where = _benchmarks_dir()
    if where is None:
        return fail(f"embtables {name}", "the benchmark suite is not installed with this embtables")
    link_dir = Path(tempfile.mkdtemp(prefix="embtables-bench-"))
    (link_dir / "benchmarks").symlink_to(where, target_is_directory=True)
    sys.path.insert(0, str(link_dir))
    sys.modules.pop("benchmarks", None)
    if rest[:2] == ["--device", "cuda"] or any(a == "--device=cuda" for a in rest[:1]):
        rest = ["gpu", *rest]  # `embtables bench --device cuda`: the GPU benchmark
    try:
        if rest and rest[0] in _BENCHES:
            module = importlib.import_module(f"benchmarks.{_BENCHES[rest[0]]}")
            sys.argv = [f"embtables {name} {rest[0]}", *rest[1:]]
            code = module.main() if rest[0] == "noacc" else module.main(rest[1:])
            return int(code or 0)
        sys.argv = [f"embtables {name}", *rest]
        runpy.run_path(str(where / "run.py"), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        shutil.rmtree(link_dir, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    while argv and argv[0] == "--debug":  # `embtables --debug COMMAND ...`: every command's tracebacks
        os.environ[DEBUG_ENV] = "1"
        argv = argv[1:]
    if argv and argv[0] in _OWN_PARSERS:
        return _OWN_PARSERS[argv[0]](argv[1:])
    if argv and argv[0] in _SCRIPTS:
        return _run_script(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect.run(args)
        if args.command == "export":
            return _export(args)
        if args.command == "predict":
            return predict.run(args)
        if args.command == "serve":
            return serve.run(args)
        return stats.run(args)
    except ROUTINE as exc:
        if debugging(args):
            raise
        return fail(f"embtables {args.command}", exc)


def run() -> NoReturn:
    """The ``embtables`` program: ``main()``, then exit without tearing the interpreter down. The exit
    handlers run (process groups are left, logs flushed) and the streams are flushed, but the modules
    are not finalised one by one: that took 0.4-0.6 s after every command, most of it torch's, a tenth
    of a MovieLens run. Every file the jobs write is closed (and checkpoints fsynced) before ``main``
    returns."""
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
