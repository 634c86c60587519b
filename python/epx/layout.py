"""The layout of a routing from the group's shape alone (no comm): epx_layout_counts."""

import ctypes

import numpy as np

from . import _lib
from ._lib import DType
from .errors import _arg_error, _check


def layout_counts(topk_idx, *, nranks: int, num_experts: int):
    """``(tokens_per_rank [R] int32, tokens_per_expert [E] int32, is_token_in_rank [T, R]
    bool)`` of ``topk_idx [T, K]`` (int32 or int64, -1 = no expert) over ``nranks`` ranks of
    ``num_experts / nranks`` experts each. Host memory: numpy arrays, or CPU torch tensors (the
    results are then torch tensors too). Validates the ids as dispatch does."""
    as_torch = type(topk_idx).__module__.startswith("torch")
    if as_torch:
        if topk_idx.device.type != "cpu":
            _arg_error("layout_counts takes host memory: pass CPU tensors (or use Comm.layout on CUDA)")
        idx = topk_idx.detach().to(dtype=__import__("torch").int64).contiguous().numpy()
    else:
        idx = np.ascontiguousarray(topk_idx, dtype=np.int64)
    if idx.ndim != 2:
        _arg_error(f"topk_idx must be [T, K], got shape {idx.shape}")
    T, K = idx.shape
    R = int(nranks)
    r = _lib.Routing()
    r.num_tokens, r.idx_dtype, r.topk_idx = T, int(DType.INT64), idx.ctypes.data if idx.size else None
    tpr = np.zeros(R, np.int32)
    tpe = np.zeros(int(num_experts), np.int32)
    itr = np.zeros((T, R), np.bool_)
    if T == 0:
        r.topk_idx = tpr.ctypes.data  # any non-NULL pointer: nothing is read
    st = _lib.load().epx_layout_counts(R, int(num_experts), int(K), ctypes.byref(r), tpr.ctypes.data,
                                        tpe.ctypes.data, itr.ctypes.data)
    _check(st, "epx_layout_counts")
    if as_torch:
        import torch

        return torch.from_numpy(tpr), torch.from_numpy(tpe), torch.from_numpy(itr)
    return tpr, tpe, itr
