"""tools/nccl_baseline.py (the NCCL all-to-all baseline measured on GPUs) computes the MoE
layer right: run on CPU through gloo, checked against its dense layer."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("ranks", [2, 3])
def test_baseline_matches_dense(ranks):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           os.path.join(ROOT, "tools", "nccl_baseline.py"), "--device", "cpu", "--tokens", "40", "--hidden", "32",
           "--experts", str(4 * ranks), "--topk", "3", "--iters", "1", "--dtype", "fp32", "--check"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "check: ok" in r.stdout, r.stdout + r.stderr[-2000:]
