"""Layer 0: configuration values. Pure Python; never allocates tensors."""

from embtables.config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, Optimizer
from embtables.config.resolve import ResolvedConfig, ResolvedFeature, ResolvedTable, resolve
from embtables.config.tables import Combiner, FeatureConfig, QuantizationConfig, TableConfig

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "Combiner",
    "FeatureConfig",
    "Optimizer",
    "QuantizationConfig",
    "ResolvedConfig",
    "ResolvedFeature",
    "ResolvedTable",
    "TableConfig",
    "resolve",
]
