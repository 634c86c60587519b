"""epx-bench as a user meets it: --json writes only JSON (every figure, the floors, the check,
the machine, the command, each rank's part of a phase), the CPU report has no GPU lines,
argument errors name the argument and its range, nothing asked for is silently replaced,
--help goes to stdout."""

import json
import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "build" / "epx-bench"
SMALL = ["--backend", "host", "--ranks", "4", "--tokens", "24", "--hidden", "64", "--experts", "8", "--topk", "3"]

pytestmark = pytest.mark.skipif(not BENCH.is_file(), reason="no build/epx-bench (make build)")


def bench(*args):
    return subprocess.run([str(BENCH), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("json_arg", [["--json"], ["--json", "-"]])
def test_json_only_on_stdout(json_arg):
    out = bench(*SMALL, "--check", *json_arg, "--layout", "expert", "--align", "4")
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)  # the whole of stdout is one JSON document
    assert out.stdout.count("\n") == 1 and "phase" in out.stderr  # the table went to stderr
    for key in ("mode", "ranks", "tokens", "layout", "recv_dtype", "dispatch_ms", "combine_ms", "dispatch_floor_ms",
                "combine_floor_ms", "copy_gbps", "dispatch_memory_bytes", "standin_experts_ms", "floor", "command"):
        assert key in run, key
    assert (run["ranks"], run["tokens"], run["layout"], run["align"], run["check"]) == (4, 24, "expert", 4, "ok")
    assert run["machine"]["cpus"] >= 1 and run["machine"]["epx_version"]
    assert "--json" in run["command"]
    assert run["dispatch_floor_ms"] > 0 and run["dispatch_ms"] > 0 and run["dispatch_of_floor"] > 0
    # the floor is the bytes over the copy bandwidth, as the table says
    assert run["dispatch_floor_ms"] == pytest.approx(run["dispatch_memory_bytes"] / (run["copy_gbps"] * 1e9) * 1e3,
                                                     rel=1e-3)


def test_json_ranks_parts():
    # one iteration, so each figure is that iteration's: the phase runs from its last rank's
    # start to its last rank's end, and every rank's start and own time give both
    out = bench(*SMALL, "--iters", "1", "--json")
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    for phase in ("layout", "notify", "dispatch", "combine"):
        start, own = run[f"{phase}_rank_start_ms"], run[f"{phase}_rank_own_ms"]
        assert len(start) == len(own) == run["ranks"]
        assert min(start) == 0 and all(t > 0 for t in own)
        ends = [s + t for s, t in zip(start, own)]
        assert max(ends) - max(start) == pytest.approx(run[f"{phase}_ms"], rel=1e-4, abs=1e-6), phase


def test_json_file_and_sweep(tmp_path):
    path = tmp_path / "sweep.json"
    out = bench(*SMALL, "--sweep", "tokens", "--tokens", "512", "--iters", "1", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "phase" in out.stdout and "sweep point 3 of 3" in out.stderr
    doc = json.loads(path.read_text())
    assert doc["sweep"] == "tokens" and [r["tokens"] for r in doc["runs"]] == [128, 256, 512]


def test_cpu_report_has_no_gpu_lines():
    out = bench(*SMALL)
    assert out.returncode == 0, out.stderr
    for word in ("NVLink", "SM", "GPU"):
        assert word not in out.stdout, (word, out.stdout)
    assert "floor:" in out.stdout and "stand-in" in out.stdout
    assert [l.split()[0] for l in out.stdout.splitlines() if l.split()[:1] and l.split()[0] in
            ("layout", "notify", "dispatch", "experts", "combine")] == ["layout", "notify", "dispatch", "combine"]


@pytest.mark.parametrize("args,words", [
    (["--ranks", "3x"], ["--ranks", "[1, 64]", "3x"]),
    (["--ranks", "0"], ["--ranks", "[1, 64]"]),
    (["--tokens"], ["--tokens", "needs a value"]),
    (["--hidden", "70000"], ["--hidden", "65536"]),
    (["--mode", "fast"], ["--mode", "ht, ll, a2a"]),
    (["--mode", "ll", "--layout", "token"], ["--mode ll", "--layout token"]),
    (["--mode", "ll", "--layout", "expert", "--align", "8"], ["--align 8"]),
    (["--align", "8"], ["--layout expert"]),
    (["--experts", "6", "--ranks", "4", "--topk", "2"], ["--experts 6", "--ranks 4"]),
    (["--experts", "6", "--ranks", "2"], ["--topk 8", "--experts (6)"]),
    (["--backend", "host", "--num-sms", "8"], ["--num-sms", "CUDA"]),
    (["--backend", "host", "--sweep", "sms"], ["--sweep sms", "CUDA"]),
    (["--sweep", "size"], ["--sweep", "sms, tokens"]),
    (["--frobnicate"], ["--frobnicate", "--help"]),
])
def test_argument_errors(args, words):
    out = bench(*args)
    assert out.returncode == 2 and out.stdout == ""
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_help_on_stdout():
    out = bench("--help")
    assert out.returncode == 0 and out.stderr == "" and "--sweep" in out.stdout and "--json" in out.stdout
