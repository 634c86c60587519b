#!/bin/sh
# Installs megatron-core (PyPI) into the environment of the Python given as $1 (default
# python3), for tests/python/test_megatron_dropin.py. torch must be installed already.
#
#   ci/install-megatron.sh /path/to/venv/bin/python
#
# megatron-core 0.19 publishes wheels for CPython 3.12 and later only. Its MoE code is plain
# Python that runs on 3.11 too, so on an older interpreter the 3.12 wheel's files are unpacked
# into site-packages instead (its one compiled module, the dataset helpers, is never loaded by
# the tests).
set -eu
PY=${1:-python3}
VERSION=${MEGATRON_CORE_VERSION:-0.19.2}

if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  "$PY" -m pip install --quiet "megatron-core==$VERSION"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" \
    "megatron-core==$VERSION"
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -m zipfile -e "$tmp"/megatron_core-*.whl "$site"
  "$PY" -m pip install --quiet "packaging>=24.2"
fi
"$PY" -c 'import megatron.core.transformer.moe.token_dispatcher as _, megatron.core.package_info as p; print("megatron-core", p.__version__)'
