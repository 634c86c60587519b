#!/usr/bin/env bash
# The SASS of one CUDA source's kernels for sm_90, on a machine without a GPU: where a kernel
# spends instructions, what it spills, how a change moved them. Compiled with the library's
# flags (Release, --fmad=false); cuobjdump and nvdisasm come from PATH, else from
# NVIDIA's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, fetched once by pip into
# build-tools/.
#
#   scripts/sass.sh src/cuda/ht.cu [kernel-regex] > ht.sass
#
# With a regex, only the kernels whose mangled names match it are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: scripts/sass.sh SOURCE.cu [kernel-regex]}
pattern=${2:-.}
cuobjdump=$(command -v cuobjdump || true)
if [ -z "$cuobjdump" ] || ! command -v nvdisasm > /dev/null; then
  tools=build-tools/cuobjdump # cuobjdump runs nvdisasm from its own folder
  if [ ! -x "$tools/bin/cuobjdump" ] || [ ! -x "$tools/bin/nvdisasm" ]; then
    mkdir -p "$tools/bin"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tools" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
    for whl in "$tools"/*.whl; do
      python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" "$tools/wheel"
    done
    for tool in cuobjdump nvdisasm; do
      cp "$(find "$tools/wheel" -type f -name $tool | head -1)" "$tools/bin/" && chmod +x "$tools/bin/$tool"
    done
  fi
  cuobjdump=$tools/bin/cuobjdump
fi
cubin=$(mktemp --suffix=.cubin)
trap 'rm -f "$cubin"' EXIT
nvcc -O3 -DNDEBUG -arch=sm_90 -cubin --fmad=false -DEPX_HAVE_CUDA=1 -Iinclude -Isrc "$src" -o "$cubin"
"$cuobjdump" -sass "$cubin" | awk -v p="$pattern" '/Function : /{keep = ($0 ~ p)} keep'
