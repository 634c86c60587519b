#!/bin/sh
# Installs megatron-core (PyPI) into the environment of the Python given as $1 (default
# python3), for tests/python/test_megatron_dropin.py. torch must be installed already.
#
#   ci/install-megatron.sh /path/to/venv/bin/python              # from PyPI
#   ci/install-megatron.sh --download [python]                   # fill the wheelhouse
#   ci/install-megatron.sh --offline [python [target-dir]]       # install from it, no network
#
# The wheelhouse (MEGATRON_WHEELHOUSE, default wheelhouse/ in the checkout, ignored by git)
# holds megatron-core's wheels for CPython 3.12 and 3.13 on x86_64 and the one requirement
# that torch and numpy do not cover, packaging: about 5 MB, small enough to carry to a machine
# without internet. --offline installs from it with pip --no-index, into the Python's
# environment or, given a target directory, into that directory (put it on PYTHONPATH), which
# leaves the machine's Python untouched.
#
# megatron-core 0.19 publishes wheels for CPython 3.12 and later only. Its MoE code is plain
# Python that runs on 3.11 too, so on an older interpreter (or where no wheel fits) the 3.12
# wheel's files are unpacked instead (its one compiled module, the dataset helpers, is never
# loaded by the tests).
set -eu
mode=pypi
case "${1:-}" in
  --download) mode=download; shift ;;
  --offline) mode=offline; shift ;;
esac
PY=${1:-python3}
TARGET=${2:-}
VERSION=${MEGATRON_CORE_VERSION:-0.19.2}
HOUSE=${MEGATRON_WHEELHOUSE:-$(cd "$(dirname "$0")/.." && pwd)/wheelhouse}

# the installed version, or nothing (with TARGET first on the path)
check() {
  PYTHONPATH="${TARGET:+$TARGET${PYTHONPATH:+:}}${PYTHONPATH:-}" "$PY" -c \
    'import megatron.core.transformer.moe.token_dispatcher as _, megatron.core.package_info as p; print("megatron-core", p.__version__)'
}

# where unpacked files go: TARGET, or the Python's site-packages
site() {
  if [ -n "$TARGET" ]; then mkdir -p "$TARGET" && echo "$TARGET"
  else "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; fi
}

if [ "$mode" = download ]; then
  mkdir -p "$HOUSE"
  for v in 3.12 3.13; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" \
      --platform manylinux_2_28_x86_64 -d "$HOUSE" "megatron-core==$VERSION"
  done
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$HOUSE" "packaging>=24.2"
  ls -l "$HOUSE"
  du -sh "$HOUSE"
  exit 0
fi

if [ "$mode" = offline ]; then
  ls "$HOUSE"/megatron_core-"$VERSION"-*.whl >/dev/null 2>&1 \
    || { echo "no megatron-core $VERSION wheel in $HOUSE (run $0 --download where there is internet)" >&2; exit 1; }
  # torch and numpy come from the environment: only megatron-core and packaging are installed
  pip="$PY -m pip install --quiet --no-index --find-links $HOUSE --no-deps ${TARGET:+--upgrade --target $TARGET}"
  if $pip "megatron-core==$VERSION" "packaging>=24.2"; then
    check
    exit 0
  fi
  echo "no megatron-core wheel for $("$PY" -V 2>&1) here (above): unpacking the 3.12 wheel's files" >&2
  dest=$(site)
  "$PY" -m zipfile -e "$(ls "$HOUSE"/megatron_core-"$VERSION"-cp312-*.whl | head -1)" "$dest"
  $pip "packaging>=24.2" || "$PY" -m zipfile -e "$(ls "$HOUSE"/packaging-*.whl | head -1)" "$dest"
  check
  exit 0
fi

if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  "$PY" -m pip install --quiet "megatron-core==$VERSION"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" \
    "megatron-core==$VERSION"
  "$PY" -m zipfile -e "$tmp"/megatron_core-*.whl "$(site)"
  "$PY" -m pip install --quiet "packaging>=24.2"
fi
check
