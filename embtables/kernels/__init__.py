"""Layer 1: pure tensor functions (no nn.Module, no torch.distributed)."""

from embtables.kernels.registry import RECORDS, record_of
from embtables.kernels.sparse_update import get_row_update, sparse_update_

__all__ = ["RECORDS", "get_row_update", "record_of", "sparse_update_"]
