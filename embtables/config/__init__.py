"""Layer 0: configuration values. Pure Python; never allocates tensors."""

from embtables.config.catalogue import OPTIMIZER_TYPES, Optimizer
from embtables.config.dynamic_vocabulary import DynamicVocabulary
from embtables.config.extra_optimizers import (
    Adadelta,
    CenteredRMSProp,
    FrequencyEstimator,
    Momentum,
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
)
from embtables.config.offload import Offload
from embtables.config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam
from embtables.config.resolve import ResolvedConfig, ResolvedFeature, ResolvedTable, resolve
from embtables.config.tables import Combiner, FeatureConfig, QuantizationConfig, TableConfig

__all__ = [
    "FTRL",
    "OPTIMIZER_TYPES",
    "SGD",
    "Adadelta",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "CenteredRMSProp",
    "Combiner",
    "DynamicVocabulary",
    "FeatureConfig",
    "FrequencyEstimator",
    "Momentum",
    "Offload",
    "Optimizer",
    "ProximalAdagrad",
    "ProximalYogi",
    "QuantizationConfig",
    "RMSProp",
    "ResolvedConfig",
    "ResolvedFeature",
    "ResolvedTable",
    "TableConfig",
    "resolve",
]
