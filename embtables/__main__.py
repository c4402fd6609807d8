"""``python -m embtables {train,bench} [args...]`` (also the ``embtables`` console script).

- ``train``: the main job, a CTR model trained on built-in synthetic data (``examples/quickstart.py``).
- ``bench``: the benchmark suite against the peers (``benchmarks/run.py``); see BENCHMARKS.md.

Both live in the source checkout next to the package; arguments after the command are passed on
(``python -m embtables bench --help``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_COMMANDS = {"train": _ROOT / "examples" / "quickstart.py", "bench": _ROOT / "benchmarks" / "run.py"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        print(__doc__, file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    script = _COMMANDS[args[0]]
    if not script.exists():
        print(
            f"embtables {args[0]}: {script} is not here; it ships with the source checkout "
            "(git clone, then `pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args[1:]]
    sys.path.insert(0, str(_ROOT))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
