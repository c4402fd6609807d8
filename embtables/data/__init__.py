"""Synthetic data for examples, tests and benchmarks: a CTR data set with a planted teacher."""

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
]
