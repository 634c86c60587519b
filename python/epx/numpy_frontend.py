"""The numpy frontend: numpy arrays on the CPU backend."""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from ._lib import DType
from .dtypes import _NP_BF16, _NP_FP8
from .frontend import _Frontend


# uint8 is a bool map or fp8 bits; uint16 holds bf16 bits where numpy has no bfloat16
_NUMPY_CODES = [(np.float32, (DType.FLOAT32,)), (np.uint16, (DType.BFLOAT16,)), (_NP_BF16, (DType.BFLOAT16,)),
                (_NP_FP8, (DType.FP8_E4M3,)), (np.uint8, (DType.BOOL, DType.FP8_E4M3)), (np.bool_, (DType.BOOL,)),
                (np.int32, (DType.INT32,)), (np.int64, (DType.INT64,))]


class _NumpyFrontend(_Frontend):
    name = "numpy"
    array_type = np.ndarray
    code_table = _NUMPY_CODES

    @staticmethod
    def device(a) -> str:
        return "cpu"

    @staticmethod
    def ptr(a) -> Optional[int]:
        """The data pointer; never NULL for an empty array (the library reads NULL as 'not
        given'), a spare 16 bytes stand in."""
        if a is None:
            return None
        return a.ctypes.data if a.size else _SPARE.ctypes.data

    @staticmethod
    def contiguous(a):
        return np.ascontiguousarray(a)

    @staticmethod
    def is_contiguous_writable(a) -> bool:
        return a.flags.c_contiguous and a.flags.writeable

    @staticmethod
    def convert(a, code: DType):
        """Converts an input to float32 / int64 / bool (weights, ids, maps) where that loses
        nothing of meaning; None when it would (float ids, say)."""
        kind = a.dtype.kind
        if code == DType.FLOAT32 and kind == "f":
            return np.ascontiguousarray(a, dtype=np.float32)
        if code == DType.INT64 and kind in "iu":
            return np.ascontiguousarray(a, dtype=np.int64)
        if code == DType.BOOL and kind in "biuf":
            return np.ascontiguousarray(a != 0)
        return None

    @staticmethod
    def concrete(code: DType, like=None):
        if code == DType.FLOAT32:
            return np.float32
        if code == DType.BFLOAT16:
            if like is not None and like.dtype == np.uint16:
                return np.uint16
            return _NP_BF16 if _NP_BF16 is not None else np.uint16
        if code == DType.FP8_E4M3:
            if like is not None and like.dtype == np.uint16:
                return np.uint8
            return _NP_FP8 if _NP_FP8 is not None else np.uint8
        return {DType.INT32: np.int32, DType.INT64: np.int64, DType.BOOL: np.bool_}[code]

    @classmethod
    def alloc(cls, shape, code: DType, like=None, device=None, zero=True):
        dt = cls.concrete(code, like)
        return np.zeros(shape, dt) if zero else np.empty(shape, dt)

    @staticmethod
    def on_stream(comm, device: str):
        """Context around one C call: the CUDA frontend points the comm at the caller's stream."""
        return contextlib.nullcontext()

    @staticmethod
    def host_int(a) -> Optional[int]:
        """The value of a one-element array, when it lives on the host."""
        return int(a.reshape(-1)[0])


_SPARE = np.zeros(16, np.uint8)
_NUMPY = _NumpyFrontend()
