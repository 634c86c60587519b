# The two commands of the README:
#   make bench   builds epx and runs epx-bench --check on the best backend here
#   make test    builds epx and runs every test: the normal build, then ASan + UBSan
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
BENCH_ARGS ?=

.PHONY: all build bench test test-release test-sanitize clean

all: build

build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD) -j $(JOBS)

bench: build
	./$(BUILD)/epx-bench --check $(BENCH_ARGS)

test: test-release test-sanitize

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CUDA sources are left out here: no GPU runs them under the sanitizers anyway.
test-sanitize:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DEPX_SANITIZE=ON -DEPX_ENABLE_CUDA=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
