#!/usr/bin/env python3
"""embtables quickstart: train a small click-through-rate model on synthetic data.

The job lives in the package (``embtables/cli/quickstart.py``) so that ``embtables quickstart`` works
from an installed wheel; this script runs it from a checkout (``embtables train`` is the bigger job):

    python examples/quickstart.py                       # Adagrad, 2000 steps, ~10 s on 2 CPU cores
    python examples/quickstart.py --optimizer ftrl --steps 500 --seed 1
"""

from __future__ import annotations

import sys

from embtables.cli.quickstart import main, roc_auc

__all__ = ["main", "roc_auc"]

if __name__ == "__main__":
    sys.exit(main())
