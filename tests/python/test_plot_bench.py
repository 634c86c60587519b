"""tools/plot_bench.py on CPU-backend JSON: epx-bench's sweeps become a PNG (skipped without
matplotlib), and gpu_check's mixed JSON lines are read (always)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tool_module import load_tool

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "build" / "epx-bench"
PLOT = ROOT / "tools" / "plot_bench.py"
SMALL = ["--backend", "host", "--ranks", "2", "--hidden", "64", "--experts", "4", "--topk", "2", "--iters", "1"]


def _plot_module():
    return load_tool("plot_bench")


def test_reads_runs_sweeps_and_lines(tmp_path):
    mod = _plot_module()
    run = {"mode": "ht", "layout": "token", "recv_dtype": "bfloat16", "tokens": 128, "ranks": 2}
    sweep = {"sweep": "sms", "machine": {"device": "x"}, "runs": [dict(run, num_sms=2), dict(run, num_sms=4)]}
    nccl = {"baseline": "nccl", "ranks": 2, "tokens": 128}
    lines = tmp_path / "bench.jsonl"
    lines.write_text("\n".join(json.dumps(d) for d in (run, sweep, nccl)) + "\n")
    runs = mod.load_runs([lines])
    assert [r["sweep"] for r in runs] == ["", "sms", "sms"] and runs[1]["machine"] == {"device": "x"}
    assert mod.series_name(dict(run, mode="a2a", layout="expert")).startswith("all-to-all baseline")


@pytest.mark.skipif(not BENCH.is_file(), reason="no build/epx-bench (make build)")
def test_png_from_cpu_sweeps(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for name, extra in (("epx", []), ("a2a", ["--mode", "a2a"])):
        path = tmp_path / f"{name}.json"
        out = subprocess.run([str(BENCH), *SMALL, "--sweep", "tokens", "--tokens", "256", "--json", str(path), *extra],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        files.append(str(path))
    png = tmp_path / "bench.png"
    out = subprocess.run([sys.executable, str(PLOT), "--out", str(png), "--title", "test", *files],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000
    assert "4 runs" in out.stdout
