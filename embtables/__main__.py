"""``python -m embtables COMMAND [args...]`` (also the ``embtables`` console script).

Commands:
  train   the main job: a CTR model trained on built-in synthetic data (embtables/cli/train.py)
  bench   the benchmark suite against the peers (benchmarks/run.py); see BENCHMARKS.md
  stats   print lookup statistics files (profile_data_directory) and draw per-shard load
  inspect what a checkpoint holds (tables, shapes, optimizer, step, size) and its checksum status

``bench`` ships with the source checkout; ``python -m embtables train --help``.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from embtables.checkpoint import inspect
from embtables.cli import stats, train

_ROOT = Path(__file__).resolve().parent.parent
_SCRIPTS = {"bench": _ROOT / "benchmarks" / "run.py"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embtables", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, what in (("train", "the main job (synthetic CTR model)"), ("bench", "benchmarks against the peers")):
        s = sub.add_parser(name, help=what, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
    stats.add_arguments(sub.add_parser("stats", help="print lookup statistics (and --png a load chart)"))
    inspect.add_arguments(sub.add_parser("inspect", help="what a checkpoint holds, and its checksum status"))
    return p


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
    if argv and argv[0] == "train":  # its own argparse reads everything after the command
        return train.main(argv[1:])
    if argv and argv[0] in _SCRIPTS:
        return _run_script(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "inspect":
        return inspect.run(args)
    return stats.run(args)


if __name__ == "__main__":
    sys.exit(main())
