"""The checks every call makes on the arrays it takes, written once for every frontend: which
frontend an argument belongs to, inputs (converted where that is harmless), caller-provided
outputs, and the device an array lives on."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _lib
from ._lib import Status
from .errors import DeviceError, _arg_error, _dtype_error, _shape_error
from .numpy_frontend import _NUMPY

if TYPE_CHECKING:
    from .comm import Comm


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
