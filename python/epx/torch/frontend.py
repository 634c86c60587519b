"""The torch frontend: how the package handles torch tensors (the same interface as
:mod:`epx.numpy_frontend`). CPU tensors go to the CPU backend, CUDA tensors to the CUDA
backend, on the caller's current stream."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from .._lib import DType, Status
from ..errors import DeviceError, _dtype_error
from ..frontend import _Frontend


_TORCH_OF = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
    DType.BOOL: torch.bool,
}
_FP8 = getattr(torch, "float8_e4m3fn", None)
# uint8 is a bool map or fp8 bits
_TORCH_CODES = [(torch.float32, (DType.FLOAT32,)), (torch.bfloat16, (DType.BFLOAT16,)), (_FP8, (DType.FP8_E4M3,)),
                (torch.uint8, (DType.BOOL, DType.FP8_E4M3)), (torch.bool, (DType.BOOL,)),
                (torch.int32, (DType.INT32,)), (torch.int64, (DType.INT64,))]
if _FP8 is not None:
    _TORCH_OF[DType.FP8_E4M3] = _FP8


class _TorchFrontend(_Frontend):
    name = "torch"
    array_type = torch.Tensor
    code_table = _TORCH_CODES

    @staticmethod
    def device(a) -> str:
        d = a.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else torch.cuda.current_device()}"

    @staticmethod
    def ptr(a):
        """The data pointer; never NULL for an empty tensor (whose data_ptr() is 0, which the
        library reads as 'not given'): 16 spare bytes on the same device stand in."""
        if a is None:
            return None
        if a.numel():
            return a.data_ptr()
        key = str(a.device)
        spare = _SPARE.get(key)
        if spare is None:
            spare = _SPARE[key] = torch.zeros(16, dtype=torch.uint8, device=a.device)
        return spare.data_ptr()

    @staticmethod
    def contiguous(a):
        return a.detach().contiguous()

    @staticmethod
    def is_contiguous_writable(a) -> bool:
        return a.is_contiguous()

    @staticmethod
    def convert(a, code):
        fl = a.is_floating_point()
        integral = not fl and not a.is_complex() and a.dtype != torch.bool
        if code == DType.FLOAT32 and fl:
            return a.detach().to(torch.float32)
        if code == DType.INT64 and integral:
            return a.detach().to(torch.int64)
        if code == DType.BOOL and not a.is_complex():
            return a.detach() != 0
        return None

    @staticmethod
    def alloc(shape, code, like=None, device=None, zero=True):
        dt = _TORCH_OF.get(code)
        if dt is None:
            _dtype_error(f"this torch has no dtype for {code.name.lower()}")
        dev = torch.device(device or "cpu")
        return torch.zeros(shape, dtype=dt, device=dev) if zero else torch.empty(shape, dtype=dt, device=dev)

    @staticmethod
    @contextlib.contextmanager
    def on_stream(comm, device):
        """Around one C call on CUDA tensors: the comm works on the caller's current stream.
        The legacy default stream (torch's default) cannot host epx's work when ranks share a
        GPU (it would serialise kernels that wait on each other), so then the work goes to a
        side stream of the comm, fenced both ways with the current stream."""
        if not device or not device.startswith("cuda"):
            yield
            return
        dev = torch.device(device)
        cur = torch.cuda.current_stream(dev)
        if cur.cuda_stream != 0:
            comm.set_stream(cur.cuda_stream)
            yield
            return
        if comm.world.shares_device(comm.rank):
            raise DeviceError(Status.INVALID_ARGUMENT,
                              f"rank {comm.rank} shares {device} with other ranks of this process but runs on "
                              "torch's default stream, which would queue the ranks behind each other: run the "
                              "ranks through World.run, or give each its own stream (torch.cuda.stream(...))")
        side = getattr(comm, "_torch_side_streams", {}).get(device)
        if side is None:
            side = torch.cuda.Stream(device=dev)
            comm.__dict__.setdefault("_torch_side_streams", {})[device] = side
        side.wait_stream(cur)
        comm.set_stream(side.cuda_stream)
        try:
            yield
        finally:
            cur.wait_stream(side)

    @staticmethod
    def host_int(a) -> Optional[int]:
        return int(a.reshape(-1)[0]) if a.device.type == "cpu" else None


_SPARE: Dict[str, "torch.Tensor"] = {}
_TORCH = _TorchFrontend()
