"""The Pythonic API over libepx: errors, World, Comm, Handle, routing helpers.

Arrays are numpy arrays (CPU backend) or torch tensors (CPU tensors to the CPU backend, CUDA
tensors to the CUDA backend; see :mod:`epx.torch`). Shapes and dtypes are checked here before
anything reaches C, and every failure raises an :class:`Error` subclass.

Data types on numpy
  * float32 always works.
  * bfloat16: ``ml_dtypes.bfloat16`` arrays when ml_dtypes is installed; otherwise (or as
    well) ``uint16`` arrays holding bf16 bit patterns are taken as bfloat16. Outputs follow
    the input: bf16 in as ``uint16`` gives bf16 out as ``uint16``.
    :func:`float32_to_bf16_bits` / :func:`bf16_bits_to_float32` convert exactly (round to
    nearest even, as every backend does).
  * fp8 e4m3 (dispatch output only): ``ml_dtypes.float8_e4m3fn`` when installed and the input
    is not bit-typed, else ``uint8`` bit patterns; :func:`e4m3_to_float32` decodes them.

Collectives (Comm creation, notify, dispatch, combine) must be entered by every rank of the
group. A process that drives several ranks (a *local* world) calls each rank from its own
thread: :meth:`World.run` does that. A Python-side argument error is raised on the rank that
made it before any exchange; its peers then stop at their bounded wait with
:class:`CommTimeoutError`, exactly as a C-side argument error would.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from ._lib import Algo, Backend, DType, Status
from ._lib import Layout as _LayoutKind

try:  # optional: real bfloat16 / float8 numpy dtypes
    import ml_dtypes as _ml_dtypes

    _NP_BF16 = np.dtype(_ml_dtypes.bfloat16)
    _NP_FP8 = np.dtype(_ml_dtypes.float8_e4m3fn)
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    _NP_BF16 = None
    _NP_FP8 = None


# =============================================================================================
# Errors
# =============================================================================================


class Error(Exception):
    """An epx failure. ``status`` is a :class:`Status` (an ``int`` with a ``.name``), ``message``
    the detailed text (``epx_last_error()`` for failures inside C).

    Subclasses, one per status, so ``except epx.CommTimeoutError`` works; each also derives
    from the closest built-in exception (``ValueError`` for bad input, ``TimeoutError`` for a
    timeout, ...):

    ==========================  ==============================  ==========================
    class                       status                          also a
    ==========================  ==============================  ==========================
    InvalidArgumentError        INVALID_ARGUMENT                ValueError
      ShapeError                INVALID_ARGUMENT (Python check) ValueError
      DTypeError                INVALID_ARGUMENT (Python check) ValueError, TypeError
      DeviceError               INVALID_ARGUMENT (Python check) ValueError
    NullPointerError            NULL_POINTER                    ValueError
    ExpertOutOfRangeError       EXPERT_OUT_OF_RANGE             ValueError
    ExpertsNotDivisibleError    EXPERTS_NOT_DIVISIBLE           ValueError
    TopkRangeError              TOPK_RANGE                      ValueError
    HiddenRangeError            HIDDEN_RANGE                    ValueError
    RowAlignmentError           ROW_ALIGNMENT                   ValueError
    OutputTooSmallError         OUTPUT_TOO_SMALL                ValueError
    LowLatencyOverflowError     LL_OVERFLOW                     ValueError
    ConfigMismatchError         CONFIG_MISMATCH                 ValueError
    CommTimeoutError            TIMEOUT                         TimeoutError
      (alias ``TimeoutError_``)
    PeerLostError               PEER_LOST                       ConnectionError
    UnsupportedError            UNSUPPORTED                     NotImplementedError
    OutOfMemoryError            OUT_OF_MEMORY                   MemoryError
    SystemCallError             SYSTEM                          RuntimeError
    CudaError                   CUDA                            RuntimeError
    BrokenCommError             BROKEN                          RuntimeError
    InternalError               INTERNAL                        RuntimeError
    ==========================  ==============================  ==========================
    """

    default_status = Status.INTERNAL

    def __init__(self, status=None, message: str = ""):
        if status is None:
            status = self.default_status
        try:
            status = Status(int(status))
        except ValueError:
            pass
        self.status = status
        self.message = message
        name = status.c_name if isinstance(status, Status) else f"EPX status {status}"
        super().__init__(f"{name}: {message}" if message else name)

    @property
    def status_name(self) -> str:
        """``EPX_ERR_...``, the C name of the status."""
        return self.status.c_name if isinstance(self.status, Status) else str(self.status)


def _errcls(name, status, *bases, doc=""):
    cls = type(name, (Error,) + bases, {"default_status": status, "__doc__": doc or f"Status {status.c_name}."})
    cls.__module__ = "epx"
    return cls


InvalidArgumentError = _errcls("InvalidArgumentError", Status.INVALID_ARGUMENT, ValueError)
NullPointerError = _errcls("NullPointerError", Status.NULL_POINTER, ValueError)
ExpertOutOfRangeError = _errcls("ExpertOutOfRangeError", Status.EXPERT_OUT_OF_RANGE, ValueError)
ExpertsNotDivisibleError = _errcls("ExpertsNotDivisibleError", Status.EXPERTS_NOT_DIVISIBLE, ValueError)
TopkRangeError = _errcls("TopkRangeError", Status.TOPK_RANGE, ValueError)
HiddenRangeError = _errcls("HiddenRangeError", Status.HIDDEN_RANGE, ValueError)
RowAlignmentError = _errcls("RowAlignmentError", Status.ROW_ALIGNMENT, ValueError)
OutputTooSmallError = _errcls("OutputTooSmallError", Status.OUTPUT_TOO_SMALL, ValueError)
LowLatencyOverflowError = _errcls("LowLatencyOverflowError", Status.LL_OVERFLOW, ValueError)
ConfigMismatchError = _errcls("ConfigMismatchError", Status.CONFIG_MISMATCH, ValueError)
CommTimeoutError = _errcls("CommTimeoutError", Status.TIMEOUT, TimeoutError)
PeerLostError = _errcls("PeerLostError", Status.PEER_LOST, ConnectionError)
UnsupportedError = _errcls("UnsupportedError", Status.UNSUPPORTED, NotImplementedError)
OutOfMemoryError = _errcls("OutOfMemoryError", Status.OUT_OF_MEMORY, MemoryError)
SystemCallError = _errcls("SystemCallError", Status.SYSTEM, RuntimeError)
CudaError = _errcls("CudaError", Status.CUDA, RuntimeError)
BrokenCommError = _errcls("BrokenCommError", Status.BROKEN, RuntimeError)
InternalError = _errcls("InternalError", Status.INTERNAL, RuntimeError)
TimeoutError_ = CommTimeoutError


class ShapeError(InvalidArgumentError):
    """An array of the wrong shape (found in Python, before any C call)."""


class DTypeError(InvalidArgumentError, TypeError):
    """An array of the wrong dtype (found in Python, before any C call)."""


class DeviceError(InvalidArgumentError):
    """An array on the wrong device for the comm's backend (found in Python)."""


for _c in (ShapeError, DTypeError, DeviceError):
    _c.__module__ = "epx"

_ERRORS = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.NULL_POINTER: NullPointerError,
    Status.EXPERT_OUT_OF_RANGE: ExpertOutOfRangeError,
    Status.EXPERTS_NOT_DIVISIBLE: ExpertsNotDivisibleError,
    Status.TOPK_RANGE: TopkRangeError,
    Status.HIDDEN_RANGE: HiddenRangeError,
    Status.ROW_ALIGNMENT: RowAlignmentError,
    Status.OUTPUT_TOO_SMALL: OutputTooSmallError,
    Status.LL_OVERFLOW: LowLatencyOverflowError,
    Status.CONFIG_MISMATCH: ConfigMismatchError,
    Status.TIMEOUT: CommTimeoutError,
    Status.PEER_LOST: PeerLostError,
    Status.UNSUPPORTED: UnsupportedError,
    Status.OUT_OF_MEMORY: OutOfMemoryError,
    Status.SYSTEM: SystemCallError,
    Status.CUDA: CudaError,
    Status.BROKEN: BrokenCommError,
    Status.INTERNAL: InternalError,
}


def error_class(status) -> type:
    """The :class:`Error` subclass raised for a status."""
    try:
        return _ERRORS.get(Status(int(status)), Error)
    except ValueError:
        return Error


def _raise(status, message: str = ""):
    raise error_class(status)(status, message)


def _check(status: int, what: str = "") -> None:
    """Raises the Error of a failed C call, with this thread's epx_last_error()."""
    if status == 0:
        return
    lib = _lib.load()
    msg = (lib.epx_last_error() or b"").decode(errors="replace")
    if not msg:
        msg = (lib.epx_status_string(status) or b"").decode(errors="replace")
    if what:
        msg = f"{what}: {msg}"
    _raise(status, msg)


def _shape_error(msg):
    raise ShapeError(Status.INVALID_ARGUMENT, msg)


def _dtype_error(msg):
    raise DTypeError(Status.INVALID_ARGUMENT, msg)


def _arg_error(msg):
    raise InvalidArgumentError(Status.INVALID_ARGUMENT, msg)


# =============================================================================================
# Small module-level helpers
# =============================================================================================


def library_path() -> str:
    """The path of the libepx this package loaded."""
    return _lib.library_path()


def status_string(status) -> str:
    return _lib.load().epx_status_string(int(status)).decode()


_BACKENDS = {"host": Backend.HOST, "cpu": Backend.HOST, "cuda": Backend.CUDA, "gpu": Backend.CUDA, "auto": Backend.AUTO}


def _parse_backend(b) -> Backend:
    if isinstance(b, Backend):
        return b
    if isinstance(b, str) and b.lower() in _BACKENDS:
        return _BACKENDS[b.lower()]
    if isinstance(b, int) and b in (0, 1, 2):
        return Backend(b)
    _arg_error(f"unknown backend {b!r}: use 'host', 'cuda' or 'auto'")


def backend_available(backend="cuda") -> bool:
    """True when the backend ('host', 'cuda', 'auto') can run here (build and machine)."""
    return _lib.load().epx_backend_available(int(_parse_backend(backend))) == 0


def backend_unavailable_reason(backend="cuda") -> Optional[str]:
    """None when available, else the library's explanation."""
    lib = _lib.load()
    if lib.epx_backend_available(int(_parse_backend(backend))) == 0:
        return None
    return lib.epx_last_error().decode(errors="replace")


_ALGOS = {"ht": Algo.HT, "high_throughput": Algo.HT, "ll": Algo.LL, "low_latency": Algo.LL, "alltoall": Algo.ALLTOALL,
          "a2a": Algo.ALLTOALL}
_LAYOUTS = {"token": _LayoutKind.TOKEN, "expert": _LayoutKind.EXPERT}


def _parse_algo(a) -> Algo:
    if isinstance(a, Algo):
        return a
    if isinstance(a, str) and a.lower() in _ALGOS:
        return _ALGOS[a.lower()]
    _arg_error(f"unknown algorithm {a!r}: use 'ht', 'll' or 'alltoall'")


def _parse_layout(x) -> _LayoutKind:
    if isinstance(x, _LayoutKind):
        return x
    if isinstance(x, str) and x.lower() in _LAYOUTS:
        return _LAYOUTS[x.lower()]
    _arg_error(f"unknown layout {x!r}: use 'token' or 'expert'")


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


def map_to_topk(routing_map, probs=None, *, topk: int) -> Tuple[np.ndarray, np.ndarray]:
    """Multi-hot routing map [T, E] (+ probs [T, E]) -> (topk_idx int32 [T, K], topk_weights
    float32 [T, K]); slots in ascending expert id, padded with -1 / 0.0. A row with more than
    ``topk`` experts raises :class:`TopkRangeError`. Host memory (numpy) only."""
    m = _np_map(routing_map, "routing_map")
    T, E = m.shape
    p = None
    if probs is not None:
        p = _np_float32(probs, "probs")
        if p.shape != (T, E):
            _shape_error(f"probs has shape {p.shape}, expected {(T, E)} like routing_map")
    idx = np.empty((T, topk), np.int32)
    w = np.empty((T, topk), np.float32)
    _check(_lib.load().epx_map_to_topk(T, E, topk, m.ctypes.data, p.ctypes.data if p is not None else None,
                                       idx.ctypes.data, w.ctypes.data), "map_to_topk")
    return idx, w


def topk_to_map(topk_idx, topk_weights=None, *, num_experts: int) -> Tuple[np.ndarray, np.ndarray]:
    """topk_idx [T, K] (+ weights) -> (routing_map bool [T, E], probs float32 [T, E]). A
    repeated expert in one row raises :class:`InvalidArgumentError`, an id outside [-1, E)
    :class:`ExpertOutOfRangeError`. Host memory (numpy) only."""
    idx, code = _np_idx(topk_idx, "topk_idx")
    T, K = idx.shape
    w = None
    if topk_weights is not None:
        w = _np_float32(topk_weights, "topk_weights")
        if w.shape != (T, K):
            _shape_error(f"topk_weights has shape {w.shape}, expected {(T, K)} like topk_idx")
    m = np.empty((T, num_experts), np.uint8)
    p = np.empty((T, num_experts), np.float32)
    _check(_lib.load().epx_topk_to_map(T, num_experts, K, int(code), idx.ctypes.data,
                                       w.ctypes.data if w is not None else None, m.ctypes.data, p.ctypes.data),
           "topk_to_map")
    return m.view(np.bool_), p


def _np_map(a, name):
    a = np.asarray(a)
    if a.ndim != 2:
        _shape_error(f"{name} must be 2-D [T, E], got shape {a.shape}")
    if a.dtype not in (np.bool_, np.uint8):
        a = a != 0
    return np.ascontiguousarray(a).view(np.uint8)


def _np_float32(a, name):
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.integer):
        _dtype_error(f"{name} must be a float array, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _np_idx(a, name):
    a = np.asarray(a)
    if a.ndim != 2:
        _shape_error(f"{name} must be 2-D [T, K], got shape {a.shape}")
    if a.dtype == np.int32:
        return np.ascontiguousarray(a), DType.INT32
    if not np.issubdtype(a.dtype, np.integer):
        _dtype_error(f"{name} must hold integer expert ids, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64), DType.INT64


# =============================================================================================
# Array frontends: numpy here, torch in epx.torch. Both expose the same small interface, so
# the shape/dtype checks and the output allocation below are written once.
# =============================================================================================


def _dtype_codes(d, table) -> Tuple[DType, ...]:
    """The epx dtypes a frontend's dtype stands for, from its (dtype, codes) table."""
    for dt, codes in table:
        if dt is not None and d == dt:
            return codes
    return ()


# uint8 is a bool map or fp8 bits; uint16 holds bf16 bits where numpy has no bfloat16
_NUMPY_CODES = [(np.float32, (DType.FLOAT32,)), (np.uint16, (DType.BFLOAT16,)), (_NP_BF16, (DType.BFLOAT16,)),
                (_NP_FP8, (DType.FP8_E4M3,)), (np.uint8, (DType.BOOL, DType.FP8_E4M3)), (np.bool_, (DType.BOOL,)),
                (np.int32, (DType.INT32,)), (np.int64, (DType.INT64,))]


class _Frontend:
    """How the package handles one kind of array (numpy here, torch in epx.torch): what both
    kinds do alike."""

    @staticmethod
    def reshape(a, shape):
        return a.reshape(shape)

    @staticmethod
    def slice_rows(a, n):
        return a[:n]


class _NumpyFrontend(_Frontend):
    name = "numpy"

    @staticmethod
    def is_array(a) -> bool:
        return isinstance(a, np.ndarray)

    @staticmethod
    def codes(a) -> Tuple[DType, ...]:
        """The epx dtypes an array may stand for (uint8 is a bool map or fp8 bits)."""
        return _dtype_codes(a.dtype, _NUMPY_CODES)

    @staticmethod
    def dtype_name(a) -> str:
        return str(a.dtype)

    @staticmethod
    def device(a) -> str:
        return "cpu"

    @staticmethod
    def shape(a) -> tuple:
        return tuple(a.shape)

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


def _frontend_of(*arrays):
    """The frontend of the first array given (numpy for array-likes)."""
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            return _NUMPY
        mod = type(a).__module__ or ""
        if mod.startswith("torch"):
            from .torch import _TORCH  # noqa: WPS433 - lazy: torch is optional

            return _TORCH
        return _NUMPY
    return _NUMPY


def _as_array(fe, a):
    if fe is _NUMPY and not isinstance(a, np.ndarray):
        return np.asarray(a)
    return a


def _input(fe, a, name, allowed, ndim=None, convert_to=None):
    """Checks (and where harmless converts) an input array; returns (contiguous array, code)."""
    if a is None:
        return None, None
    a = _as_array(fe, a)
    if not fe.is_array(a):
        _dtype_error(f"{name} must be a {fe.name} array, got {type(a).__name__} (do not mix numpy and torch)")
    shape = fe.shape(a)
    dims = ndim if isinstance(ndim, tuple) else (ndim,)
    if ndim is not None and len(shape) not in dims:
        _shape_error(f"{name} must be {' or '.join(str(d) for d in dims)}-D, got shape {shape}")
    codes = [c for c in fe.codes(a) if c in allowed]
    if not codes:
        conv = fe.convert(a, convert_to) if convert_to is not None else None
        if conv is None:
            names = ", ".join(_lib.DType(c).name.lower() for c in allowed)
            _dtype_error(f"{name} has dtype {fe.dtype_name(a)}; expected {names}")
        a = conv
        codes = [convert_to]
    return fe.contiguous(a), codes[0]


def _output(fe, a, name, shape, allowed):
    """Checks a caller-provided output: exact dtype, C-contiguous, writable, shape."""
    if not fe.is_array(a):
        _dtype_error(f"{name} must be a {fe.name} array, got {type(a).__name__}")
    codes = [c for c in fe.codes(a) if c in allowed]
    if not codes:
        names = ", ".join(_lib.DType(c).name.lower() for c in allowed)
        _dtype_error(f"{name} has dtype {fe.dtype_name(a)}; expected {names}")
    if not fe.is_contiguous_writable(a):
        _arg_error(f"{name} must be C-contiguous and writable")
    if shape is not None and tuple(fe.shape(a)) != tuple(shape):
        _shape_error(f"{name} has shape {tuple(fe.shape(a))}, expected {tuple(shape)}")
    return codes[0]


# =============================================================================================
# Config and results
# =============================================================================================


@dataclasses.dataclass
class Config:
    """epx_config_t. Defaults are epx_config_init's; 0 for num_sms / timeout_ms takes the
    EPX_NUM_SMS / EPX_TIMEOUT_MS environment knobs (16 / 30000)."""

    num_experts: int = 256
    hidden: int = 7168
    topk: int = 8
    max_tokens_per_rank: int = 128
    num_sms: int = 0
    timeout_ms: int = 0

    def _c(self) -> _lib.Config:
        c = _lib.Config()
        _lib.load().epx_config_init(ctypes.byref(c))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                _arg_error(f"config.{f.name} must be an int, got {v!r}")
            if not -(2**31) <= int(v) < 2**31:
                _arg_error(f"config.{f.name} = {v} does not fit a C int")
            setattr(c, f.name, int(v))
        return c

    @classmethod
    def _from_c(cls, c: _lib.Config) -> "Config":
        return cls(**{f.name: getattr(c, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class HandleInfo:
    """epx_handle_info_t plus tokens_per_local_expert [L] (int32, unpadded pair counts)."""

    num_send_tokens: int
    num_recv_tokens: int
    num_recv_rows: int
    num_recv_pairs: int
    num_sent_copies: int
    tokens_per_local_expert: np.ndarray
    num_dropped_pairs: int = 0


@dataclasses.dataclass
class Layout:
    """Result of :meth:`Comm.layout`: tokens_per_rank [R], tokens_per_expert [E] (int32),
    is_token_in_rank [T, R] (bool)."""

    tokens_per_rank: Any
    tokens_per_expert: Any
    is_token_in_rank: Any


@dataclasses.dataclass
class DispatchResult:
    """What :meth:`Handle.dispatch` returns.

    recv_x
        token layout ``[N, H]`` (rows by source rank, then source token); expert layout
        ``[rows, H]`` grouped by local expert, each block padded to ``align``; low-latency
        ``[L, R * max_tokens_per_rank, H]``. In ``recv_dtype`` (fp8 as ``float8_e4m3fn`` or
        uint8 bits).
    recv_scales
        fp8 only: float32 ``[rows, ceil(H / 128)]`` (low-latency ``[L, R*M, blocks]``).
    recv_topk_idx, recv_topk_weights
        token layout only: ``[N, K]`` local expert ids (-1 for slots elsewhere) and weights.
    recv_probs
        expert layout / low-latency only: each row's weight (0 on padding).
    tokens_per_local_expert
        ``[L]`` int32, unpadded (token, expert) pair counts (for low-latency: rows used in
        each expert's block).
    num_rows
        rows written (padding included; low-latency: pairs), when known on the host.
    """

    recv_x: Any
    recv_scales: Any = None
    recv_topk_idx: Any = None
    recv_topk_weights: Any = None
    recv_probs: Any = None
    tokens_per_local_expert: Any = None
    num_rows: Optional[int] = None
    layout: str = "token"
    algo: str = "ht"
    align: int = 1

    def __iter__(self):  # recv_x, weights-or-probs, counts: handy for unpacking
        yield self.recv_x
        yield self.recv_topk_weights if self.layout == "token" else self.recv_probs
        yield self.tokens_per_local_expert

    @property
    def tokens_per_expert_padded(self):
        """Block sizes of the expert layout (counts rounded up to ``align``); numpy counts only."""
        c = np.asarray(self.tokens_per_local_expert).astype(np.int64)
        return (c + self.align - 1) // self.align * self.align


# =============================================================================================
# World
# =============================================================================================


class _Owned:
    """Life cycle shared by World, Comm and Handle: a context manager whose close() frees the C
    object. Garbage collection may finalise an object and its children in any order (a cycle):
    it frees one only when no child is open (_collectable), else leaks it rather than free it
    under them."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _collectable(self) -> bool:
        return True

    def __del__(self):
        try:
            if getattr(self, "_ptr", None) is not None and self._collectable():
                self.close()
        except Exception:
            pass


class World(_Owned):
    """The ranks this process drives.

    ``World(nranks, backend)`` is a *local* world: every rank of the group lives in this
    process (threads as ranks on the CPU backend; ranks sharing or spreading over GPUs on
    CUDA). :meth:`from_unique_id` and :meth:`from_torch_distributed` make a world that drives
    one rank of a group spread over processes.

    Close it (``close()`` or a ``with`` block) after its comms; closing a world closes the
    comms and handles still open on it.
    """

    def __init__(self, nranks: int = 1, backend="auto", devices: Optional[Sequence[int]] = None):
        self._ptr = None
        lib = _lib.load()
        if not isinstance(nranks, (int, np.integer)) or isinstance(nranks, bool):
            _arg_error(f"nranks must be an int, got {nranks!r}")
        self._devices = list(devices) if devices is not None else None
        wc, keep = self._world_config(int(nranks), backend, devices)
        p = ctypes.c_void_p()
        _check(lib.epx_world_create(ctypes.byref(wc), ctypes.byref(p)), "epx_world_create")
        self._init(p, list(range(int(nranks))), keep)

    # -- construction helpers --------------------------------------------------------------
    @staticmethod
    def _world_config(nranks, backend, devices):
        lib = _lib.load()
        wc = _lib.WorldConfig()
        lib.epx_world_config_init(ctypes.byref(wc))
        wc.backend = int(_parse_backend(backend))
        wc.nranks = nranks
        keep = None
        if devices is not None:
            devices = list(devices)
            if len(devices) != nranks:
                _shape_error(f"devices has {len(devices)} entries for {nranks} ranks")
            keep = (ctypes.c_int * nranks)(*[int(d) for d in devices])
            wc.devices = ctypes.cast(keep, ctypes.POINTER(ctypes.c_int))
        return wc, keep

    def _init(self, ptr, ranks, keep=None):
        lib = _lib.load()
        self._ptr = ptr
        self._keep = keep
        self._ranks = list(ranks)
        self._nranks = lib.epx_world_nranks(ptr)
        self._backend = Backend(lib.epx_world_backend(ptr))
        self._comms = weakref.WeakSet()  # for close()'s cascade
        self._open_comms = 0  # for __del__: never free a world under a live comm
        self._lock = threading.Lock()

    @classmethod
    def _adopt(cls, ptr, ranks):
        w = cls.__new__(cls)
        w._ptr = None
        w._init(ptr, ranks)
        return w

    @classmethod
    def from_unique_id(cls, unique_id, rank: int, nranks: int, backend="auto", device: Optional[int] = None):
        """One rank of a group spread over processes, NCCL-style: one process calls
        :func:`get_unique_id`, shares the bytes however it likes, and every process calls
        this with its rank. ``device``: this rank's CUDA device (default: rank % count)."""
        lib = _lib.load()
        if lib.epx_world_create_rank is None:
            _raise(Status.UNSUPPORTED, f"{lib.path} has no epx_world_create_rank (a build older than epx.h)")
        if not 0 <= rank < nranks:
            _arg_error(f"rank {rank} outside [0, {nranks})")
        uid = _unique_id_struct(unique_id)
        devices = None
        if device is not None:
            devices = [-1] * nranks
            devices[rank] = int(device)
        wc, keep = cls._world_config(int(nranks), backend, devices)
        p = ctypes.c_void_p()
        _check(lib.epx_world_create_rank(ctypes.byref(wc), ctypes.byref(uid), int(rank), ctypes.byref(p)),
               "epx_world_create_rank")
        w = cls._adopt(p, [int(rank)])
        w._keep = keep
        return w

    @classmethod
    def from_allgather(cls, allgather: Callable[[bytes], List[bytes]], rank: int, nranks: int, backend="auto",
                       device: Optional[int] = None):
        """One rank of a group bootstrapped over the caller's allgather: ``allgather(mine)``
        takes this rank's bytes and returns every rank's (rank order, equal lengths). It is
        called a few times, from this thread, while the world is created."""
        lib = _lib.load()
        if lib.epx_world_create_rank_with is None:
            _raise(Status.UNSUPPORTED, f"{lib.path} has no epx_world_create_rank_with (a build older than epx.h)")
        if not 0 <= rank < nranks:
            _arg_error(f"rank {rank} outside [0, {nranks})")
        errors = []

        def cb(mine, all_, nbytes, ctx):
            try:
                parts = allgather(ctypes.string_at(mine, nbytes) if nbytes else b"")
                if len(parts) != nranks or any(len(p) != nbytes for p in parts):
                    raise RuntimeError(f"allgather returned {len(parts)} parts of sizes "
                                       f"{[len(p) for p in parts]}, expected {nranks} of {nbytes} bytes")
                if nbytes:
                    ctypes.memmove(all_, b"".join(bytes(p) for p in parts), nbytes * nranks)
                return 0
            except BaseException as e:  # never let an exception cross into C
                errors.append(e)
                return 1

        fn = _lib.ALLGATHER_FN(cb)
        devices = None
        if device is not None:
            devices = [-1] * nranks
            devices[rank] = int(device)
        wc, keep = cls._world_config(int(nranks), backend, devices)
        p = ctypes.c_void_p()
        st = lib.epx_world_create_rank_with(ctypes.byref(wc), int(rank), fn, None, ctypes.byref(p))
        if st != 0 and errors:
            msg = (lib.epx_last_error() or b"").decode(errors="replace")
            raise error_class(st)(st, f"epx_world_create_rank_with: {msg} (allgather raised {errors[0]!r})") from errors[0]
        _check(st, "epx_world_create_rank_with")
        w = cls._adopt(p, [int(rank)])
        w._keep = (keep, fn)
        return w

    @classmethod
    def from_torch_distributed(cls, group=None, backend="auto", device: Optional[int] = None):
        """One rank of a ``torch.distributed`` process group (default: the world group),
        bootstrapped over its allgather. ``device`` defaults to the current CUDA device when
        the backend may be CUDA and a GPU is visible."""
        from .torch import world_from_torch_distributed

        return world_from_torch_distributed(group=group, backend=backend, device=device)

    # -- properties --------------------------------------------------------------------------
    @property
    def nranks(self) -> int:
        """Ranks in the whole group."""
        return self._nranks

    @property
    def ranks(self) -> List[int]:
        """The ranks this process drives."""
        return list(self._ranks)

    @property
    def rank(self) -> int:
        """The rank this world drives (one-rank worlds only)."""
        if len(self._ranks) != 1:
            _arg_error(f"this world drives {len(self._ranks)} ranks; use world.ranks")
        return self._ranks[0]

    @property
    def is_local(self) -> bool:
        """True when this process drives every rank of the group."""
        return len(self._ranks) == self._nranks

    @property
    def backend(self) -> str:
        """'host' or 'cuda' (never 'auto': the world resolved it)."""
        return "cuda" if self._backend == Backend.CUDA else "host"

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _handle_ptr(self):
        if self._ptr is None:
            _raise(Status.INVALID_ARGUMENT, "the world is closed")
        return self._ptr

    # -- comms -------------------------------------------------------------------------------
    def comm(self, rank: Optional[int] = None, config: Optional[Config] = None, **kw) -> "Comm":
        """Creates one rank's comm (collective: every rank does so, each from its thread)."""
        return Comm(self, self.rank if rank is None else rank, config, **kw)

    def init_comms(self, config: Optional[Config] = None, **kw) -> List["Comm"]:
        """Creates the comm of every rank this process drives (on threads), in rank order."""
        return self.run(lambda r: Comm(self, r, config, **kw))

    # -- running ranks -----------------------------------------------------------------------
    def device_of(self, rank: int) -> Optional[int]:
        """The CUDA device of a rank this world drives (None on the host backend)."""
        if self.backend != "cuda":
            return None
        devices = getattr(self, "_devices", None)
        if devices is not None and devices[rank] >= 0:
            return int(devices[rank])
        import torch  # the CUDA backend from Python means torch tensors
        return rank % max(torch.cuda.device_count(), 1)

    def shares_device(self, rank: int) -> bool:
        """True when another rank of this process runs on the same GPU."""
        d = self.device_of(rank)
        return d is not None and sum(1 for r in self._ranks if self.device_of(r) == d) > 1

    def run(self, fn: Callable[..., Any], *args, streams: Optional[Sequence[Any]] = None, **kwargs) -> List[Any]:
        """Runs ``fn(rank, *args, **kwargs)`` for every rank this process drives, each on its
        own thread (ctypes releases the GIL, so the collectives inside meet), and returns the
        results in rank order. If any rank raises, the first exception raised (in time) is
        re-raised once every thread has finished, with ``.rank`` set and the other ranks'
        exceptions in ``.rank_errors``. A one-rank world runs ``fn`` on the calling thread.
        CUDA: each rank thread runs with its device and a torch stream current: ``streams[i]``
        for the i-th rank this process drives (torch's legacy default stream is allowed), else
        one the world keeps per rank. Ranks that share a GPU must not make torch allocate on
        other streams inside a collective (see _prepare_torch)."""
        ranks = list(self._ranks)
        if self.backend == "cuda":
            fn = self._on_streams(fn, streams)
        elif streams is not None:
            raise ValueError("World.run: streams are for a CUDA world")
        if len(ranks) == 1:
            return [fn(ranks[0], *args, **kwargs)]
        return run_threads(ranks, fn, *args, **kwargs)

    def _on_streams(self, fn, streams):
        """Each rank thread gets its device and its stream: ranks that shared one stream would
        queue behind each other's kernels, which wait on each other. Where ranks share a GPU,
        torch's first-use work is done on each stream first (see _prepare_torch), every rank's
        before any rank runs ``fn``."""
        import torch

        ranks = list(self._ranks)
        if streams is None:
            kept = self.__dict__.setdefault("_torch_streams", {})
            for r in ranks:
                if r not in kept:
                    kept[r] = torch.cuda.Stream(torch.device("cuda", self.device_of(r)))
            streams = [kept[r] for r in ranks]
        elif len(streams) != len(ranks):
            raise ValueError(f"World.run: {len(streams)} streams for the {len(ranks)} ranks this process drives")
        stream_of = dict(zip(ranks, streams))
        prepared = self.__dict__.setdefault("_torch_prepared", set())  # stream handles; torch caches per stream
        todo = [r for r in ranks if self.shares_device(r) and stream_of[r].cuda_stream not in prepared]
        ready = threading.Barrier(len(ranks)) if todo and len(ranks) > 1 else None

        try:  # the bound of every wait, as libepx reads it
            wait_s = int(os.environ.get("EPX_TIMEOUT_MS") or 30000) / 1000.0
        except ValueError:
            wait_s = 30.0

        def body(rank, *args, **kwargs):
            dev = torch.device("cuda", self.device_of(rank))
            stream = stream_of[rank]
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                try:
                    if rank in todo:
                        _prepare_torch(dev, stream)
                        prepared.add(stream.cuda_stream)
                    if ready is not None:
                        ready.wait(wait_s)
                except threading.BrokenBarrierError:
                    raise
                except BaseException:
                    if ready is not None:
                        ready.abort()  # the other ranks stop waiting for this one
                    raise
                return fn(rank, *args, **kwargs)
        return body

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroys the world, closing its open comms (and their handles) first."""
        if self._ptr is None:
            return
        for c in list(self._comms):
            c.close()
        ptr, self._ptr = self._ptr, None
        _check(_lib.load().epx_world_destroy(ptr), "epx_world_destroy")

    def _collectable(self) -> bool:
        return self._open_comms == 0

    def __repr__(self):
        state = "closed" if self._ptr is None else f"{self.backend}, {self._nranks} ranks, driving {self._ranks}"
        return f"<epx.World {state}>"


def _prepare_torch(dev, stream) -> None:
    """Does torch's first-use work for this rank before its first collective, while no rank is
    inside one: fills torch's caching allocator for the rank's stream, and runs one backward
    pass there.
    CUDA serialises streams around a device memory allocation (cudaMalloc is one of the
    "implicit synchronization" operations of the CUDA programming guide): work issued after it
    does not start until work issued before it finishes. When ranks share a GPU, a peer's
    kernel issued before it may be waiting for this rank's, issued after: the group stalls
    until the timeout. torch calls cudaMalloc whenever its cache for a stream runs short, so
    each rank's cache is filled here, once per stream (torch caches per stream: memory on a
    stream not prepared here comes from cudaMalloc), while no rank is inside a collective. Size:
    EPX_TORCH_RESERVE_MB (default 128) in one large block and a sixteenth of it in small ones.
    The backward pass starts torch's autograd thread for the GPU: a model's first backward,
    run while peers were inside a collective, stalled the group until the timeout on an H200
    (the step inside torch that does it was not isolated; done here, it is out of the way).
    A copy each way between pageable host memory and the GPU makes the driver set up its
    pinned staging memory now: a page-locked allocation is an implicit synchronization too."""
    import torch

    mb = int(os.environ.get("EPX_TORCH_RESERVE_MB", "128"))
    if mb > 0:
        try:
            big = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
            small = [torch.empty(1 << 20, dtype=torch.uint8, device=dev) for _ in range(max(mb // 16, 1))]
        except torch.cuda.OutOfMemoryError as e:
            _raise(Status.OUT_OF_MEMORY, f"reserving torch memory for a rank that shares {dev} ({mb} MiB, "
                                         f"EPX_TORCH_RESERVE_MB; 0 reserves none): {e}")
        del big, small
    w = torch.ones(8, device=dev, requires_grad=True)
    (w * 2).sum().backward()
    torch.ones(1 << 20, dtype=torch.uint8).to(dev).cpu()
    stream.synchronize()


def run_threads(ranks: Sequence[int], fn: Callable[..., Any], *args, **kwargs) -> List[Any]:
    """Runs ``fn(rank, *args, **kwargs)`` on one thread per rank; see :meth:`World.run`."""
    results: List[Any] = [None] * len(ranks)
    errors: List[Tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def body(i, r):
        try:
            results[i] = fn(r, *args, **kwargs)
        except BaseException as e:  # noqa: B902 - re-raised below
            with lock:
                errors.append((time.monotonic(), r, e))

    threads = [threading.Thread(target=body, args=(i, r), name=f"epx-rank-{r}", daemon=True) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # a rank that stopped waiting for a failed one is not the cause: it goes last
        errors.sort(key=lambda e: (isinstance(e[2], threading.BrokenBarrierError), e[0]))
        _, r, first = errors[0]
        try:
            first.rank = r
            first.rank_errors = {rr: e for _, rr, e in errors}
            if hasattr(first, "add_note") and len(errors) > 1:
                first.add_note("other ranks: " + "; ".join(f"rank {rr}: {e!r}" for _, rr, e in errors[1:]))
        except Exception:
            pass
        raise first
    return results


def get_unique_id() -> bytes:
    """A fresh unique id (EPX_UNIQUE_ID_BYTES bytes) for :meth:`World.from_unique_id`; starts
    the bootstrap listener on this host."""
    lib = _lib.load()
    if lib.epx_get_unique_id is None:
        _raise(Status.UNSUPPORTED, f"{lib.path} has no epx_get_unique_id (a build older than epx.h)")
    uid = _lib.UniqueId()
    _check(lib.epx_get_unique_id(ctypes.byref(uid)), "epx_get_unique_id")
    return bytes(ctypes.string_at(ctypes.addressof(uid), _lib.UNIQUE_ID_BYTES))


def _unique_id_struct(u) -> _lib.UniqueId:
    if isinstance(u, _lib.UniqueId):
        return u
    b = bytes(u)
    if len(b) != _lib.UNIQUE_ID_BYTES:
        _arg_error(f"a unique id is {_lib.UNIQUE_ID_BYTES} bytes, got {len(b)}")
    uid = _lib.UniqueId()
    ctypes.memmove(ctypes.addressof(uid), b, len(b))
    return uid


# =============================================================================================
# Comm
# =============================================================================================


class Comm(_Owned):
    """One rank's endpoint. Creating it is collective: every rank of the group creates its
    comm with the same config (compared across ranks: a difference raises
    :class:`ConfigMismatchError` on every rank). ``config`` and keyword overrides build a
    :class:`Config`."""

    def __init__(self, world: World, rank: int, config: Optional[Config] = None, **kw):
        self._ptr = None
        if config is None:
            config = Config()
        if kw:
            bad = set(kw) - {f.name for f in dataclasses.fields(Config)}
            if bad:
                _arg_error(f"unknown config fields {sorted(bad)}")
            config = dataclasses.replace(config, **kw)
        lib = _lib.load()
        c = config._c()
        p = ctypes.c_void_p()
        _check(lib.epx_comm_init(world._handle_ptr(), int(rank), ctypes.byref(c), ctypes.byref(p)), "epx_comm_init")
        self._ptr = p
        self.world = world
        self._rank = lib.epx_comm_rank(p)
        self._nranks = lib.epx_comm_nranks(p)
        self._config = Config._from_c(lib.epx_comm_config(p).contents)
        self._handles = weakref.WeakSet()
        self._open_handles = 0
        self._stream = None
        with world._lock:
            world._comms.add(self)
            world._open_comms += 1

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def nranks(self) -> int:
        return self._nranks

    @property
    def config(self) -> Config:
        """The config in force (defaults filled in)."""
        return dataclasses.replace(self._config)

    @property
    def num_experts(self) -> int:
        return self._config.num_experts

    @property
    def num_local_experts(self) -> int:
        return self._config.num_experts // self._nranks

    @property
    def hidden(self) -> int:
        return self._config.hidden

    @property
    def topk(self) -> int:
        return self._config.topk

    @property
    def backend(self) -> str:
        return self.world.backend

    def _p(self):
        if self._ptr is None:
            _raise(Status.INVALID_ARGUMENT, f"the comm of rank {self._rank} is closed")
        return self._ptr

    def set_stream(self, stream) -> None:
        """CUDA: the stream (a cudaStream_t as an int, or an object with ``cuda_stream``) the
        comm's work goes to. The torch frontend sets the current stream on every call."""
        s = getattr(stream, "cuda_stream", stream)
        s = int(s) if s is not None else 0
        if s != self._stream:
            _check(_lib.load().epx_comm_set_stream(self._p(), s or None), "epx_comm_set_stream")
            self._stream = s

    def synchronize(self) -> None:
        """Waits for the comm's queued work (CUDA: its stream) and raises the first failure its
        kernels recorded since the last report (sync-free and graph-captured work learn their
        status here). A no-op on the host backend, which reports every failure when a call
        returns."""
        lib = _lib.load()
        if lib.epx_comm_synchronize is None:
            return
        _check(lib.epx_comm_synchronize(self._p()), "epx_comm_synchronize")

    def handle(self, algo="ht", layout="token", align: int = 1, exact: bool = True,
               recv_budget: int = 0) -> "Handle":
        """A dispatch plan holder; see :class:`Handle`."""
        return Handle(self, algo, layout, align, exact, recv_budget)

    def layout(self, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None) -> Layout:
        """Per-rank counts of a routing (local, not collective): tokens per destination rank
        [R], (token, expert) pairs per expert [E], is_token_in_rank [T, R]."""
        fe = _frontend_of(topk_idx, routing_map)
        r, keep, T = _routing(fe, self, topk_idx, topk_weights, routing_map, probs)
        dev = keep[0][1] if keep else "cpu"
        tpr = fe.alloc((self._nranks,), DType.INT32, device=dev)
        tpe = fe.alloc((self.num_experts,), DType.INT32, device=dev)
        itr = fe.alloc((T, self._nranks), DType.BOOL, device=dev)
        with fe.on_stream(self, dev):
            st = _lib.load().epx_get_layout(self._p(), ctypes.byref(r), fe.ptr(tpr), fe.ptr(tpe), fe.ptr(itr))
        _check(st, "epx_get_layout")
        return Layout(tpr, tpe, itr)

    def close(self) -> None:
        """Destroys the comm (its open handles first)."""
        if self._ptr is None:
            return
        for h in list(self._handles):
            h.close()
        ptr, self._ptr = self._ptr, None
        with self.world._lock:
            self.world._comms.discard(self)
            self.world._open_comms -= 1
        _check(_lib.load().epx_comm_destroy(ptr), "epx_comm_destroy")

    def _collectable(self) -> bool:
        return self._open_handles == 0

    def __repr__(self):
        c = self._config
        return (f"<epx.Comm rank {self._rank}/{self._nranks} {self.backend} E={c.num_experts} H={c.hidden} "
                f"K={c.topk}{' closed' if self._ptr is None else ''}>")


def _device_check(fe, comm: Comm, a, name: str) -> str:
    dev = fe.device(a)
    if comm.backend == "host" and dev != "cpu":
        raise DeviceError(Status.INVALID_ARGUMENT,
                          f"{name} is on {dev} but the comm's backend is 'host': pass CPU arrays")
    if comm.backend == "cuda" and not dev.startswith("cuda"):
        raise DeviceError(Status.INVALID_ARGUMENT,
                          f"{name} is on {dev} but the comm's backend is 'cuda': pass CUDA tensors")
    if comm.backend == "cuda":
        want = f"cuda:{comm.world.device_of(comm.rank)}"
        if dev != want:
            raise DeviceError(Status.INVALID_ARGUMENT, f"{name} is on {dev} but rank {comm.rank} runs on {want}")
    return dev


def _routing(fe, comm: Comm, topk_idx, topk_weights, routing_map, probs):
    """Builds an epx_routing_t from either form; returns (struct, [(array, device), ...], T)."""
    K, E = comm.topk, comm.num_experts
    keep = []
    r = _lib.Routing()
    if topk_idx is not None and routing_map is not None:
        _arg_error("pass the routing as topk_idx (+ topk_weights) or as routing_map (+ probs), not both")
    if topk_idx is None and routing_map is None:
        _arg_error("a routing is required: topk_idx (+ topk_weights) or routing_map (+ probs)")
    if topk_idx is not None:
        if probs is not None:
            _arg_error("probs goes with routing_map; with topk_idx pass topk_weights")
        idx, code = _input(fe, topk_idx, "topk_idx", (DType.INT32, DType.INT64), 2, DType.INT64)
        T, k = fe.shape(idx)
        if k != K:
            _shape_error(f"topk_idx has {k} columns but the comm's topk is {K}")
        keep.append((idx, _device_check(fe, comm, idx, "topk_idx")))
        r.num_tokens, r.idx_dtype, r.topk_idx = T, int(code), fe.ptr(idx)
        if topk_weights is not None:
            w, _ = _input(fe, topk_weights, "topk_weights", (DType.FLOAT32,), 2, DType.FLOAT32)
            if fe.shape(w) != (T, K):
                _shape_error(f"topk_weights has shape {fe.shape(w)}, expected {(T, K)} like topk_idx")
            _device_check(fe, comm, w, "topk_weights")
            keep.append((w, None))
            r.topk_weights = fe.ptr(w)
    else:
        if topk_weights is not None:
            _arg_error("topk_weights goes with topk_idx; with routing_map pass probs")
        m, _ = _input(fe, routing_map, "routing_map", (DType.BOOL,), 2, DType.BOOL)
        T, e = fe.shape(m)
        if e != E:
            _shape_error(f"routing_map has {e} columns but the comm has {E} experts")
        keep.append((m, _device_check(fe, comm, m, "routing_map")))
        r.num_tokens, r.idx_dtype, r.routing_map = T, int(DType.INT32), fe.ptr(m)
        if probs is not None:
            p, _ = _input(fe, probs, "probs", (DType.FLOAT32,), 2, DType.FLOAT32)
            if fe.shape(p) != (T, E):
                _shape_error(f"probs has shape {fe.shape(p)}, expected {(T, E)} like routing_map")
            _device_check(fe, comm, p, "probs")
            keep.append((p, None))
            r.probs = fe.ptr(p)
    return r, keep, T


# =============================================================================================
# Handle
# =============================================================================================


class Handle(_Owned):
    """The plan of one dispatch, reused by combine and by both backward passes.

    ``algo``: 'ht' (high-throughput: training, prefill), 'll' (low-latency, fixed shapes:
    decode, CUDA graphs; always the expert layout) or 'alltoall' (baseline). ``layout``:
    'token' (one row per received token) or 'expert' (one row per (token, local expert),
    grouped by local expert, each block padded to ``align`` rows). ``exact`` (CUDA): notify
    waits for the counts so outputs can be sized exactly; ``False`` is sync-free.

    ``recv_budget`` (expert layout of 'ht'): at most that many rows arrive on this rank; pairs
    past it are dropped by the contract's rule (docs/design.md, "Receive budget") and
    ``DispatchResult.dropped`` ([1] int32) counts the pairs the whole group dropped. The CUDA
    backend refuses a budget for now (:class:`UnsupportedError`).

    Re-plan it with new routings as often as you like (``notify`` or ``dispatch`` with a
    routing). ``plan_id`` counts the plans, so a backward pass can tell the plan it needs is
    still the handle's.
    """

    def __init__(self, comm: Comm, algo="ht", layout="token", align: int = 1, exact: bool = True,
                 recv_budget: int = 0):
        self._ptr = None
        lib = _lib.load()
        hc = _lib.HandleConfig()
        lib.epx_handle_config_init(ctypes.byref(hc))
        hc.algo = int(_parse_algo(algo))
        hc.layout = int(_parse_layout(layout))
        if not isinstance(align, (int, np.integer)) or align < 1:
            _arg_error(f"align must be an int >= 1, got {align!r}")
        hc.align = int(align)
        hc.exact = 1 if exact else 0
        if not isinstance(recv_budget, (int, np.integer)) or recv_budget < 0:
            _arg_error(f"recv_budget must be an int >= 0, got {recv_budget!r}")
        hc.recv_budget = int(recv_budget)
        self.recv_budget = int(recv_budget)
        self.comm = comm
        self._algo = Algo(hc.algo)
        self._layout = _LayoutKind.EXPERT if self._algo == Algo.LL else _LayoutKind(hc.layout)
        self._align = 1 if self._algo == Algo.LL else int(align)
        self._exact = bool(exact)
        self._num_tokens: Optional[int] = None
        self._rows: Optional[int] = None  # rows of the last plan, when known on the host
        self.plan_id = 0
        p = ctypes.c_void_p()
        _check(lib.epx_handle_create(comm._p(), ctypes.byref(hc), ctypes.byref(p)), "epx_handle_create")
        self._ptr = p
        with comm.world._lock:
            comm._handles.add(self)
            comm._open_handles += 1

    # -- properties --------------------------------------------------------------------------
    @property
    def algo(self) -> str:
        return self._algo.name.lower()

    @property
    def layout(self) -> str:
        return self._layout.name.lower()

    @property
    def align(self) -> int:
        return self._align

    @property
    def exact(self) -> bool:
        return self._exact

    @property
    def planned(self) -> bool:
        return self._num_tokens is not None

    @property
    def num_tokens(self) -> Optional[int]:
        """T of the last plan (None before the first)."""
        return self._num_tokens

    @property
    def ll_rows(self) -> int:
        """Low-latency: rows per local expert block, R * max_tokens_per_rank."""
        return self.comm.nranks * self.comm._config.max_tokens_per_rank

    def _p(self):
        if self._ptr is None:
            _raise(Status.INVALID_ARGUMENT, "the handle is closed")
        return self._ptr

    def _planned(self, T):
        self._num_tokens = int(T)
        self.plan_id += 1

    # -- notify / info -------------------------------------------------------------------------
    def notify(self, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None) -> None:
        """Collective: plans a dispatch of this routing (layout, count exchange, positions).
        Validates every expert id (:class:`ExpertOutOfRangeError` on every rank); low-latency
        mode refuses more than max_tokens_per_rank tokens (:class:`LowLatencyOverflowError`)."""
        fe = _frontend_of(topk_idx, routing_map)
        r, keep, T = _routing(fe, self.comm, topk_idx, topk_weights, routing_map, probs)
        self._num_tokens = None
        self._rows = None
        with fe.on_stream(self.comm, keep[0][1]):
            st = _lib.load().epx_notify(self.comm._p(), self._p(), ctypes.byref(r))
        _check(st, "epx_notify")
        # CUDA low-latency handles plan inside the dispatch that follows: the routing (and
        # any converted copy of it) must live until then.
        self._routing_keep = keep
        self._planned(T)

    def info(self) -> HandleInfo:
        """Host-side sizes of the last plan (UnsupportedError in CUDA sync-free mode)."""
        L = self.comm.num_local_experts
        counts = np.zeros(L, np.int32)
        inf = _lib.HandleInfo()
        _check(_lib.load().epx_handle_info(self._p(), ctypes.byref(inf), counts.ctypes.data), "epx_handle_info")
        return HandleInfo(inf.num_send_tokens, inf.num_recv_tokens, inf.num_recv_rows, inf.num_recv_pairs,
                          inf.num_sent_copies, counts, inf.num_dropped_pairs)

    def _host_rows(self) -> Optional[int]:
        """Rows of the current plan's receive buffer, or None when only the device knows."""
        if self._algo == Algo.LL:
            return self.comm.num_local_experts * self.ll_rows
        try:
            return int(self.info().num_recv_rows)
        except UnsupportedError:
            return None

    def _bound_rows(self) -> int:
        """Upper bound on receive rows (sync-free CUDA): from max_tokens_per_rank."""
        c = self.comm
        M, R, K, L = c._config.max_tokens_per_rank, c.nranks, c.topk, c.num_local_experts
        if self._layout == _LayoutKind.TOKEN:
            return R * M
        return R * M * min(K, L) + L * (self._align - 1)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None, recv_dtype=None,
                 recv_x=None, recv_scales=None, scale_by_probs: bool = False) -> DispatchResult:
        """Collective: sends each row of ``x [T, H]`` to the ranks of its experts.

        With a routing (either form) it plans first; without one it replays the last plan
        (that is combine's gradient: pass the output gradient as ``x``). Outputs are allocated
        here, sized exactly from the plan (the host knows the counts; low-latency buffers are
        fixed ``[L, R*M, H]``), unless ``recv_x`` (and for fp8 ``recv_scales``) is given: then
        its first dimension is the capacity (:class:`OutputTooSmallError` when rows don't fit)
        and the plan and the dispatch are one call.

        ``recv_dtype``: None (x's type) or 'fp8' (e4m3 with a float32 scale per 128
        channels). ``scale_by_probs`` (expert layout): multiply each row by its weight.
        """
        fe = _frontend_of(x, topk_idx, routing_map)
        c = self.comm
        H, K, L = c.hidden, c.topk, c.num_local_experts
        replay = topk_idx is None and routing_map is None
        if replay and (topk_weights is not None or probs is not None):
            _arg_error("weights or probs without topk_idx / routing_map")
        if replay and not self.planned:
            _arg_error("the handle has no plan yet: pass a routing (topk_idx or routing_map) or call notify()")

        x, x_code = _input(fe, x, "x", (DType.FLOAT32, DType.BFLOAT16), 2)
        dev = _device_check(fe, c, x, "x")
        if fe.shape(x)[1] != H:
            _shape_error(f"x has hidden size {fe.shape(x)[1]} but the comm's hidden is {H}")
        if recv_dtype is None:
            r_code = x_code
        else:
            r_code = _parse_float_dtype(recv_dtype)
            if r_code not in (x_code, DType.FP8_E4M3):
                _dtype_error(f"recv_dtype must be x's type ({x_code.name.lower()}) or fp8, not {r_code.name.lower()}")
        if scale_by_probs and self._layout == _LayoutKind.TOKEN:
            _arg_error("scale_by_probs needs the expert layout (or low-latency)")

        routing = None
        keep = None
        if replay:
            T = self._num_tokens
        else:
            routing, keep, T = _routing(fe, c, topk_idx, topk_weights, routing_map, probs)
        if fe.shape(x)[0] != T:
            what = "the routing" if not replay else "the handle's last plan"
            _shape_error(f"x has {fe.shape(x)[0]} rows but {what} has {T} tokens")

        lib = _lib.load()
        ll = self._algo == Algo.LL
        blocks = (H + _lib.FP8_BLOCK - 1) // _lib.FP8_BLOCK
        rows_known = None
        if recv_x is not None:
            if ll:
                want = (L, self.ll_rows, H)
                if tuple(fe.shape(recv_x)) == (L * self.ll_rows, H):
                    want = (L * self.ll_rows, H)
            else:
                s = fe.shape(recv_x)
                if len(s) != 2 or s[1] != H:
                    _shape_error(f"recv_x must be [capacity, {H}], got {tuple(s)}")
                want = s
            _output(fe, recv_x, "recv_x", want, (r_code,))
            _device_check(fe, c, recv_x, "recv_x")
            cap = L * self.ll_rows if ll else fe.shape(recv_x)[0]
        else:
            if ll:
                cap = L * self.ll_rows
            else:
                # Exact sizes where the host can know them: plan first (the CPU backend always
                # knows the counts; CUDA in exact mode waits for them), then size the outputs.
                # CUDA sync-free: one call, outputs sized for the worst case of the config.
                exact = self._exact or c.backend == "host"
                if routing is not None and exact:
                    self._num_tokens = None
                    with fe.on_stream(c, dev):
                        st = lib.epx_notify(c._p(), self._p(), ctypes.byref(routing))
                    _check(st, "epx_notify")
                    self._planned(T)
                    routing = None
                cap = self._host_rows() if routing is None else None
                if cap is None:
                    cap = self._bound_rows()
                else:
                    rows_known = cap
            shape = (L, self.ll_rows, H) if ll else (cap, H)
            recv_x = fe.alloc(shape, r_code, like=x, device=dev, zero=True)
        lead = (L, self.ll_rows) if ll else (cap,)
        if r_code == DType.FP8_E4M3:
            if recv_scales is None:
                recv_scales = fe.alloc(lead + (blocks,), DType.FLOAT32, device=dev, zero=True)
            else:
                ok = (tuple(fe.shape(recv_scales)) in (lead + (blocks,), (cap, blocks)))
                if not ok:
                    _shape_error(f"recv_scales has shape {tuple(fe.shape(recv_scales))}, expected {lead + (blocks,)}")
                _output(fe, recv_scales, "recv_scales", None, (DType.FLOAT32,))
                _device_check(fe, c, recv_scales, "recv_scales")
        elif recv_scales is not None:
            _arg_error("recv_scales is for fp8 dispatch only")

        token = self._layout == _LayoutKind.TOKEN
        # rows past the received count (unknown on the host in sync-free mode) read as "no
        # expert" rather than as garbage ids
        rtopk = fe.alloc((cap, K), DType.INT32, device=dev, zero=False) if token else None
        if rtopk is not None and rows_known is None:
            rtopk[...] = -1
        rw = fe.alloc((cap, K), DType.FLOAT32, device=dev, zero=rows_known is None) if token else None
        rprobs = None if token else fe.alloc(lead, DType.FLOAT32, device=dev, zero=True)
        counts = fe.alloc((L,), DType.INT32, device=dev, zero=True)
        nrows = fe.alloc((1,), DType.INT64, device=dev, zero=True)
        dropped = fe.alloc((1,), DType.INT32, device=dev, zero=True)

        a = _lib.DispatchArgs()
        lib.epx_dispatch_args_init(ctypes.byref(a))
        a.x = fe.ptr(x)
        a.x_dtype = int(x_code)
        a.recv_dtype = int(r_code)
        a.recv_x = fe.ptr(recv_x)
        a.recv_scales = fe.ptr(recv_scales) if recv_scales is not None else None
        a.recv_capacity = int(cap)
        a.recv_topk_idx = fe.ptr(rtopk) if token else None
        a.recv_topk_weights = fe.ptr(rw) if token else None
        a.recv_probs = fe.ptr(rprobs) if rprobs is not None else None
        a.tokens_per_local_expert = fe.ptr(counts)
        a.num_recv_rows = fe.ptr(nrows)
        a.scale_by_probs = 1 if scale_by_probs else 0
        a.dropped = fe.ptr(dropped)
        if routing is not None:
            self._num_tokens = None
            self._rows = None
        with fe.on_stream(c, dev):
            st = lib.epx_dispatch(c._p(), self._p(), ctypes.byref(routing) if routing is not None else None,
                                  ctypes.byref(a))
        if routing is not None and st in (Status.SUCCESS, Status.OUTPUT_TOO_SMALL):
            self._planned(T)  # (too small: the plan stands, only this output could not take it)
        _check(st, "epx_dispatch")
        del keep

        written = fe.host_int(nrows)  # None where only the device knows (CUDA tensors)
        if not ll and written is not None:
            rows_known = written
        self._rows = L * self.ll_rows if ll else rows_known
        res = DispatchResult(recv_x=recv_x, recv_scales=recv_scales if r_code == DType.FP8_E4M3 else None,
                             recv_topk_idx=rtopk, recv_topk_weights=rw, recv_probs=rprobs,
                             tokens_per_local_expert=counts, num_rows=written if ll else rows_known,
                             layout=self.layout, algo=self.algo, align=self._align)
        if rows_known is not None and not ll and rows_known < cap:
            # The caller's buffer had room to spare: hand back the rows that were written.
            for f in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_probs"):
                v = getattr(res, f)
                if v is not None:
                    setattr(res, f, fe.slice_rows(v, rows_known))
        res._num_recv_rows_buf = nrows
        res.dropped = dropped  # [1] int32: pairs the group dropped past its receive budgets
        self._last_counts = counts  # (low-latency backward masks rows past the counts)
        return res

    # -- combine -----------------------------------------------------------------------------
    def combine(self, y, *, out=None, out_dtype=None, weighted: bool = True, row_probs=None, row_weight_grad=None):
        """Collective: the inverse of the handle's dispatch; returns ``out [T, H]``.

        ``y`` holds the rows of the handle's layout (token ``[N, H]``, expert ``[rows, H]``,
        low-latency ``[L, R*M, H]``), float32 or bfloat16. Token layout: ``out[t]`` is the
        float32 sum of its rows over destination ranks, rounded once. Expert layout: each
        destination sums its rows times their weight (``weighted``; ``row_probs`` overrides the
        weights dispatch delivered) per token, then the source sums the partials.

        ``row_weight_grad`` (token layout ``[N, K]``, expert ``[rows]``): sends each value back to
        its topk slot; then the call returns ``(out, topk_weight_grad [T, K])``.
        """
        if not self.planned:
            _arg_error("the handle has no plan yet: dispatch before combine")
        fe = _frontend_of(y)
        c = self.comm
        H, K, L = c.hidden, c.topk, c.num_local_experts
        T = self._num_tokens
        ll = self._algo == Algo.LL
        y, y_code = _input(fe, y, "y", (DType.FLOAT32, DType.BFLOAT16), (2, 3))
        dev = _device_check(fe, c, y, "y")
        ys = tuple(fe.shape(y))
        if ll:
            if ys not in ((L, self.ll_rows, H), (L * self.ll_rows, H)):
                _shape_error(f"y must be [{L}, {self.ll_rows}, {H}] in low-latency mode, got {ys}")
            lead = (L, self.ll_rows) if len(ys) == 3 else (L * self.ll_rows,)
        else:
            if len(ys) != 2 or ys[1] != H:
                _shape_error(f"y must be [rows, {H}], got {ys}")
            if self._rows is not None and ys[0] < self._rows:
                _shape_error(f"y has {ys[0]} rows but the plan has {self._rows}")
            lead = (ys[0],)
        o_code = y_code if out_dtype is None else _parse_float_dtype(out_dtype)
        if o_code not in (DType.FLOAT32, DType.BFLOAT16):
            _dtype_error("out_dtype must be float32 or bfloat16")
        if out is None:
            out = fe.alloc((T, H), o_code, like=y, device=dev, zero=False)
        else:
            o_code = _output(fe, out, "out", (T, H), (DType.FLOAT32, DType.BFLOAT16))
            _device_check(fe, c, out, "out")
        rp = None
        if row_probs is not None:
            if self._layout == _LayoutKind.TOKEN:
                _arg_error("row_probs is for the expert layout (token layout rows are summed unweighted)")
            rp, _ = _input(fe, row_probs, "row_probs", (DType.FLOAT32,), None, DType.FLOAT32)
            if tuple(fe.shape(rp)) not in (lead, (int(np.prod(lead)),)):
                _shape_error(f"row_probs has shape {tuple(fe.shape(rp))}, expected {lead}")
            _device_check(fe, c, rp, "row_probs")
        rwg = twg = None
        if row_weight_grad is not None:
            want = lead + (K,) if self._layout == _LayoutKind.TOKEN else lead
            rwg, _ = _input(fe, row_weight_grad, "row_weight_grad", (DType.FLOAT32,), None, DType.FLOAT32)
            flat = (int(np.prod(want[:-1])), K) if self._layout == _LayoutKind.TOKEN else (int(np.prod(want)),)
            if tuple(fe.shape(rwg)) not in (want, flat):
                _shape_error(f"row_weight_grad has shape {tuple(fe.shape(rwg))}, expected {want}")
            _device_check(fe, c, rwg, "row_weight_grad")
            twg = fe.alloc((T, K), DType.FLOAT32, device=dev, zero=True)

        lib = _lib.load()
        a = _lib.CombineArgs()
        lib.epx_combine_args_init(ctypes.byref(a))
        a.y = fe.ptr(y)
        a.y_dtype = int(y_code)
        a.out = fe.ptr(out)
        a.out_dtype = int(o_code)
        a.weighted = 1 if weighted else 0
        a.row_probs = fe.ptr(rp) if rp is not None else None
        a.row_weight_grad = fe.ptr(rwg) if rwg is not None else None
        a.topk_weight_grad = fe.ptr(twg) if twg is not None else None
        with fe.on_stream(c, dev):
            st = lib.epx_combine(c._p(), self._p(), ctypes.byref(a))
        _check(st, "epx_combine")
        return out if twg is None else (out, twg)

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._ptr is None:
            return
        ptr, self._ptr = self._ptr, None
        with self.comm.world._lock:
            self.comm._handles.discard(self)
            self.comm._open_handles -= 1
        _check(_lib.load().epx_handle_destroy(ptr), "epx_handle_destroy")


    def __repr__(self):
        return (f"<epx.Handle {self.algo} {self.layout} align={self._align} rank {self.comm.rank}"
                f"{' planned T=' + str(self._num_tokens) if self.planned else ''}>")
