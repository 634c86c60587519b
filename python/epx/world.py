"""World: the ranks this process drives, how they are created (in one process, from a unique id,
over an allgather, from torch.distributed) and run (a thread per rank); the life cycle World,
Comm and Handle share.

Collectives (Comm creation, notify, dispatch, combine) must be entered by every rank of the
group. A process that drives several ranks (a *local* world) calls each rank from its own
thread: :meth:`World.run` does that. A Python-side argument error is raised on the rank that
made it before any exchange; its peers then stop at their bounded wait with
:class:`CommTimeoutError`, exactly as a C-side argument error would.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from ._lib import Backend, Status
from .config import Config, _parse_backend
from .errors import _arg_error, _check, _raise, _shape_error, error_class
from .gpu import cuda_layer, prepare_shared_gpu

if TYPE_CHECKING:
    from .comm import Comm


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
        prepare_shared_gpu(int(nranks), Backend(wc.backend), self._devices)  # before CUDA starts
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

    @classmethod
    def _one_rank_config(cls, rank, nranks, backend, device):
        """The world config of one rank of a group spread over processes: only this rank's
        device (if given) is set. Never the settings of ranks sharing a GPU (see epx.gpu)."""
        if not 0 <= rank < nranks:
            _arg_error(f"rank {rank} outside [0, {nranks})")
        devices = None
        if device is not None:
            devices = [-1] * nranks
            devices[rank] = int(device)
        return cls._world_config(int(nranks), backend, devices)

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
        wc, keep = cls._one_rank_config(rank, nranks, backend, device)
        uid = _unique_id_struct(unique_id)
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
        wc, keep = cls._one_rank_config(rank, nranks, backend, device)
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
        from .comm import Comm  # (comm.py builds on this module)

        return Comm(self, self.rank if rank is None else rank, config, **kw)

    def init_comms(self, config: Optional[Config] = None, **kw) -> List["Comm"]:
        """Creates the comm of every rank this process drives (on threads), in rank order."""
        from .comm import Comm

        return self.run(lambda r: Comm(self, r, config, **kw))

    # -- running ranks -----------------------------------------------------------------------
    def device_of(self, rank: int) -> Optional[int]:
        """The CUDA device of a rank this world drives (None on the host backend)."""
        if self.backend != "cuda":
            return None
        devices = getattr(self, "_devices", None)
        if devices is not None and devices[rank] >= 0:
            return int(devices[rank])
        return rank % max(cuda_layer().device_count(), 1)  # as libepx places them

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
        other streams inside a collective (see epx.torch.streams.prepare)."""
        ranks = list(self._ranks)
        if self.backend == "cuda":
            fn = cuda_layer().on_rank_streams(self, fn, streams)
        elif streams is not None:
            raise ValueError("World.run: streams are for a CUDA world")
        if len(ranks) == 1:
            return [fn(ranks[0], *args, **kwargs)]
        return run_threads(ranks, fn, *args, **kwargs)

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
