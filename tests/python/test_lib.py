"""The ctypes layer: the library loads, the structs match what libepx writes, the scalar
conversions agree with the library's."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epx
from epx import _lib
from moe_ref import rng


def _init_into(struct_cls, init_fn, guard=64):
    """Runs a C *_init on a buffer larger than the Python struct, pre-filled with 0xAB:
    the bytes past sizeof(struct) must stay untouched (C's struct is not larger)."""
    size = ctypes.sizeof(struct_cls)
    buf = (ctypes.c_uint8 * (size + guard))(*([0xAB] * (size + guard)))
    init_fn(ctypes.cast(buf, ctypes.POINTER(struct_cls)))
    assert bytes(buf[size:]) == b"\xab" * guard, f"{struct_cls.__name__}: C wrote past the Python struct"
    return struct_cls.from_buffer_copy(bytes(buf[:size]))


def test_structs_match_the_library():
    lib = _lib.load()
    c = _init_into(_lib.Config, lib.epx_config_init)
    assert (c.num_experts, c.hidden, c.topk, c.max_tokens_per_rank, c.num_sms, c.timeout_ms) == (256, 7168, 8, 128, 0, 0)
    wc = _init_into(_lib.WorldConfig, lib.epx_world_config_init)
    assert wc.backend == _lib.Backend.AUTO and wc.nranks == 1 and not wc.devices
    hc = _init_into(_lib.HandleConfig, lib.epx_handle_config_init)
    assert (hc.algo, hc.layout, hc.align, hc.exact) == (_lib.Algo.HT, _lib.Layout.TOKEN, 1, 1)
    da = _init_into(_lib.DispatchArgs, lib.epx_dispatch_args_init)
    assert da.x_dtype == da.recv_dtype == _lib.DType.BFLOAT16
    assert not da.x and not da.recv_x and da.recv_capacity == 0 and da.scale_by_probs == 0
    ca = _init_into(_lib.CombineArgs, lib.epx_combine_args_init)
    assert ca.y_dtype == ca.out_dtype == _lib.DType.BFLOAT16 and ca.weighted == 1 and not ca.row_probs
    assert epx.Config() == epx.Config._from_c(c)  # the Python defaults are the library's
    assert ctypes.sizeof(_lib.UniqueId) == _lib.UNIQUE_ID_BYTES


STRUCTS = {
    "epx_world_config_t": _lib.WorldConfig,
    "epx_unique_id_t": _lib.UniqueId,
    "epx_config_t": _lib.Config,
    "epx_routing_t": _lib.Routing,
    "epx_handle_config_t": _lib.HandleConfig,
    "epx_handle_info_t": _lib.HandleInfo,
    "epx_node_traffic_t": _lib.NodeTraffic,
    "epx_dispatch_args_t": _lib.DispatchArgs,
    "epx_combine_args_t": _lib.CombineArgs,
}


def test_struct_layout_against_the_header(tmp_path):
    """Compiles a C program against include/epx.h that prints sizeof and every field's offset,
    and compares them with the ctypes structs (needs a C compiler and the source checkout)."""
    import shutil

    header = Path(__file__).resolve().parents[2] / "include" / "epx.h"
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not header.is_file():
        pytest.skip("no C compiler or no include/epx.h")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "epx.h"', "int main(void) {"]
    for cname, cls in STRUCTS.items():
        lines.append(f'  printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for f in cls._fields_:
            lines.append(f'  printf("{cname} {f[0]} %zu\\n", offsetof({cname}, {f[0]}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(header.parent), str(src), "-o", str(exe)], check=True)
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        name, field, value = line.split()
        got[(name, field)] = int(value)
    for cname, cls in STRUCTS.items():
        assert got[(cname, "sizeof")] == ctypes.sizeof(cls), cname
        for f in cls._fields_:
            assert got[(cname, f[0])] == getattr(cls, f[0]).offset, (cname, f[0])


def test_names_and_sizes():
    lib = _lib.load()
    for d in _lib.DType:
        assert lib.epx_dtype_size(d) == _lib.DTYPE_SIZE[d]
    assert lib.epx_dtype_name(_lib.DType.BFLOAT16) == b"bfloat16"
    assert [lib.epx_backend_name(b).decode() for b in _lib.Backend] == ["host", "cuda", "auto"]
    assert lib.epx_status_string(_lib.NUM_STATUS).startswith(b"EPX_ERR_UNKNOWN")
    # the Status enum is the C enum: every value below NUM_STATUS, each named as C names it
    assert [int(s) for s in _lib.Status] == list(range(_lib.NUM_STATUS))
    for s in _lib.Status:
        assert lib.epx_status_string(s).decode().startswith(s.c_name + ":"), s
    assert epx.backend_available("host") and epx.backend_unavailable_reason("host") is None


def test_bf16_conversion_matches_library():
    lib = _lib.load()
    vals = np.concatenate([
        rng(0).standard_normal(2000).astype(np.float32) * np.float32(1e3),
        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40, 1.00390625, 1.01171875], np.float32),
    ]).astype(np.float32)
    bits = epx.float32_to_bf16_bits(vals)
    assert bits.dtype == np.uint16
    assert [int(b) for b in bits] == [lib.epx_float_to_bf16(float(v)) for v in vals]
    back = epx.bf16_bits_to_float32(bits)
    ref = np.array([lib.epx_bf16_to_float(int(b)) for b in bits], np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), ref.view(np.uint32))


def test_e4m3_tables():
    lib = _lib.load()
    codes = np.arange(256, dtype=np.uint8)
    v = epx.e4m3_to_float32(codes)
    assert np.isnan(v[0x7F]) and np.isnan(v[0xFF]) and v[0x7E] == 448.0 and v[0x01] == 2.0 ** -9
    ml = pytest.importorskip("ml_dtypes")
    np.testing.assert_array_equal(v, codes.view(ml.float8_e4m3fn).astype(np.float32))
    x = rng(1).standard_normal((3, 300)).astype(np.float32)
    q, s = epx.quantize_e4m3(x)
    assert q.shape == x.shape and s.shape == (3, 3)
    for i in range(3):
        qq = (ctypes.c_uint8 * 300)()
        ss = (ctypes.c_float * 3)()
        lib.epx_quantize_row_e4m3(x[i].ctypes.data, 300, qq, ss)
        assert bytes(qq) == q[i].tobytes() and list(ss) == list(s[i])


def test_loader_order(tmp_path):
    paths = _lib.candidate_paths()
    pkg = Path(_lib.__file__).resolve().parent
    assert paths[0] == pkg / "lib" / "libepx.so"
    assert paths[-2].parent.name == "build"
    # EPX_LIBRARY comes after the package folder and before the checkout's build/
    code = ("import epx._lib as l; p = l.candidate_paths(); import os; "
            "print(p.index(__import__('pathlib').Path(os.environ['EPX_LIBRARY'])))")
    env = dict(os.environ, EPX_LIBRARY=str(tmp_path / "libepx.so"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=str(pkg.parent), check=True)
    idx = int(out.stdout)
    assert all(p.is_relative_to(pkg) for p in _lib.candidate_paths()[:idx])


def test_import_without_torch():
    """import epx never imports torch (the numpy path must work without it)."""
    code = "import sys, epx; import numpy; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    pkg_parent = Path(epx.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(pkg_parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_missing_library_message(tmp_path):
    """With no library anywhere, the import still works and the first use says where it looked."""
    pkg = Path(epx.__file__).resolve().parent
    if (pkg / "lib").exists() or (pkg.parent.parent / "build" / "libepx.so").exists():
        # copy the pure-Python package somewhere with no library around it
        import shutil

        dst = tmp_path / "pkg" / "epx"
        shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("lib", "*.so", "include", "__pycache__"))
        parent = dst.parent
    else:
        parent = pkg.parent
    code = ("import epx\ntry:\n    epx.library_path()\nexcept epx.LibraryNotFound as e:\n    print('missing', 'EPX_LIBRARY' in str(e))\n")
    env = {k: v for k, v in os.environ.items() if k != "EPX_LIBRARY"}
    env["PYTHONPATH"] = str(parent)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert out.stdout.strip() == "missing True", (out.stdout, out.stderr)
