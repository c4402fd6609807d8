"""``embtables COMMAND [args...]`` (also ``python -m embtables``).

Commands:
  train       the main job: DLRM on synthetic data, --dataset movielens-100k, or --data FILE --schema FILE
  quickstart  a small CTR model on synthetic data in about ten seconds
  bench       the benchmark suite against the peers (benchmarks/run.py, from a source checkout)
  stats       print lookup statistics files (profile_data_directory) and draw per-shard load
  inspect     what a checkpoint holds (tables, shapes, optimizer, step, size) and its checksum status
  export      write a serving artifact of a checkpoint's tables (float32, float16, bfloat16 or int8)

``embtables COMMAND --help`` for each command's options.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from embtables.checkpoint import CheckpointError, export, inspect
from embtables.checkpoint.serving import DTYPES
from embtables.cli import quickstart, stats, train

_ROOT = Path(__file__).resolve().parent.parent
_SCRIPTS = {"bench": _ROOT / "benchmarks" / "run.py"}
_OWN_PARSERS = {"train": train.main, "quickstart": quickstart.main}  # read every argument after the command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embtables", description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, what in (
        ("train", "the main job (embtables train --help)"),
        ("quickstart", "a ten-second CTR model"),
        ("bench", "benchmarks against the peers"),
    ):
        s = sub.add_parser(name, help=what, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
    stats.add_arguments(sub.add_parser("stats", help="print lookup statistics (and --png a load chart)"))
    inspect.add_arguments(sub.add_parser("inspect", help="what a checkpoint holds, and its checksum status"))
    e = sub.add_parser("export", help="a serving artifact of a checkpoint's tables")
    e.add_argument("checkpoint", help="a checkpoint directory (or a folder of them: the latest is used)")
    e.add_argument("out", help="the artifact's directory (replaced atomically)")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage type (default float32)")
    return p


def _export(args: argparse.Namespace) -> int:
    try:
        report = export(args.checkpoint, args.out, dtype=args.dtype)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"embtables export: {exc}", file=sys.stderr)
        return 1
    print(f"{report.path}: {report.dtype}")
    for name, err in report.max_abs_error.items():
        print(f"  {name:24s} max abs error {err:.3g} (relative {report.relative_error[name]:.3g})")
    return 0


def _run_script(name: str, rest: list[str]) -> int:
    script = _SCRIPTS[name]
    if not script.exists():
        print(
            f"embtables {name}: {script} is not here; it ships with the source checkout "
            "(git clone, then `pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    sys.argv = [f"embtables {name}", *rest]
    sys.path.insert(0, str(_ROOT))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _OWN_PARSERS:
        return _OWN_PARSERS[argv[0]](argv[1:])
    if argv and argv[0] in _SCRIPTS:
        return _run_script(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "inspect":
        return inspect.run(args)
    if args.command == "export":
        return _export(args)
    return stats.run(args)


if __name__ == "__main__":
    sys.exit(main())
