"""embtables: TPU-embedding tables and fused sparse optimizers, with TF's numerics, in PyTorch."""

from embtables.api import DistributedEmbedding
from embtables.checkpoint import CheckpointError, ServingEmbedding, export
from embtables.config import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    Combiner,
    FeatureConfig,
    QuantizationConfig,
    TableConfig,
)
from embtables.errors import ConfigError, InputError
from embtables.tables import Constant, Ragged, RowIdInitializer, TruncatedNormal

__version__ = "0.1.0"

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "CheckpointError",
    "Combiner",
    "ConfigError",
    "Constant",
    "DistributedEmbedding",
    "FeatureConfig",
    "InputError",
    "QuantizationConfig",
    "Ragged",
    "RowIdInitializer",
    "ServingEmbedding",
    "TableConfig",
    "TruncatedNormal",
    "__version__",
    "export",
]
