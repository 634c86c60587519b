"""ctypes declarations of include/epx.h, and the loader of libepx.

Everything here mirrors epx.h exactly: the structs have the header's fields in the header's
order with the header's types, the enums the header's values. Keep the two in step: a field
added to a struct in epx.h must be added here at the same place (``tests/python`` checks the
sizes the library's own ``*_init`` functions write against these structs).

Where libepx is looked for, first found wins:

1. next to this file: ``epx/lib/libepx.so`` or ``epx/libepx.so`` (what ``pip install .``
   puts there);
2. the file named by the ``EPX_LIBRARY`` environment variable;
3. ``build/libepx.so`` of the source checkout this file lives in (``make build``), so tests
   and examples run from a checkout without installing.

The library is opened with ``ctypes.CDLL``, which releases the GIL during every call: ranks
driven from Python threads run their collectives concurrently.
"""

from __future__ import annotations

import ctypes
import enum
import os
import sys
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_void_p,
)
from pathlib import Path

# ---- version ----------------------------------------------------------------------------


def _read_version() -> str:
    """The package's version: the file VERSION, the one version source of C, CMake and Python.
    An installed package has it at epx/VERSION (CMake installs it there), a checkout at its root.
    A copy of the package with neither is "unknown", and will accept no library."""
    here = Path(__file__).resolve().parent
    for f in (here / "VERSION", here.parent.parent / "VERSION"):
        if f.is_file():
            return f.read_text().strip()
    return "unknown"


PACKAGE_VERSION = _read_version()
VERSION_MAJOR, VERSION_MINOR, VERSION_PATCH = (
    tuple(int(p) for p in PACKAGE_VERSION.split(".")[:3]) if PACKAGE_VERSION != "unknown" else (0, 0, 0))
VERSION_CODE = VERSION_MAJOR * 10000 + VERSION_MINOR * 100 + VERSION_PATCH

# ---- constants (epx.h) ------------------------------------------------------------------

MAX_RANKS = 64
MAX_TOPK = 32
MAX_EXPERTS = 4096
MAX_HIDDEN = 65536
FP8_BLOCK = 128
UNIQUE_ID_BYTES = 128


class Status(enum.IntEnum):
    """epx_status_t. ``int(s)`` is the C value, ``s.name`` the name without ``EPX_``/``EPX_ERR_``."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    NULL_POINTER = 2
    EXPERT_OUT_OF_RANGE = 3
    EXPERTS_NOT_DIVISIBLE = 4
    TOPK_RANGE = 5
    HIDDEN_RANGE = 6
    ROW_ALIGNMENT = 7
    OUTPUT_TOO_SMALL = 8
    LL_OVERFLOW = 9
    CONFIG_MISMATCH = 10
    TIMEOUT = 11
    PEER_LOST = 12
    UNSUPPORTED = 13
    OUT_OF_MEMORY = 14
    SYSTEM = 15
    CUDA = 16
    BROKEN = 17
    INTERNAL = 18
    OUT_OF_STEP = 19
    BUSY = 20

    @property
    def c_name(self) -> str:
        """The C enumerator's name, e.g. ``EPX_ERR_TIMEOUT``."""
        return "EPX_SUCCESS" if self == Status.SUCCESS else "EPX_ERR_" + self.name


NUM_STATUS = 21


class DType(enum.IntEnum):
    """epx_dtype_t."""

    FLOAT32 = 0
    BFLOAT16 = 1
    FP8_E4M3 = 2
    INT32 = 3
    INT64 = 4
    BOOL = 5


DTYPE_SIZE = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FP8_E4M3: 1, DType.INT32: 4, DType.INT64: 8, DType.BOOL: 1}


class Backend(enum.IntEnum):
    """epx_backend_t."""

    HOST = 0
    CUDA = 1
    AUTO = 2


class Algo(enum.IntEnum):
    """epx_algo_t."""

    HT = 0
    LL = 1
    ALLTOALL = 2


class Layout(enum.IntEnum):
    """epx_layout_t."""

    TOKEN = 0
    EXPERT = 1


# ---- structs (epx.h, same order, same types) ---------------------------------------------
# C enums are ints on every ABI epx supports.
c_enum = c_int

# The head of every struct the caller fills (epx.h, "A stable ABI"): its size and the epx.h
# version it was set up from, both written by the struct's epx_*_init and checked by libepx.
_STRUCT_HEAD = [("struct_size", c_uint32), ("struct_version", c_uint32)]


class WorldConfig(Structure):
    _fields_ = [
        *_STRUCT_HEAD,
        ("backend", c_enum),
        ("nranks", c_int),
        ("devices", POINTER(c_int)),
    ]


class UniqueId(Structure):
    _fields_ = [("internal", c_char * UNIQUE_ID_BYTES)]


class Config(Structure):
    _fields_ = [
        *_STRUCT_HEAD,
        ("num_experts", c_int),
        ("hidden", c_int),
        ("topk", c_int),
        ("max_tokens_per_rank", c_int),
        ("num_sms", c_int),
        ("timeout_ms", c_int),
        ("ranks_per_node", c_int),
    ]


class Routing(Structure):
    _fields_ = [
        ("num_tokens", c_int64),
        ("idx_dtype", c_enum),
        ("topk_idx", c_void_p),
        ("topk_weights", c_void_p),  # const float *
        ("routing_map", c_void_p),  # const uint8_t *
        ("probs", c_void_p),  # const float *
    ]


class HandleConfig(Structure):
    _fields_ = [
        *_STRUCT_HEAD,
        ("algo", c_enum),
        ("layout", c_enum),
        ("align", c_int),
        ("exact", c_int),
        ("recv_budget", c_int64),
    ]


class HandleInfo(Structure):
    _fields_ = [
        ("num_send_tokens", c_int64),
        ("num_recv_tokens", c_int64),
        ("num_recv_rows", c_int64),
        ("num_recv_pairs", c_int64),
        ("num_sent_copies", c_int64),
    ]


class NodeTraffic(Structure):
    _fields_ = [
        ("dispatch_bytes", c_int64),
        ("combine_bytes", c_int64),
        ("dispatch_bytes_per_rank", c_int64),
        ("combine_bytes_per_rank", c_int64),
    ]


class DispatchArgs(Structure):
    _fields_ = [
        *_STRUCT_HEAD,
        ("x", c_void_p),
        ("x_dtype", c_enum),
        ("recv_dtype", c_enum),
        ("recv_x", c_void_p),
        ("recv_scales", c_void_p),  # float *
        ("recv_capacity", c_int64),
        ("recv_topk_idx", c_void_p),  # int32_t *
        ("recv_topk_weights", c_void_p),  # float *
        ("recv_probs", c_void_p),  # float *
        ("tokens_per_local_expert", c_void_p),  # int32_t *
        ("num_recv_rows", c_void_p),  # int64_t *
        ("scale_by_probs", c_int),
        ("part", c_enum),  # epx_part_t: 0 all, 1 send, 2 complete
        ("dropped", c_void_p),  # int32_t *
    ]


class CombineArgs(Structure):
    _fields_ = [
        *_STRUCT_HEAD,
        ("y", c_void_p),
        ("y_dtype", c_enum),
        ("out", c_void_p),
        ("out_dtype", c_enum),
        ("weighted", c_int),
        ("row_probs", c_void_p),  # const float *
        ("row_weight_grad", c_void_p),  # const float *
        ("topk_weight_grad", c_void_p),  # float *
        ("part", c_enum),  # epx_part_t
    ]


# Callback types.
ALLGATHER_FN = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_void_p)
RANK_FN = CFUNCTYPE(c_enum, c_int, c_void_p)

# ---- function table ----------------------------------------------------------------------
# name: (restype, argtypes). Opaque objects are void pointers.
_P = c_void_p
_FUNCTIONS = {
    "epx_get_version": (c_int, []),
    "epx_status_string": (c_char_p, [c_enum]),
    "epx_last_error": (c_char_p, []),
    "epx_dtype_size": (c_size_t, [c_enum]),
    "epx_dtype_name": (c_char_p, [c_enum]),
    "epx_backend_name": (c_char_p, [c_enum]),
    "epx_backend_available": (c_enum, [c_enum]),
    "epx_float_to_bf16": (c_uint16, [c_float]),
    "epx_bf16_to_float": (c_float, [c_uint16]),
    "epx_float_to_e4m3": (c_uint8, [c_float]),
    "epx_e4m3_to_float": (c_float, [c_uint8]),
    "epx_quantize_row_e4m3": (None, [_P, c_int, _P, _P]),
    "epx_world_config_init": (None, [POINTER(WorldConfig)]),
    "epx_world_create": (c_enum, [POINTER(WorldConfig), POINTER(_P)]),
    "epx_world_destroy": (c_enum, [_P]),
    "epx_world_nranks": (c_int, [_P]),
    "epx_world_backend": (c_enum, [_P]),
    "epx_get_unique_id": (c_enum, [POINTER(UniqueId)]),
    "epx_world_create_rank": (c_enum, [POINTER(WorldConfig), POINTER(UniqueId), c_int, POINTER(_P)]),
    "epx_world_create_rank_with": (c_enum, [POINTER(WorldConfig), c_int, ALLGATHER_FN, _P, POINTER(_P)]),
    "epx_config_init": (None, [POINTER(Config)]),
    "epx_comm_init": (c_enum, [_P, c_int, POINTER(Config), POINTER(_P)]),
    "epx_comm_destroy": (c_enum, [_P]),
    "epx_comm_rank": (c_int, [_P]),
    "epx_comm_nranks": (c_int, [_P]),
    "epx_comm_config": (POINTER(Config), [_P]),
    "epx_comm_set_stream": (c_enum, [_P, _P]),
    "epx_comm_synchronize": (c_enum, [_P]),
    "epx_comm_abort": (c_enum, [_P]),
    "epx_comm_get_async_error": (c_enum, [_P, POINTER(c_enum)]),
    "epx_run_ranks": (c_enum, [c_int, RANK_FN, _P, POINTER(c_enum)]),
    "epx_map_to_topk": (c_enum, [c_int64, c_int, c_int, _P, _P, _P, _P]),
    "epx_topk_to_map": (c_enum, [c_int64, c_int, c_int, c_enum, _P, _P, _P, _P]),
    "epx_get_layout": (c_enum, [_P, POINTER(Routing), _P, _P, _P]),
    "epx_layout_counts": (c_enum, [c_int, c_int, c_int, POINTER(Routing), _P, _P, _P]),
    "epx_handle_config_init": (None, [POINTER(HandleConfig)]),
    "epx_handle_create": (c_enum, [_P, POINTER(HandleConfig), POINTER(_P)]),
    "epx_handle_destroy": (c_enum, [_P]),
    "epx_notify": (c_enum, [_P, _P, POINTER(Routing)]),
    "epx_handle_info": (c_enum, [_P, POINTER(HandleInfo), _P]),
    "epx_handle_node_traffic": (c_enum, [_P, POINTER(NodeTraffic)]),
    "epx_dispatch_args_init": (None, [POINTER(DispatchArgs)]),
    "epx_dispatch": (c_enum, [_P, _P, POINTER(Routing), POINTER(DispatchArgs)]),
    "epx_combine_args_init": (None, [POINTER(CombineArgs)]),
    "epx_combine": (c_enum, [_P, _P, POINTER(CombineArgs)]),
}

# Declared in epx.h but possibly missing from an older or partial build: bound when present,
# else calling them raises an UnsupportedError (see world.py).
OPTIONAL = frozenset({"epx_get_unique_id", "epx_world_create_rank", "epx_world_create_rank_with",
                      "epx_comm_synchronize", "epx_comm_abort", "epx_comm_get_async_error"})

_LIB_NAMES = ("libepx.so", "libepx.dylib")


def candidate_paths() -> list:
    """Where the loader looks, in order (see the module docstring)."""
    here = Path(__file__).resolve().parent
    out = []
    for sub in ("lib", "lib64", "."):
        for name in _LIB_NAMES:
            out.append(here / sub / name)
    env = os.environ.get("EPX_LIBRARY")
    if env:
        out.append(Path(env))
    # python/epx/_lib.py -> <checkout>/build/libepx.so
    root = here.parent.parent
    for name in _LIB_NAMES:
        out.append(root / "build" / name)
    return out


class LibraryNotFound(OSError):
    pass


class LibraryVersionMismatch(OSError):
    """The libepx found is of another version than this package: its structs may differ."""


def _version_name(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def check_library_version(dll, path: str) -> None:
    """Refuses a libepx of another version than the package's (the file VERSION)."""
    how = (f"rebuild it from this checkout (`make build`), reinstall the package (`pip install .`), or point "
           f"EPX_LIBRARY at a libepx {PACKAGE_VERSION}")
    try:
        fn = dll.epx_get_version
    except AttributeError:
        raise LibraryVersionMismatch(
            f"{path} has no epx_get_version: it is older than this epx package ({PACKAGE_VERSION}); {how}") from None
    fn.restype, fn.argtypes = c_int, []
    code = fn()
    if code != VERSION_CODE or PACKAGE_VERSION == "unknown":
        raise LibraryVersionMismatch(
            f"{path} is libepx {_version_name(code)}, but this epx package is {PACKAGE_VERSION}: the two must be "
            f"of one version (their structs may differ); {how}")


class _Lib:
    """The loaded library: ``lib.epx_xxx`` are the typed ctypes functions."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.dll = ctypes.CDLL(self.path)
        check_library_version(self.dll, self.path)
        self.missing = set()
        for name, (restype, argtypes) in _FUNCTIONS.items():
            try:
                fn = getattr(self.dll, name)
            except AttributeError:
                if name in OPTIONAL:
                    self.missing.add(name)
                    setattr(self, name, None)
                    continue
                raise OSError(f"{self.path} has no symbol {name}: it does not match epx.h") from None
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)


_lib = None


def load() -> _Lib:
    """Loads libepx once (thread-safe enough: a second load of the same path is harmless)."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for p in candidate_paths():
        if p.is_file():
            _lib = _Lib(p)
            return _lib
        tried.append(str(p))
    raise LibraryNotFound(
        "libepx was not found. Build it (`make build` in the source checkout, or "
        "`pip install .`), or point EPX_LIBRARY at libepx.so. Looked in:\n  " + "\n  ".join(tried)
    )


def library_path() -> str:
    return load().path


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("epx supports little-endian machines only")
