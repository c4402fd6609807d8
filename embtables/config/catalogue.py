"""Every optimizer config embtables trains with: the five TF v2 classes and the seven TPUEstimator-era
ones (``extra_optimizers``). ``OPTIMIZER_TYPES`` is what ``TableConfig`` and ``DistributedEmbedding``
accept; ``Optimizer`` is its type."""

from __future__ import annotations

from embtables.config.extra_optimizers import (
    EXTRA_OPTIMIZER_TYPES,
    Adadelta,
    CenteredRMSProp,
    FrequencyEstimator,
    Momentum,
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
)
from embtables.config.optimizers import _COMMON_DOC, CORE_OPTIMIZER_TYPES, FTRL, SGD, Adagrad, AdagradMomentum, Adam

OPTIMIZER_TYPES = CORE_OPTIMIZER_TYPES + EXTRA_OPTIMIZER_TYPES
Optimizer = (
    SGD
    | Adagrad
    | AdagradMomentum
    | Adam
    | FTRL
    | ProximalAdagrad
    | Momentum
    | RMSProp
    | CenteredRMSProp
    | Adadelta
    | ProximalYogi
    | FrequencyEstimator
)

for _cls in EXTRA_OPTIMIZER_TYPES:
    _cls.__doc__ = (_cls.__doc__ or "") + _COMMON_DOC
