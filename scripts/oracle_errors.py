"""Max abs error of the float32 engine against the float64 oracle, per optimizer config and kernel path.

    python3 scripts/oracle_errors.py [--examples 40] [--json]

Uses the same hypothesis scenarios as tests/numerics (drawn with fixed seeds) and prints a
Markdown table (or, with ``--json``, one JSON object ``{config: {path: {activations, tables, slots}}}``):
activations, tables and slots, over every step of every scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "numerics"))

from hypothesis import HealthCheck, given, seed, settings
from scenarios import scenarios
from test_engine_vs_oracle import OPTIMIZERS, run_against_oracle

from embtables.kernels import native


def _worst(name: str, examples: int) -> dict[str, float]:
    """The largest errors of optimizer config ``name`` over ``examples`` seeded scenarios."""
    worst = {"activations": 0.0, "tables": 0.0, "slots": 0.0}

    @seed(1234)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(sc=scenarios())
    def collect(sc: object) -> None:
        errors = run_against_oracle(sc, OPTIMIZERS[name]())  # type: ignore[arg-type]
        for k, v in errors.items():
            worst[k] = max(worst[k], v)

    collect()
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    random.seed(0)
    if not args.json:
        print("| optimizer config | path | activations | tables | slots |")
        print("| --- | --- | --- | --- | --- |")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name in sorted(OPTIMIZERS):
        for path in ("native", "torch"):
            native.set_enabled(path == "native")
            worst = _worst(name, args.examples)
            result.setdefault(name, {})[path] = worst
            if not args.json:
                cells = " | ".join(f"{worst[k]:.2e}" for k in ("activations", "tables", "slots"))
                print(f"| {name} | {path} | {cells} |")
    native.set_enabled(True)
    if args.json:
        print(json.dumps({"examples": args.examples, "worst": result}))


if __name__ == "__main__":
    main()
