"""Layer 2: single-process table state, inputs, lookup and the fused update."""

from embtables.tables.collection import EmbeddingCollection
from embtables.tables.initializers import Constant, RowIdInitializer, TruncatedNormal
from embtables.tables.inputs import FeatureBatch, InputConverter
from embtables.tables.ragged import Ragged
from embtables.tables.state import TableState

__all__ = [
    "Constant",
    "EmbeddingCollection",
    "FeatureBatch",
    "InputConverter",
    "Ragged",
    "RowIdInitializer",
    "TableState",
    "TruncatedNormal",
]
