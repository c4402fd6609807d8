"""Layer 5: TPUEstimator's embedding API on embtables: ``EmbeddingConfigSpec``, the v1
``*Parameters`` optimizers, feature columns and the ``Estimator`` training loop."""

from embtables.estimator.estimator import Estimator, TrainingInterrupted
from embtables.estimator.feature_columns import (
    bucketized_column,
    categorical_column_with_hash_bucket,
    categorical_column_with_identity,
    categorical_column_with_vocabulary_list,
    embedding_column,
    numeric_column,
    sequence_categorical_column_with_identity,
    shared_embedding_columns,
    weighted_categorical_column,
)
from embtables.estimator.hashing import stable_hash
from embtables.estimator.metrics import accuracy, auc, log_loss, mae, rmse
from embtables.estimator.parameters import (
    AdadeltaParameters,
    AdagradParameters,
    AdamParameters,
    CenteredRMSPropParameters,
    FrequencyEstimatorParameters,
    FtrlParameters,
    MomentumParameters,
    ProximalAdagradParameters,
    ProximalYogiParameters,
    RMSPropParameters,
    StochasticGradientDescentParameters,
)
from embtables.estimator.spec import EmbeddingConfigSpec

__all__ = [
    "AdadeltaParameters",
    "AdagradParameters",
    "AdamParameters",
    "CenteredRMSPropParameters",
    "EmbeddingConfigSpec",
    "Estimator",
    "FrequencyEstimatorParameters",
    "FtrlParameters",
    "MomentumParameters",
    "ProximalAdagradParameters",
    "ProximalYogiParameters",
    "RMSPropParameters",
    "StochasticGradientDescentParameters",
    "TrainingInterrupted",
    "accuracy",
    "auc",
    "bucketized_column",
    "categorical_column_with_hash_bucket",
    "categorical_column_with_identity",
    "categorical_column_with_vocabulary_list",
    "embedding_column",
    "log_loss",
    "mae",
    "numeric_column",
    "rmse",
    "sequence_categorical_column_with_identity",
    "shared_embedding_columns",
    "stable_hash",
    "weighted_categorical_column",
]
