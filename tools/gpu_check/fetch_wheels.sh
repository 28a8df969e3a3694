#!/usr/bin/env bash
# Download the wheels the GPU check needs and the GPU machine lacks (no network there) into .whl/
# (git-ignored). The device image has Python 3.12, torch, numpy, packaging, pytest: only
# megatron-core (pure Python plus one small extension; ~2.6 MB) travels.
#
#   tools/gpu_check/fetch_wheels.sh [PIP]      # PIP default: .venv/bin/pip, else python3 -m pip
set -eu
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PIP=${1:-}
if [ -z "$PIP" ]; then
    if [ -x "$ROOT/.venv/bin/pip" ]; then PIP="$ROOT/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
mkdir -p "$ROOT/.whl"
rm -f "$ROOT"/.whl/megatron_core-*.whl
# shellcheck disable=SC2086
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$ROOT/.whl" "megatron-core==$MCORE_VERSION"
du -sh "$ROOT/.whl"
