"""What a world, comm and handle are made from: :class:`Config` (``epx_config_t``), the names of
backends, algorithms and layouts, and what this build and machine support."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Optional

import numpy as np

from . import _lib
from ._lib import Algo, Backend
from ._lib import Layout as _LayoutKind
from .errors import _arg_error


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


def _parse_name(v, kind, names, what: str, choices: str):
    """``v`` as a ``kind`` enum: itself, or the value its name (any case) stands for in ``names``."""
    if isinstance(v, kind):
        return v
    if isinstance(v, str) and v.lower() in names:
        return names[v.lower()]
    _arg_error(f"unknown {what} {v!r}: use {choices}")


def _parse_algo(a) -> Algo:
    return _parse_name(a, Algo, _ALGOS, "algorithm", "'ht', 'll' or 'alltoall'")


def _parse_layout(x) -> _LayoutKind:
    return _parse_name(x, _LayoutKind, _LAYOUTS, "layout", "'token' or 'expert'")


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
    ranks_per_node: int = 0  # 0 = one node; else a divisor of the group size (host backend)

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
