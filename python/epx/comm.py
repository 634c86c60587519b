"""Comm: one rank's endpoint of a group."""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from typing import TYPE_CHECKING, Optional

from . import _lib
from ._lib import DType, Status
from .arrays import _frontend_of
from .collective import _Collective
from .config import Config
from .errors import _arg_error, _check, _raise
from .results import Layout
from .routing import _routing
from .world import World, _Owned

if TYPE_CHECKING:
    from .handle import Handle


def _refuse_init(world: World, rank: int) -> int:
    """epx_comm_init with a config it refuses (struct_size 0), which still joins the exchange."""
    p = ctypes.c_void_p()
    return _lib.load().epx_comm_init(world._ptr, int(rank), ctypes.byref(_lib.Config()), ctypes.byref(p))


class Comm(_Owned):
    """One rank's endpoint. Creating it is collective: every rank of the group creates its
    comm with the same config (compared across ranks: a difference raises
    :class:`ConfigMismatchError` on every rank). ``config`` and keyword overrides build a
    :class:`Config`."""

    def __init__(self, world: World, rank: int, config: Optional[Config] = None, **kw):
        self._ptr = None
        lib = _lib.load()
        p = ctypes.c_void_p()
        # a rank whose config Python refuses still joins the config exchange, so its peers
        # fail at once naming it (epx.collective)
        with _Collective(None, lambda: _refuse_init(world, rank)) as op:
            if config is None:
                config = Config()
            if kw:
                bad = set(kw) - {f.name for f in dataclasses.fields(Config)}
                if bad:
                    _arg_error(f"unknown config fields {sorted(bad)}")
                config = dataclasses.replace(config, **kw)
            c = config._c()
            st = op.call(lambda: lib.epx_comm_init(world._handle_ptr(), int(rank), ctypes.byref(c), ctypes.byref(p)),
                         None)
            _check(st, "epx_comm_init")
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
        from .handle import Handle  # (handle.py builds on this module)

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
