"""Layer 1: pure tensor functions (no nn.Module, no torch.distributed)."""

from embtables.kernels.sparse_update import ROW_UPDATES, get_row_update, sparse_update_

__all__ = ["ROW_UPDATES", "get_row_update", "sparse_update_"]
