"""One record per storage type (``kernels/storage_types.py``): every path's numbering and limits derive from it
and agree with it, and the C and Triton kernels read each code as the type the record says (the two numberings
differ: a swap would silently round a bfloat16 table as float16)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from embtables.checkpoint import manifest, serving_codec, store
from embtables.config import tables as config_tables
from embtables.kernels import gpu, native, native_half, stochastic_rounding, storage_types
from embtables.kernels.storage_types import BFLOAT16, FLOAT16, FLOAT32, STORAGE_TYPES


def test_every_path_derives_its_numbering_and_limits_from_the_records() -> None:
    assert tuple(t.name for t in STORAGE_TYPES) == config_tables.STORAGE_TYPES
    for t in STORAGE_TYPES:
        assert t.itemsize == torch.empty(0, dtype=t.dtype).element_size() == manifest.STATE_DTYPES[t.name]
        assert t.max_finite == torch.finfo(t.dtype).max
        assert native_half.KINDS[t.dtype] == t.c_kind and gpu.GPU_CODES[t.dtype] == t.gpu_code
        assert store._SAFETENSORS_DTYPES[t.name] == t.safetensors
        assert t.half == (t is not FLOAT32) and storage_types.of(t.dtype) is t
    assert len({t.c_kind for t in STORAGE_TYPES}) == len({t.gpu_code for t in STORAGE_TYPES}) == 3
    assert {"bfloat16": BFLOAT16.max_finite, "float16": FLOAT16.max_finite} == serving_codec._LIMITS
    assert stochastic_rounding.FLOAT16_MAX == 65504.0
    with pytest.raises(TypeError, match="not a storage type"):
        storage_types.of(torch.float64)


def test_the_c_kernels_read_each_kind_as_its_type() -> None:
    """et_round_rows rounds with the kind the record gives: 70000 overflows float16 and not bfloat16, and 1 + 2^-9
    is exact in float16 only."""
    values = torch.tensor([[70000.0, 1.0 + 2.0**-9]])
    rows = torch.zeros(1, dtype=torch.int64)
    half = native.round_rows(values, rows, 0, 0, 0, torch.float16)
    brain = native.round_rows(values, rows, 0, 0, 0, torch.bfloat16)
    if half is None or brain is None:
        pytest.skip("the native library is not built here")
    assert torch.isinf(half[0, 0].float()) and half[0, 1].float() == 1.0 + 2.0**-9
    assert torch.isfinite(brain[0, 0].float()) and brain[0, 1].dtype == torch.bfloat16


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_triton_kernels_number_the_types_as_the_records() -> None:
    from embtables.kernels import triton_common, triton_lookup

    assert triton_common.T_FLOAT32.value == FLOAT32.gpu_code
    assert triton_common.T_BFLOAT16.value == BFLOAT16.gpu_code
    assert triton_common.T_FLOAT16.value == FLOAT16.gpu_code
    assert triton_lookup.T_MIXED.value not in {t.gpu_code for t in STORAGE_TYPES}
    assert np.float16(FLOAT16.max_finite) == np.finfo(np.float16).max
