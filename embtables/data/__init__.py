"""Synthetic data for examples, tests and benchmarks: a CTR data set with a planted teacher; and small
sample files (``sample_path("clicks.csv")``) for the docs and ``embtables train --data``."""

from embtables.data.samples import sample_path
from embtables.data.synthetic import (
    DEFAULT_FEATURES,
    Batch,
    CategoricalFeature,
    SyntheticCTR,
    SyntheticCTRConfig,
)

__all__ = [
    "DEFAULT_FEATURES",
    "Batch",
    "CategoricalFeature",
    "SyntheticCTR",
    "SyntheticCTRConfig",
    "sample_path",
]
