"""One record per storage type of a table's rows and slots (docs/spec.md §12): everything the kernels, the
checkpoints and the exports know about float32, bfloat16 and float16, which every path derives from.

``TableConfig(dtype=, slot_dtype=)`` names them (``config.tables.STORAGE_TYPES``, which the config layer keeps
without torch; a test checks it lists these). The C kernels number them by ``c_kind`` (``csrc/half_tables.c``),
the Triton kernels by ``gpu_code`` (``triton_common.T_*``); the two numberings differ and are only read here.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StorageType:
    """One storage type.

    Attributes:
      name: its name in configs, manifests and exports ("float32", "bfloat16", "float16").
      dtype: the torch dtype the rows are held in.
      c_kind: the C kernels' number for it (``et_load_row``'s ``kind``, ``et_round_rows``' ``kind``).
      gpu_code: the Triton kernels' number for it (``ROW_TYPE`` / ``SLOT_TYPE`` / ``TYPE``).
      itemsize: bytes a value (checkpoint blocks, files of offloaded tables).
      max_finite: its largest finite value; a value of larger magnitude is not representable (an overflow).
      safetensors: the dtype a safetensors header names it by.
      half: rounded from float32 when written (``TableConfig(rounding=)``: "stochastic" or "nearest").
    """

    name: str
    dtype: torch.dtype
    c_kind: int
    gpu_code: int
    itemsize: int
    max_finite: float
    safetensors: str
    half: bool


FLOAT32 = StorageType("float32", torch.float32, 2, 0, 4, 3.4028234663852886e38, "F32", False)
BFLOAT16 = StorageType("bfloat16", torch.bfloat16, 0, 1, 2, 3.3895313892515355e38, "BF16", True)
FLOAT16 = StorageType("float16", torch.float16, 1, 2, 2, 65504.0, "F16", True)
STORAGE_TYPES = (FLOAT32, BFLOAT16, FLOAT16)
BY_NAME = {t.name: t for t in STORAGE_TYPES}
BY_DTYPE = {t.dtype: t for t in STORAGE_TYPES}


def of(dtype: torch.dtype) -> StorageType:
    """The record of ``dtype``; ``TypeError`` for a type tables are never stored in."""
    record = BY_DTYPE.get(dtype)
    if record is None:
        raise TypeError(f"{dtype} is not a storage type of embedding tables ({', '.join(BY_NAME)}).")
    return record
