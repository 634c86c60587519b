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

import os as _os

# Ranks that share a GPU run kernels that wait on each other: no rank's stream may queue behind
# another's in one hardware queue, so ask CUDA for as many queues as it has (the default is 8).
# This takes effect only if CUDA has not started in this process yet (import epx before any CUDA
# work); a value the user set is kept. libepx does the same when it starts CUDA itself.
_os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Lazy module loading (torch asks for it when it starts CUDA) can make a kernel's first launch
# wait for the device to go idle, which never happens while peer ranks' kernels wait on this
# one: load eagerly unless the user chose.
_os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from ._lib import Algo, Backend, DType, Layout as LayoutKind, Status, MAX_EXPERTS, MAX_HIDDEN, MAX_RANKS, MAX_TOPK
from ._lib import FP8_BLOCK, UNIQUE_ID_BYTES, LibraryNotFound
from .core import (
    BrokenCommError,
    Comm,
    CommTimeoutError,
    Config,
    ConfigMismatchError,
    CudaError,
    DeviceError,
    DispatchResult,
    DTypeError,
    Error,
    ExpertOutOfRangeError,
    ExpertsNotDivisibleError,
    Handle,
    HandleInfo,
    HiddenRangeError,
    InternalError,
    InvalidArgumentError,
    Layout,
    LowLatencyOverflowError,
    NullPointerError,
    OutOfMemoryError,
    OutputTooSmallError,
    PeerLostError,
    RowAlignmentError,
    ShapeError,
    SystemCallError,
    TimeoutError_,
    TopkRangeError,
    UnsupportedError,
    World,
    backend_available,
    backend_unavailable_reason,
    bf16_bits_to_float32,
    dequantize_e4m3,
    e4m3_to_float32,
    error_class,
    float32_to_bf16_bits,
    get_unique_id,
    library_path,
    map_to_topk,
    quantize_e4m3,
    run_threads,
    status_string,
    topk_to_map,
)

from .layout import layout_counts

__version__ = "0.1.0"

__all__ = [
    "Algo", "Backend", "DType", "LayoutKind", "Status", "MAX_EXPERTS", "MAX_HIDDEN", "MAX_RANKS", "MAX_TOPK",
    "FP8_BLOCK", "UNIQUE_ID_BYTES", "LibraryNotFound",
    "World", "Comm", "Handle", "Config", "HandleInfo", "Layout", "DispatchResult",
    "Error", "InvalidArgumentError", "ShapeError", "DTypeError", "DeviceError", "NullPointerError",
    "ExpertOutOfRangeError", "ExpertsNotDivisibleError", "TopkRangeError", "HiddenRangeError",
    "RowAlignmentError", "OutputTooSmallError", "LowLatencyOverflowError", "ConfigMismatchError",
    "CommTimeoutError", "TimeoutError_", "PeerLostError", "UnsupportedError", "OutOfMemoryError",
    "SystemCallError", "CudaError", "BrokenCommError", "InternalError", "error_class",
    "backend_available", "backend_unavailable_reason", "library_path", "status_string", "get_unique_id",
    "map_to_topk", "topk_to_map", "float32_to_bf16_bits", "bf16_bits_to_float32", "e4m3_to_float32",
    "quantize_e4m3", "dequantize_e4m3", "run_threads", "layout_counts",
]
