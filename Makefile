# The two commands of the README:
#   make bench   builds epx and runs epx-bench --check on the best backend here
#   make test    builds epx and runs every test: CTest on the normal build, the Python tests,
#                then CTest again under ASan + UBSan
#   make test-tsan   the C tests (CPU only) under ThreadSanitizer
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
BENCH_ARGS ?=

PYTHON ?= python3

.PHONY: all build bench test test-release test-python test-install test-sanitize test-tsan clean

all: build

build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD) -j $(JOBS)

bench: build
	./$(BUILD)/epx-bench --check $(BENCH_ARGS)

test: test-release test-python test-sanitize

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The Python package against this checkout's build (numpy and pytest; torch tests skip
# without torch, GPU tests without a GPU). pytest's exit 5 (nothing collected) is no pass.
test-python: build
	$(PYTHON) -m pytest tests/python -q -p no:cacheprovider
	PYTHONPATH=python $(PYTHON) examples/train_moe.py

# `pip install .` into a fresh venv, then the Python tests against the installed package, run
# from an empty folder: neither the checkout's python/ nor a stray module can be imported instead.
test-install:
	rm -rf /tmp/epx-venv && $(PYTHON) -m venv /tmp/epx-venv
	/tmp/epx-venv/bin/pip install --progress-bar off -v . pytest  # -v: the build's progress, not a silent minute
	cd "$$(mktemp -d)" && EPX_TEST_INSTALLED=1 /tmp/epx-venv/bin/python -m pytest $(CURDIR)/tests/python -q -p no:cacheprovider

# The CUDA sources are left out here: no GPU runs them under the sanitizers anyway.
test-sanitize:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DEPX_SANITIZE=ON -DEPX_ENABLE_CUDA=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer: races between a comm's threads, the rank threads of a world, the
# bootstrap's server thread and a watchdog's abort. halt_on_error makes a race fail the test.
test-tsan:
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_TSAN=ON -DEPX_ENABLE_CUDA=OFF
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	cd $(TSAN_BUILD) && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD)
