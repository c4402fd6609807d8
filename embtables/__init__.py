"""embtables: TPU-embedding tables and fused sparse optimizers, with TF's numerics, in PyTorch."""

from embtables.api import DistributedEmbedding
from embtables.checkpoint import CheckpointError, ServingEmbedding, export
from embtables.config import (
    FTRL,
    SGD,
    Adadelta,
    Adagrad,
    AdagradMomentum,
    Adam,
    CenteredRMSProp,
    Combiner,
    DynamicVocabulary,
    FeatureConfig,
    FrequencyEstimator,
    Momentum,
    Offload,
    ProximalAdagrad,
    ProximalYogi,
    QuantizationConfig,
    RMSProp,
    TableConfig,
)
from embtables.errors import ClosedFilesError, ConfigError, InputError, TornFilesError
from embtables.estimator.scoring_model import ScoringModel, load_model
from embtables.tables import Constant, Ragged, RowIdInitializer, TruncatedNormal

__version__ = "0.1.0"

__all__ = [
    "FTRL",
    "SGD",
    "Adadelta",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "CenteredRMSProp",
    "CheckpointError",
    "ClosedFilesError",
    "Combiner",
    "ConfigError",
    "Constant",
    "DistributedEmbedding",
    "DynamicVocabulary",
    "FeatureConfig",
    "FrequencyEstimator",
    "InputError",
    "Momentum",
    "Offload",
    "ProximalAdagrad",
    "ProximalYogi",
    "QuantizationConfig",
    "RMSProp",
    "Ragged",
    "RowIdInitializer",
    "ScoringModel",
    "ServingEmbedding",
    "TableConfig",
    "TornFilesError",
    "TruncatedNormal",
    "__version__",
    "export",
    "load_model",
]
