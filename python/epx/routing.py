"""Routings: the two forms epx takes (top-k slots or a multi-hot map), converted on numpy, and
the ``epx_routing_t`` a call passes to C."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import numpy as np

from . import _lib
from ._lib import DType
from .arrays import _device_check, _input
from .errors import _arg_error, _check, _dtype_error, _shape_error

if TYPE_CHECKING:
    from .comm import Comm


def map_to_topk(routing_map, probs=None, *, topk: int) -> Tuple[np.ndarray, np.ndarray]:
    """Multi-hot routing map [T, E] (+ probs [T, E]) -> (topk_idx int32 [T, K], topk_weights
    float32 [T, K]); slots in ascending expert id, padded with -1 / 0.0. A row with more than
    ``topk`` experts raises :class:`TopkRangeError`. Host memory (numpy) only."""
    m = _np_map(routing_map, "routing_map")
    T, E = m.shape
    p = _np_weights(probs, "probs", (T, E), "routing_map")
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
    w = _np_weights(topk_weights, "topk_weights", (T, K), "topk_idx")
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


def _np_weights(a, name, shape, like):
    """The optional float32 weights that go with a routing (probs, topk_weights), of its shape."""
    if a is None:
        return None
    a = _np_float32(a, name)
    if a.shape != shape:
        _shape_error(f"{name} has shape {a.shape}, expected {shape} like {like}")
    return a


def _np_idx(a, name):
    a = np.asarray(a)
    if a.ndim != 2:
        _shape_error(f"{name} must be 2-D [T, K], got shape {a.shape}")
    if a.dtype == np.int32:
        return np.ascontiguousarray(a), DType.INT32
    if not np.issubdtype(a.dtype, np.integer):
        _dtype_error(f"{name} must hold integer expert ids, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64), DType.INT64


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
        r.topk_weights = _routing_weights(fe, comm, topk_weights, "topk_weights", (T, K), "topk_idx", keep)
    else:
        if topk_weights is not None:
            _arg_error("topk_weights goes with topk_idx; with routing_map pass probs")
        m, _ = _input(fe, routing_map, "routing_map", (DType.BOOL,), 2, DType.BOOL)
        T, e = fe.shape(m)
        if e != E:
            _shape_error(f"routing_map has {e} columns but the comm has {E} experts")
        keep.append((m, _device_check(fe, comm, m, "routing_map")))
        r.num_tokens, r.idx_dtype, r.routing_map = T, int(DType.INT32), fe.ptr(m)
        r.probs = _routing_weights(fe, comm, probs, "probs", (T, E), "routing_map", keep)
    return r, keep, T


def _routing_weights(fe, comm: Comm, a, name, shape, like, keep):
    """The pointer of the optional float32 weights of a routing (topk_weights, probs), checked
    against its shape and the comm's device; the array goes to ``keep``. None when absent."""
    if a is None:
        return None
    a, _ = _input(fe, a, name, (DType.FLOAT32,), 2, DType.FLOAT32)
    if fe.shape(a) != shape:
        _shape_error(f"{name} has shape {fe.shape(a)}, expected {shape} like {like}")
    _device_check(fe, comm, a, name)
    keep.append((a, None))
    return fe.ptr(a)
