"""One version everywhere (the file VERSION, epx.h's macros, libepx at run time, the Python
package), the struct heads of the stable ABI, and the refusal of a library of another version."""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import epx
from epx import _lib

ROOT = Path(__file__).resolve().parents[2]


def test_versions_agree():
    lib = _lib.load()
    assert _lib._version_name(lib.epx_get_version()) == epx.__version__
    version_file = ROOT / "VERSION"
    if version_file.is_file():  # a checkout
        assert version_file.read_text().strip() == epx.__version__
    header = ROOT / "include" / "epx.h"
    if header.is_file():
        text = header.read_text()
        parts = [re.search(rf"#define EPX_VERSION_{p} +(\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
        assert ".".join(parts) == epx.__version__


@pytest.mark.parametrize("cls,init", [
    (_lib.WorldConfig, "epx_world_config_init"), (_lib.Config, "epx_config_init"),
    (_lib.HandleConfig, "epx_handle_config_init"), (_lib.DispatchArgs, "epx_dispatch_args_init"),
    (_lib.CombineArgs, "epx_combine_args_init")])
def test_struct_heads(cls, init):
    s = cls()
    getattr(_lib.load(), init)(ctypes.byref(s))
    assert (s.struct_size, s.struct_version) == (ctypes.sizeof(cls), _lib.VERSION_CODE)


def test_spoilt_struct_refused():
    """A handle config of another size fails with the library's message, as a C caller's would."""
    with epx.World(nranks=1, backend="host") as world:
        def one(rank):
            with world.comm(rank, num_experts=4, hidden=16, topk=1) as comm:
                lib = _lib.load()
                hc = _lib.HandleConfig()
                lib.epx_handle_config_init(ctypes.byref(hc))
                hc.struct_size -= 4
                h = ctypes.c_void_p()
                st = lib.epx_handle_create(comm._p(), ctypes.byref(hc), ctypes.byref(h))
                return st, lib.epx_last_error().decode()
        st, msg = world.run(one)[0]
    assert st == _lib.Status.INVALID_ARGUMENT and "epx_handle_config_init" in msg and "bytes" in msg


def _stub_library(tmp_path, body):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    src = tmp_path / "stub.c"
    src.write_text(body)
    out = tmp_path / "libepx.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def test_library_of_another_version_refused(tmp_path):
    other = _lib.VERSION_CODE + 100  # the next minor release
    path = _stub_library(tmp_path, f"int epx_get_version(void) {{ return {other}; }}\n")
    with pytest.raises(epx.LibraryVersionMismatch) as e:
        _lib._Lib(path)
    assert _lib._version_name(other) in str(e.value) and epx.__version__ in str(e.value) and "EPX_LIBRARY" in str(e.value)


def test_library_without_version_refused(tmp_path):
    path = _stub_library(tmp_path, "int epx_status_string(void) { return 0; }\n")
    with pytest.raises(epx.LibraryVersionMismatch, match="no epx_get_version"):
        _lib._Lib(path)
