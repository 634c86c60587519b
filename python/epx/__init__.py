"""epx — expert-parallel exchange, from Python.

Moves Mixture-of-Experts tokens between the ranks of an expert-parallel group: ``dispatch``
sends each token to the ranks holding its top-k experts, ``combine`` brings the expert outputs
back and reduces them per token, deterministically (same bits on every backend).

A pure-Python package over libepx (``ctypes``); numpy arrays run on the CPU backend, torch
tensors through :mod:`epx.torch` (imported lazily; torch is optional).

    import numpy as np, epx

    with epx.World(nranks=4, backend="host") as world:
        def rank_fn(rank):
            with world.comm(rank, num_experts=8, hidden=64, topk=2) as comm, comm.handle("ht") as h:
                res = h.dispatch(x[rank], topk_idx=idx[rank], topk_weights=w[rank])
                y = my_experts(res.recv_x, res.recv_topk_idx, res.recv_topk_weights)
                return h.combine(y)
        outs = world.run(rank_fn)          # one thread per rank; results in rank order

Errors raise :class:`epx.Error` subclasses (see its docstring for the table), each carrying
``.status`` (a :class:`Status`: an int with a name) and ``.message``.
"""

from ._lib import Algo, Backend, DType, Layout as LayoutKind, Status, MAX_EXPERTS, MAX_HIDDEN, MAX_RANKS, MAX_TOPK
from ._lib import FP8_BLOCK, UNIQUE_ID_BYTES, LibraryNotFound, LibraryVersionMismatch
from .comm import Comm
from .config import Config, backend_available, backend_unavailable_reason, library_path, status_string
from .dtypes import bf16_bits_to_float32, dequantize_e4m3, e4m3_to_float32, float32_to_bf16_bits, quantize_e4m3
from .errors import (
    BrokenCommError,
    BusyError,
    CommTimeoutError,
    ConfigMismatchError,
    CudaError,
    DeviceError,
    DTypeError,
    Error,
    ExpertOutOfRangeError,
    ExpertsNotDivisibleError,
    HiddenRangeError,
    InternalError,
    InvalidArgumentError,
    LowLatencyOverflowError,
    NullPointerError,
    OutOfMemoryError,
    OutOfStepError,
    OutputTooSmallError,
    PeerLostError,
    RowAlignmentError,
    ShapeError,
    SystemCallError,
    TimeoutError_,
    TopkRangeError,
    UnsupportedError,
    error_class,
)
from .handle import Handle
from .results import DispatchResult, HandleInfo, Layout, NodeTraffic
from .routing import map_to_topk, topk_to_map
from .world import World, get_unique_id, run_threads

from .layout import layout_counts

from ._lib import PACKAGE_VERSION as __version__  # the file VERSION, as libepx and CMake

__all__ = [
    "Algo", "Backend", "DType", "LayoutKind", "Status", "MAX_EXPERTS", "MAX_HIDDEN", "MAX_RANKS", "MAX_TOPK",
    "FP8_BLOCK", "UNIQUE_ID_BYTES", "LibraryNotFound", "LibraryVersionMismatch",
    "World", "Comm", "Handle", "Config", "HandleInfo", "NodeTraffic", "Layout", "DispatchResult",
    "Error", "InvalidArgumentError", "ShapeError", "DTypeError", "DeviceError", "NullPointerError",
    "ExpertOutOfRangeError", "ExpertsNotDivisibleError", "TopkRangeError", "HiddenRangeError",
    "RowAlignmentError", "OutputTooSmallError", "LowLatencyOverflowError", "ConfigMismatchError",
    "CommTimeoutError", "TimeoutError_", "PeerLostError", "UnsupportedError", "OutOfMemoryError",
    "SystemCallError", "CudaError", "BrokenCommError", "InternalError", "OutOfStepError", "BusyError",
    "error_class",
    "backend_available", "backend_unavailable_reason", "library_path", "status_string", "get_unique_id",
    "map_to_topk", "topk_to_map", "float32_to_bf16_bits", "bf16_bits_to_float32", "e4m3_to_float32",
    "quantize_e4m3", "dequantize_e4m3", "run_threads", "layout_counts",
]
