"""Data types on numpy: the names epx takes for them, exact bf16 and fp8 e4m3 conversions, and
fp8 quantisation as dispatch does it.

  * float32 always works.
  * bfloat16: ``ml_dtypes.bfloat16`` arrays when ml_dtypes is installed; otherwise (or as
    well) ``uint16`` arrays holding bf16 bit patterns are taken as bfloat16. Outputs follow
    the input: bf16 in as ``uint16`` gives bf16 out as ``uint16``.
    :func:`float32_to_bf16_bits` / :func:`bf16_bits_to_float32` convert exactly (round to
    nearest even, as every backend does).
  * fp8 e4m3 (dispatch output only): ``ml_dtypes.float8_e4m3fn`` when installed and the input
    is not bit-typed, else ``uint8`` bit patterns; :func:`e4m3_to_float32` decodes them.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from . import _lib
from ._lib import DType
from .errors import _dtype_error

try:  # optional: real bfloat16 / float8 numpy dtypes
    import ml_dtypes as _ml_dtypes

    _NP_BF16 = np.dtype(_ml_dtypes.bfloat16)
    _NP_FP8 = np.dtype(_ml_dtypes.float8_e4m3fn)
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    _NP_BF16 = None
    _NP_FP8 = None


_DTYPE_NAMES = {
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32, "f32": DType.FLOAT32,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "fp8": DType.FP8_E4M3, "e4m3": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3, "float8_e4m3fn": DType.FP8_E4M3,
}


def _parse_float_dtype(spec) -> DType:
    """'float32' / 'bf16' / 'fp8' / DType / a numpy or torch dtype -> DType."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        key = spec.lower().replace("torch.", "")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    s = str(spec).replace("torch.", "")
    if s in _DTYPE_NAMES:
        return _DTYPE_NAMES[s]
    try:
        d = np.dtype(spec)
    except TypeError:
        d = None
    if d is not None:
        if d == np.float32:
            return DType.FLOAT32
        if d == np.uint16 or (_NP_BF16 is not None and d == _NP_BF16):
            return DType.BFLOAT16
        if _NP_FP8 is not None and d == _NP_FP8:
            return DType.FP8_E4M3
    _dtype_error(f"unsupported data type {spec!r}: use float32, bfloat16 or (dispatch output) fp8")


def float32_to_bf16_bits(a) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN -> 0x7fff (as epx)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    r[(u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = 0x7FFF
    return r


def bf16_bits_to_float32(a) -> np.ndarray:
    """bf16 bit patterns (uint16, or an ml_dtypes.bfloat16 array) -> float32, exactly."""
    a = np.ascontiguousarray(a)
    if a.dtype != np.uint16:
        a = a.view(np.uint16)
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


_E4M3_LUT = None


def e4m3_to_float32(q) -> np.ndarray:
    """fp8 e4m3 bit patterns (uint8, or an ml_dtypes.float8_e4m3fn array) -> float32."""
    global _E4M3_LUT
    if _E4M3_LUT is None:
        lib = _lib.load()
        _E4M3_LUT = np.array([lib.epx_e4m3_to_float(i) for i in range(256)], dtype=np.float32)
    q = np.ascontiguousarray(q)
    if q.dtype != np.uint8:
        q = q.view(np.uint8)
    return _E4M3_LUT[q]


def quantize_e4m3(x) -> Tuple[np.ndarray, np.ndarray]:
    """Quantises float32 rows [..., H] exactly as dispatch does: returns (q uint8 [..., H],
    scales float32 [..., ceil(H / 128)]); the value is ``e4m3_to_float32(q) * scale``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    H = x.shape[-1]
    blocks = (H + _lib.FP8_BLOCK - 1) // _lib.FP8_BLOCK
    rows = x.reshape(-1, H)
    q = np.empty(rows.shape, np.uint8)
    s = np.empty((rows.shape[0], blocks), np.float32)
    fn = _lib.load().epx_quantize_row_e4m3
    for i in range(rows.shape[0]):
        fn(rows[i].ctypes.data, H, q[i].ctypes.data, s[i].ctypes.data)
    return q.reshape(x.shape), s.reshape(x.shape[:-1] + (blocks,))


def dequantize_e4m3(q, scales) -> np.ndarray:
    """The receiver's value of fp8 rows: float(q) * scale of its 128-channel block."""
    v = e4m3_to_float32(q)
    H = v.shape[-1]
    rep = np.repeat(np.asarray(scales, np.float32), _lib.FP8_BLOCK, axis=-1)[..., :H]
    return (v * rep).astype(np.float32)
