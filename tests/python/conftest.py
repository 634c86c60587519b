"""pytest set-up for epx's Python tests.

By default the tests import the package from this checkout (``python/epx``), which loads
``build/libepx.so`` (``make build``) or the library named by ``EPX_LIBRARY``. With
``EPX_TEST_INSTALLED=1`` they import the installed package instead (``pip install .``), which
loads the libepx inside it: that is how an install is verified.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The GPU tests run ranks sharing a GPU in this process and start CUDA (torch streams, tensors)
# before they create their worlds, too late for the settings such a world makes (epx.gpu):
# make them first, as a framework that starts CUDA early must.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

if os.environ.get("EPX_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(ROOT / "python"))

import epx  # noqa: E402
import moe_ref  # noqa: E402  (draws the run's base seed)

if os.environ.get("EPX_TEST_INSTALLED") == "1":
    # Make sure the installed copy (and its own libepx) is what runs.
    assert Path(epx.__file__).resolve().parent != (ROOT / "python" / "epx"), epx.__file__


def pytest_report_header(config):
    try:
        lib = epx.library_path()
    except Exception as e:  # pragma: no cover
        lib = f"NOT FOUND ({e})"
    return [f"epx package: {Path(epx.__file__).parent}", f"libepx: {lib}",
            f"cuda backend: {epx.backend_available('cuda') if not lib.startswith('NOT') else '?'}",
            f"random inputs: EPX_TEST_SEED={moe_ref.BASE_SEED} (set it to replay this run)"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the CUDA backend (skipped otherwise)")
    config.addinivalue_line("markers", "torch: needs PyTorch (skipped without it)")
    config.addinivalue_line("markers", "megatron: runs Megatron-core (scripts/gpu_check.sh megatron on a GPU)")


@pytest.fixture
def world4():
    with epx.World(4, backend="host") as w:
        yield w


@pytest.fixture
def world2():
    with epx.World(2, backend="host") as w:
        yield w


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"random inputs: EPX_TEST_SEED={moe_ref.BASE_SEED}")
    _torch_summary(terminalreporter)


# ---- EPX_REQUIRE_TORCH=1 (CI): the torch layer must really have been tested -----------------
# Without torch every torch test skips (or its module is never collected), and a run that
# skipped them all would pass: with the variable set, it fails instead.
_torch_runs = {"passed": 0, "skipped": 0, "failed": 0}


def pytest_runtest_logreport(report):
    if "torch" not in report.keywords:
        return
    if report.when == "call" or report.skipped or (report.failed and report.when != "call"):
        _torch_runs[report.outcome] = _torch_runs.get(report.outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("EPX_REQUIRE_TORCH") == "1" and _torch_runs["passed"] == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _torch_summary(terminalreporter):
    if os.environ.get("EPX_REQUIRE_TORCH") == "1":
        line = (f"EPX_REQUIRE_TORCH=1: {_torch_runs['passed']} torch tests passed, {_torch_runs['skipped']} skipped, "
                f"{_torch_runs['failed']} failed")
        if _torch_runs["passed"] == 0:
            line += ": FAILED, no torch test ran (is torch installed in this Python?)"
        terminalreporter.write_line(line)
