#!/usr/bin/env bash
# Installs this build into a temporary prefix, then builds examples/minimal.c against the
# installed package as a C user would, with CMake (find_package(epx CONFIG), epx::epx) and
# with pkg-config (epx.pc), and runs both programs.
#   check_install.sh SOURCE_DIR BUILD_DIR C_COMPILER
set -euo pipefail
src=$1 build=$2 cc=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
echo "installed into $prefix:"
(cd "$prefix" && find . -type f -o -type l | sort | sed 's/^/  /')

echo "== the installed epx-bench finds the installed library"
"$prefix/bin/epx-bench" --backend host --ranks 2 --tokens 4 --hidden 64 --experts 4 --topk 2 --iters 1 --check \
  | grep '^check: ok'

echo "== CMake: find_package(epx CONFIG) -> epx::epx"
cmake -S "$src/tests/install/consumer" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DEPX_EXAMPLE="$src/examples/minimal.c" >"$tmp/cmake.log" 2>&1 \
  || { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake" >>"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; exit 1; }
"$tmp/cmake/minimal" # CMake's build RPATH points at the installed library

echo "== pkg-config: epx.pc"
if ! command -v pkg-config >/dev/null; then
  echo "pkg-config is not installed: that half is skipped"
  exit 77
fi
pcdir=$(dirname "$(find "$prefix" -name epx.pc | head -1)")
export PKG_CONFIG_PATH=$pcdir
echo "pkg-config --modversion epx: $(pkg-config --modversion epx)"
# shellcheck disable=SC2046
"$cc" -std=c11 -o "$tmp/minimal_pc" "$src/examples/minimal.c" $(pkg-config --cflags --libs epx)
LD_LIBRARY_PATH="$(pkg-config --variable=libdir epx)" "$tmp/minimal_pc"
echo "install: ok (CMake and pkg-config builds of examples/minimal.c ran)"
