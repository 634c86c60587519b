"""The CUDA settings that ranks sharing a GPU need (epx.gpu): made only when such a world is
created, never by ``import epx`` nor for a GPU per rank."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import epx
import epx.gpu as gpu
from epx import Backend

NEEDED = dict(gpu.SHARED_GPU_ENV)


def _clean_env(**extra):
    """This environment without the variables in question, the package (and its library) reachable."""
    env = {k: v for k, v in os.environ.items() if k not in NEEDED}
    env["PYTHONPATH"] = str(Path(epx.__file__).resolve().parent.parent)
    env.update(extra)
    return env


def _run(code, **extra):
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(**extra), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_changes_no_environment_variable():
    code = ("import os; before = dict(os.environ); import epx, epx.gpu; after = dict(os.environ)\n"
            "changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))\n"
            "print(changed)")
    assert _run(code) == "[]"


def test_host_worlds_change_no_environment_variable():
    """Nor do host worlds, which never reach the torch layer either."""
    code = ("import os, sys; before = dict(os.environ); import epx\n"
            "with epx.World(4, backend='host') as w: w.run(lambda r: r)\n"
            "print(sorted(k for k in os.environ if os.environ[k] != before.get(k)), 'torch' in sys.modules)")
    assert _run(code) == "[] False"


class _FakeCuda:
    """Stands in for epx.torch.streams: a GPU count and whether torch started CUDA."""

    def __init__(self, count, started):
        self.count, self.started, self.asked = count, started, 0

    def device_count(self):
        self.asked += 1
        # the settings are in place before anything that may start CUDA
        self.seen = {k: os.environ.get(k) for k in NEEDED}
        return self.count

    def cuda_started(self):
        return self.started


@pytest.fixture
def fake(monkeypatch):
    for k in NEEDED:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(gpu, "backend_available", lambda b="cuda": True)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())

    def make(count=1, started=False):
        f = _FakeCuda(count, started)
        monkeypatch.setattr(gpu, "cuda_layer", lambda: f)
        return f
    return make


@pytest.mark.parametrize("nranks,devices,count,shared", [
    (2, [0, 0], 1, True), (4, [0, 1, 0, 1], 2, True), (2, [0, 1], 2, False), (3, [2, 0, 1], 3, False),
    (4, None, 1, True), (4, None, 2, True), (4, None, 4, False), (2, None, 8, False), (1, None, 1, False),
])
def test_settings_only_where_ranks_share_a_gpu(fake, nranks, devices, count, shared):
    f = fake(count)
    set_ = gpu.prepare_shared_gpu(nranks, Backend.CUDA, devices)
    now = {k: os.environ.get(k) for k in NEEDED}
    assert set_ == (NEEDED if shared else {})
    assert now == (NEEDED if shared else {k: None for k in NEEDED})
    if devices is None and nranks > 1:
        assert f.asked == 1 and f.seen == NEEDED  # set before the count, taken back if not shared


def test_settings_keep_the_users_values(fake, monkeypatch):
    fake(1)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")
    assert gpu.prepare_shared_gpu(2, Backend.CUDA, [0, 0]) == {"CUDA_MODULE_LOADING": "EAGER"}
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "16" and os.environ["CUDA_MODULE_LOADING"] == "EAGER"


def test_settings_never_for_the_host_backend_or_without_cuda(fake, monkeypatch):
    f = fake(1)
    assert gpu.prepare_shared_gpu(4, Backend.HOST, None) == {} and f.asked == 0
    monkeypatch.setattr(gpu, "backend_available", lambda b="cuda": False)  # 'auto' becomes 'host'
    assert gpu.prepare_shared_gpu(4, Backend.AUTO, [0, 0, 0, 0]) == {}
    assert all(k not in os.environ for k in NEEDED)


def test_warns_when_torch_started_cuda_first(fake, monkeypatch):
    fake(1, started=True)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")  # what torch sets when it starts CUDA
    with pytest.warns(RuntimeWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER.*cannot take effect"):
        assert gpu.prepare_shared_gpu(2, Backend.CUDA, [0, 0]) == {}
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpu.prepare_shared_gpu(2, Backend.CUDA, [0, 1])  # a GPU per rank: nothing to warn about


def _cuda_ready():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and epx.backend_available("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU, the CUDA backend and torch")
def test_cuda_world_sets_and_warns():
    """On a GPU: a world of ranks sharing GPU 0 sets both variables before CUDA starts; one made
    after torch started CUDA warns; a one-rank-per-process world sets nothing."""
    code = ("import os, epx\n"
            "with epx.World(2, backend='cuda', devices=[0, 0]) as w:\n"
            "    print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), os.environ.get('CUDA_MODULE_LOADING'))\n")
    assert _run(code) == "32 EAGER"
    code = ("import os, warnings, torch, epx\n"
            "torch.ones(1, device='cuda')\n"
            "with warnings.catch_warnings(record=True) as got:\n"
            "    warnings.simplefilter('always')\n"
            "    epx.World(2, backend='cuda', devices=[0, 0]).close()\n"
            "print(any('cannot take effect' in str(g.message) for g in got), "
            "os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))\n")
    assert _run(code) == "True None"
    code = ("import os, epx\n"
            "u = epx.get_unique_id()\n"
            "epx.World.from_unique_id(u, 0, 1, backend='cuda', device=0).close()\n"
            "print([k for k in ('CUDA_DEVICE_MAX_CONNECTIONS', 'CUDA_MODULE_LOADING') if k in os.environ])\n")
    assert _run(code) == "[]"
