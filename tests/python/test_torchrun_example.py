"""examples/torchrun_moe.py as the README runs it: two processes launched by torchrun, the CPU
backend over gloo, the layer's forward pass and token gradients checked against a dense
computation inside the example."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import epx

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_two_processes_cpu(tmp_path):
    if epx._lib.load().epx_world_create_rank_with is None:
        pytest.skip("this libepx has no epx_world_create_rank_with")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.environ.get("EPX_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "torchrun_moe.py"), "--cpu"]
    out = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 processes, backend host" in out.stdout and out.stdout.rstrip().endswith("ok"), out.stdout
